"""The canary: a small fixed batch of tokens whose log-probs the trainer computes with the weights it sends and the
engine computes with the version it just committed, before that version serves.

Bytes that land right are not yet weights that serve right: a repack the engine skipped on an update, a
quantization scale left at zero, an adapter that never reached the engine, a fused projection whose halves were
swapped, a parameter an in-place commit missed. Each passes every byte check and changes what the model computes;
the canary sees that. Rounding between the trainer's kernels (fp32, say) and the engine's (bf16) moves log-probs by
a few thousandths of a nat on average; the faults above move them by tenths. A version whose mean deviation is
above ``tolerance`` is refused: the engine keeps (or returns to) the previous one, and the trainer hears the largest
deviation and where it was.

The trainer side sends ``Canary`` with the version (``WeightsWriter.complete(v, canary=...)``); the engine side gets
it with the landed version (``WeightsReader.landed_canary``) and calls ``check`` with its own log-probs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec
import torch

from rlsync.core._errors import CanaryError, whole_number

#: mean |trainer log-prob - engine log-prob| (nats per token) above which a version is refused; rounding between
#: fp32 and bf16 kernels stays near 0.002-0.01 (docs/fail-closed.md, measured), a wrong weight moves it by tenths
DEFAULT_TOLERANCE = 0.05
#: the canary's default shape: a forward this small costs less than a millisecond of a GPU
SEQUENCES, LENGTH = 2, 16


class Canary(msgspec.Struct, frozen=True):
    """Token ids and the trainer's log-probs of each next token (``logprobs[i][j]`` is log p(``tokens[i][j + 1]`` |
    ``tokens[i][: j + 1]``)), and the mean deviation an engine may show."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    tolerance: float = DEFAULT_TOLERANCE

    @classmethod
    def of(cls, model: Any, vocab_size: int | None = None, *, tokens: Sequence[Sequence[int]] | None = None,
           tolerance: float = DEFAULT_TOLERANCE, as_sent: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> Canary:
        """The canary of ``model`` (a transformers causal LM, or any callable from token ids to logits), on
        ``tokens`` (default: ``canary_tokens`` of its vocabulary). ``as_sent(name, parameter)``: what a lossy wire
        makes of a parameter (``rlsync.wire.fp8_round_trip``): the trainer's forward then computes with the weights
        the engine gets, one module's at a time (no second copy of the model)."""
        if tokens is None:
            vocab_size = vocab_size or _vocab_size(model)
            tokens = canary_tokens(vocab_size)
        with _weights_as_sent(model, as_sent):
            logprobs = causal_lm_logprobs(model, tokens)
        return cls([list(map(int, t)) for t in tokens], logprobs, float(tolerance))

    def check(self, logprobs: Sequence[Sequence[float]], *, where: str = "the engine") -> float:
        """The mean deviation of ``logprobs`` (the engine's, same layout as ``self.logprobs``) from the trainer's;
        raises ``CanaryError`` naming the largest one and where it is when the mean is above ``tolerance``."""
        mean, worst, at = self.deviation(logprobs)
        if not mean <= self.tolerance:  # a NaN fails too
            sequence, position = at
            raise CanaryError(
                f"canary: {where}'s log-probs deviate from the trainer's by {mean:.4f} nats per token on average "
                f"(tolerance {self.tolerance}); the largest, {worst:.4f}, at token {position + 1} of canary sequence "
                f"{sequence}: the weights it computes with are not the ones sent (version refused)", mean, worst, at)
        return mean

    def deviation(self, logprobs: Sequence[Sequence[float]]) -> tuple[float, float, tuple[int, int]]:
        """``(mean, largest, (sequence, position) of the largest)`` of |engine - trainer| per token."""
        if [len(row) for row in logprobs] != [len(row) for row in self.logprobs]:
            raise CanaryError(f"canary: the engine returned log-probs of shape {[len(r) for r in logprobs]}, the trainer "
                              f"{[len(r) for r in self.logprobs]}", float("nan"), float("nan"), (0, 0))
        diffs = [[abs(float(a) - float(b)) for a, b in zip(mine, theirs)] for mine, theirs in zip(self.logprobs, logprobs)]
        flat = [(d, (i, j)) for i, row in enumerate(diffs) for j, d in enumerate(row)]
        if not flat:
            return 0.0, 0.0, (0, 0)
        nan = [(d, at) for d, at in flat if d != d]
        worst, at = nan[0] if nan else max(flat)
        return (float("nan") if nan else sum(d for d, _ in flat) / len(flat)), worst, at


def canary_tokens(vocab_size: int, sequences: int = SEQUENCES, length: int = LENGTH, seed: int = 0) -> list[list[int]]:
    """A fixed batch of token ids (the same on every machine for the same arguments)."""
    vocab_size, sequences, length = (whole_number(name, value, 1) for name, value in (
        ("vocab_size", vocab_size), ("sequences", sequences), ("length", length)))
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (sequences, length), generator=generator).tolist()


def causal_lm_logprobs(model: Any, tokens: Sequence[Sequence[int]]) -> list[list[float]]:
    """log p(``tokens[i][j + 1]`` | ``tokens[i][: j + 1]``) under ``model`` (a transformers causal LM: ``model(input_ids=
    ...).logits``; or a callable from a ``[batch, length]`` id tensor to logits), computed on the model's device in
    float32. Equal-length rows, one forward."""
    ids = torch.tensor([list(t) for t in tokens], dtype=torch.int64, device=_device(model))
    module = model if isinstance(model, torch.nn.Module) else None
    training = module is not None and module.training
    if module is not None:
        module.eval()  # a trainer's model is in training mode: no dropout in the canary
    try:
        with torch.no_grad():
            out = model(input_ids=ids) if module is not None else model(ids)
            logits = getattr(out, "logits", out).float()
            picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    finally:
        if module is not None:
            module.train(training)
    return [[float(x) for x in row] for row in picked.cpu().tolist()]


@contextmanager
def _weights_as_sent(model: Any, as_sent: Callable[[str, torch.Tensor], torch.Tensor] | None) -> Iterator[None]:
    """While a module runs its forward, its own parameters are ``as_sent`` of them; put back right after."""
    if as_sent is None or not isinstance(model, torch.nn.Module):
        yield
        return
    handles = []
    for qualname, module in model.named_modules():
        own = [n for n, p in module._parameters.items() if p is not None]
        if not own:
            continue

        def swap_in(mod: torch.nn.Module, _args: Any, _prefix: str = qualname, _own: list[str] = own) -> None:
            mod.__dict__["_rlsync_live"] = {n: mod._parameters[n] for n in _own}
            for n in _own:
                mod._parameters[n] = as_sent(f"{_prefix}.{n}".lstrip("."), mod._parameters[n].detach())  # type: ignore[union-attr, assignment]

        def swap_out(mod: torch.nn.Module, _args: Any, _out: Any) -> None:
            mod._parameters.update(mod.__dict__.pop("_rlsync_live"))

        handles += [module.register_forward_pre_hook(swap_in), module.register_forward_hook(swap_out)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _vocab_size(model: Any) -> int:
    config: Any = getattr(model, "config", None)
    size = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", None)
    if size is None:
        raise CanaryError("Canary.of: pass vocab_size= (the model has no config.vocab_size)", float("nan"), float("nan"), (0, 0))
    return int(size)


def _device(model: Any) -> torch.device:
    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


#: what the engine side runs: token ids -> per-token log-probs (``causal_lm_logprobs`` bound to a model, vLLM's
#: prompt log-probs)
LogprobsOf = Callable[[Sequence[Sequence[int]]], Sequence[Sequence[float]]]
