"""Driver side of the worker-extension route: one call per version, from the process that owns the ``LLM``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlsync import DEFAULT_TIMEOUT, Canary, VersionError, version_label

STARTING_LABEL = "default"  # vLLM's weight version label before any update (``EngineCore._weight_version``)


def label_version(label: Any, *, base: int = 0) -> int:
    """The version in a weight version label rlsync makes live ("V", "V+DIGEST", "NAME@V", "NAME@V+DIGEST");
    ``base`` for vLLM's starting label (the weights the engine started with)."""
    if label is None or str(label) == STARTING_LABEL:
        return base
    number = str(label).rsplit("@", 1)[-1].split("+", 1)[0]
    if not number.lstrip("-").isdigit():
        raise VersionError(f"weight version label {label!r} is not one of rlsync's ('V', 'V+DIGEST', 'NAME@V')")
    return int(number)


def apply_next_version(llm: Any, timeout: float = DEFAULT_TIMEOUT) -> int:
    """Every worker loads the next version that has fully landed (``rlsync_apply``); then the prefix cache is
    reset (cached prefixes hold activations computed with the old weights) and the version becomes the
    engine's weight version, which vLLM reports on every output. Call it between ``generate`` calls.
    Returns the version; raises if none arrives within ``timeout`` (the engine keeps the old weights).

    A version that came with the trainer's canary (``rlsync.Canary``) is checked before it serves: the engine's
    prompt log-probs of the canary tokens against the trainer's. One that deviates is undone on every worker and
    ``CanaryError`` is raised here and in the trainer's ``complete``: the engine serves the previous version."""
    versions = llm.collective_rpc("rlsync_apply", args=(timeout, True))
    if len(set(versions)) != 1:
        raise VersionError(f"vLLM workers loaded different weight versions {versions}: restart the update")
    try:
        check_held_canary(llm, "rlsync_canary", "rlsync_settle", where="the vLLM engine", new_weights=True)
    finally:
        llm.reset_prefix_cache()
    # with verify, the label vLLM stamps on every output binds the version to its bytes: "V+DIGEST" of the checksums
    # every worker checked its landed bytes against (what the trainer's writer computes too: version_label)
    llm.update_weight_version(version_label(int(versions[0]), llm.collective_rpc("rlsync_digest")))
    return int(versions[0])


def check_held_canary(llm: Any, canary_rpc: str, settle_rpc: str, *, where: str, lora_request: Any = None,
                      new_weights: bool = False) -> None:
    """The held version's canary (``canary_rpc``; none: nothing to do) against the engine's prompt log-probs, then
    ``settle_rpc`` on every worker: kept with its deviation, or undone with the reason (``CanaryError`` raised here).
    ``new_weights``: the base weights changed, so cached prefixes are dropped first (an adapter has its own)."""
    canary = llm.collective_rpc(canary_rpc)[0]
    if canary is None:
        return
    if new_weights:
        llm.reset_prefix_cache()  # the canary's prompt must run on the new weights, not hit a cached prefix
    try:
        checked = Canary(**canary)
        deviation = checked.check(prompt_logprobs(llm, checked.tokens, lora_request), where=where)
    except BaseException as exc:
        llm.collective_rpc(settle_rpc, args=(str(exc), None))
        raise
    llm.collective_rpc(settle_rpc, args=(None, deviation))


def prompt_logprobs(llm: Any, tokens: Sequence[Sequence[int]], lora_request: Any = None) -> list[list[float]]:
    """log p(``tokens[i][j + 1]`` | ``tokens[i][: j + 1]``) as the engine computes them (vLLM's prompt log-probs, raw),
    with the adapter of ``lora_request`` if given: then as one-token generations from each prefix, each asking its own
    token's log-prob by id, because vLLM's prompt log-probs with a LoRA adapter run on the wrong LoRA mapping once a
    batch holds more than one request and kill the engine core (vLLM issues 16668 and 29955)."""
    if lora_request is None:
        outs = llm.generate([{"prompt_token_ids": list(t)} for t in tokens], canary_sampling_params(), use_tqdm=False)
        return prompt_logprobs_of(outs, tokens)
    from vllm import SamplingParams

    wanted = [(i, j) for i, row in enumerate(tokens) for j in range(1, len(row))]
    params = [SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=[int(tokens[i][j])],
                             detokenize=False) for i, j in wanted]
    outs = llm.generate([{"prompt_token_ids": list(tokens[i][:j])} for i, j in wanted], params, use_tqdm=False,
                        lora_request=lora_request)
    rows = [[0.0] * max(len(row) - 1, 0) for row in tokens]
    for (i, j), out in zip(wanted, outs):
        rows[i][j - 1] = float(out.outputs[0].logprobs[0][int(tokens[i][j])].logprob)
    return rows


def canary_sampling_params() -> Any:
    """vLLM's ``SamplingParams`` that make a request return its prompt's log-probs and generate one token."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)


def prompt_logprobs_of(outputs: Sequence[Any], tokens: Sequence[Sequence[int]]) -> list[list[float]]:
    """The prompt log-probs of ``tokens`` in vLLM's ``RequestOutput``s of them (``canary_sampling_params``), in the
    canary's layout (``rlsync.Canary.logprobs``): from any route to the engine (``LLM``, an engine actor)."""
    return [[float(position[token].logprob) for position, token in zip(out.prompt_logprobs[1:], t[1:])]
            for out, t in zip(outputs, tokens)]


def token_versions(completion: Any, *, base: int = 0) -> np.ndarray:
    """The weight version that sampled each generated token of ``completion`` (vLLM's ``CompletionOutput``), from the
    spans vLLM records (``weight_versions``) of the labels rlsync makes live ("V", "V+DIGEST", "NAME@V"): a request
    that ran across a sync carries both versions, token by token. Tokens no label covers were sampled by the weights
    the engine started with (vLLM labels them "default"): ``base``."""
    versions = np.full(len(completion.token_ids), base, dtype=np.int64)
    for span in completion.weight_versions or ():
        versions[span.start:span.end] = label_version(span.version, base=base)
    return versions
