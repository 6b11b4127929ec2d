"""verl's own driver classes, ``RayPPOTrainer`` (``verl/trainer/ppo/ray_trainer.py``) and ``AgentLoopManager``
(``verl/experimental/agent_loop/agent_loop.py``), for the timeline's test: built without their ``__init__`` (which
starts Ray worker groups and vLLM servers), with verl's generated default config, so that their own
``_update_actor`` and ``generate_sequences`` run as verl's ``fit`` calls them. Below them, two stand-ins:

- ``FakeActorWorkerGroup`` is a FAKE of the trainer's worker group (``actor_rollout_wg``): ``update_actor`` takes the
  TensorDict verl's ``_update_actor`` builds and answers the metrics verl's worker answers (``mfu`` and a loss).
- ``FakeAgentLoopWorker`` is a FAKE of verl's ``AgentLoopWorker`` (a Ray actor): ``generate_sequences.remote(chunk)``,
  awaited by the manager, gives the chunk's output as verl's worker does (``prompts``, ``responses`` of ``RESPONSE``
  tokens, their ``response_mask``, ``attention_mask``, one metrics entry per sample) after ``SECONDS``."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace
from typing import Any

import torch
import verl
from omegaconf import OmegaConf
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopManager
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils import tensordict_utils as tu

PROMPT, RESPONSE, SECONDS = 3, 5, 0.05


class FakeActorWorkerGroup:
    """FAKE of verl's trainer worker group; see the module docstring."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def update_actor(self, batch: Any) -> Any:
        self.batches.append(batch)
        return tu.get_tensordict({}, {"metrics": {"mfu": 0.5, "pg_loss": 0.1}})


class FakeAgentLoopWorker:
    """FAKE of verl's agent loop worker; see the module docstring."""

    def __init__(self) -> None:
        self.generate_sequences = SimpleNamespace(remote=self._generate)

    async def _generate(self, chunk: Any) -> Any:
        await asyncio.sleep(SECONDS)
        n = len(chunk)
        out = DataProto.from_dict(tensors={
            "prompts": torch.ones(n, PROMPT, dtype=torch.long), "responses": torch.ones(n, RESPONSE, dtype=torch.long),
            "response_mask": torch.ones(n, RESPONSE, dtype=torch.long),
            "attention_mask": torch.ones(n, PROMPT + RESPONSE, dtype=torch.long)})
        out.meta_info["metrics"] = [{"generate_sequences": SECONDS, "tool_calls": 0.0, "compute_score": 0.0,
                                     "num_preempted": 0}] * n
        return out


def driver(step: int) -> tuple[Any, Any]:
    """verl's trainer at ``step`` and its agent loop manager (two workers), over the stand-ins above."""
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                                 "_generated_ppo_trainer.yaml"))
    trainer.global_steps = step
    trainer.actor_rollout_wg = FakeActorWorkerGroup()
    manager = AgentLoopManager.__new__(AgentLoopManager)
    manager.agent_loop_workers = [FakeAgentLoopWorker(), FakeAgentLoopWorker()]
    return trainer, manager


def prompts(n: int) -> Any:
    return DataProto.from_dict(tensors={"input_ids": torch.ones(n, PROMPT, dtype=torch.long)})


def trained_batch(n: int) -> Any:
    """A batch as verl's ``_update_actor`` takes it (left-right padded: what ``left_right_2_no_padding`` reads)."""
    width = PROMPT + RESPONSE
    return DataProto.from_dict(tensors={
        "input_ids": torch.ones(n, width, dtype=torch.long), "attention_mask": torch.ones(n, width, dtype=torch.long),
        "response_mask": torch.ones(n, RESPONSE, dtype=torch.long), "position_ids": torch.arange(width).repeat(n, 1)})
