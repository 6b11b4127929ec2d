"""An OpenRLHF agent (what a user's ``--agent_func_path`` file holds: ``AgentExecutor``, a ``MultiTurnAgentExecutor``
of an ``AgentInstance``), for tests/frameworks/openrlhf/test_openrlhf_episodes.py. Its environment is a counting tool:
every ``reset`` and ``step`` appends its call key (``rlsync.adapters.openrlhf.tool_call_key()``) to the file named by
``RLSYNC_TEST_TOOL_LOG`` (the side effect the test counts), marked when the episode had recorded that step's result
already (it must never run then), and takes a while (kills land mid-step too). The instance keeps its turn count on
itself, as OpenRLHF's example agent does: a replay that did not give it back would end rollouts otherwise."""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

import redis
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

from rlsync.adapters.openrlhf import tool_call_key

TOOL_TURNS = 2  # steps before the rollout is done
_observer = redis.Redis.from_url(os.environ["RLSYNC_TEST_REDIS"])


async def _count_call(kind: str) -> None:
    key = tool_call_key()
    assert key is not None, "rlsync hands every recorded step its key"
    episode, step = key.rsplit("/", 1)
    again = int(_observer.llen(f"{os.environ['RLSYNC_TEST_EPISODES']}:ep:{episode}:steps")) > int(step) + 1
    with open(os.environ["RLSYNC_TEST_TOOL_LOG"], "a") as out:
        out.write(f"{kind} {key}" + (" AFTER-ITS-RESULT-WAS-RECORDED" if again else "") + "\n")
    await asyncio.sleep(random.uniform(0.05, 0.2))


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.turns = 0

    async def reset(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        await _count_call("reset")
        return {"observation": states["observation"]}

    async def step(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        await _count_call("step")
        self.turns += 1
        words = states["action_text"].split()
        answer = f"w{(len(words) * 7 + 3 + self.turns) % 40}"
        return {"rewards": torch.tensor(float(self.turns)), "scores": torch.tensor(len(words) / 10),
                "environment_feedback": f" <tool> {answer} <end> <assistant>", "done": self.turns >= TOOL_TURNS,
                "extra_logs": {"turns": self.turns}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self) -> None:
        super().__init__(AgentInstance)
