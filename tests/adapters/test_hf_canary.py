"""The canary on a transformers engine (``ModuleReceiver``): an fp32 trainer into a bf16 module passes every version
with a small deviation, reported to the trainer; a fault that leaves the bytes right but the computation wrong is
refused with the largest deviation named, and the module keeps serving the previous version. Each fault passes
silently with the canary off."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from _support import hf_writer  # noqa: E402

import rlsync  # noqa: E402
from rlsync import Canary, CanaryError, SyncOptions, WeightsWriter  # noqa: E402
from rlsync.adapters.hf import ModuleReceiver  # noqa: E402
from rlsync.layouts import from_state_dict  # noqa: E402
from rlsync.wire import fp8_round_trip  # noqa: E402

SKIPPED = "model.layers.1.mlp.down_proj.weight"


def trainer(seed: int) -> torch.nn.Module:
    """A tiny Qwen2 in fp32 (a trainer's master weights), peaked like a trained LM (a random init at the usual scale
    predicts nearly uniform next tokens: then any weights give the same log-probs and no check can tell them apart)."""
    model = hf_writer.tiny_qwen2(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 1.0 if name == "lm_head.weight" else 0.2)
    return model


def sent(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What reaches a bf16 engine: the trainer's weights cast to its dtype (tied aliases left out)."""
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


@contextmanager
def engine(wire: str = "full", canary: bool = True, verify: bool = False) -> Iterator[tuple[torch.nn.Module, ModuleReceiver, WeightsWriter]]:
    module = trainer(0).to(torch.bfloat16)
    options = SyncOptions(wire=wire, canary=canary, verify=verify)
    with ModuleReceiver(module, options=options) as receiver:
        writer = WeightsWriter(from_state_dict(sent(module)), None, 0, [receiver.address], options=options)
        try:
            yield module, receiver, writer
        finally:
            writer.close()


def push(writer: WeightsWriter, model: torch.nn.Module, version: int, canary: bool = True) -> None:
    writer.multi_put(sent(model))
    def as_sent(name: str, weight: torch.Tensor) -> torch.Tensor:  # what the engine gets: bf16, then fp8 and back
        return fp8_round_trip(name, weight.to(torch.bfloat16)).to(weight.dtype)

    lossy = writer.options.wire == "fp8"
    writer.complete(version, canary=Canary.of(model, as_sent=as_sent if lossy else None) if canary else None)


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("wire", ["full", "fp8"])
def test_healthy_versions_pass_with_a_small_deviation_reported_to_the_trainer(wire: str) -> None:
    deviations: list[float] = []
    with pytest.warns(rlsync.RlsyncWarning) if wire == "fp8" else nullcontext(), engine(wire) as (module, receiver, writer):
        for version, seed in ((1, 11), (2, 22), (3, 33)):
            push(writer, trainer(seed), version)
            assert receiver.version == version
            deviations.append(writer.last_canary_deviation)  # type: ignore[arg-type]
    print(wire, "healthy canary deviations", deviations)
    assert all(0 < d < 0.02 for d in deviations), deviations  # rounding: fp32 trainer, bf16 engine (fp8: as sent)


def skip_one_parameter(receiver: ModuleReceiver) -> None:
    """The commit misses one parameter: it keeps the previous version's values."""
    del receiver._params[SKIPPED]


def fp8_scale_left_at_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8 ``down_proj`` weights dequantized with a zero scale (verl PR #7224's failure: the load succeeds)."""
    from rlsync.wire import dequantize as real

    calls = [0]

    def zero_first_scale(q: Any, scale: Any, dtype: Any) -> Any:
        calls[0] += 1
        return real(q, scale * 0 if calls[0] % 7 == 0 else scale, dtype)  # per layer: q k v o gate up down

    monkeypatch.setattr("rlsync.adapters.hf._receiver.dequantize", zero_first_scale)  # where the receiver calls it


@pytest.mark.parametrize("fault", ["skipped parameter", "fp8 scale at zero"])
def test_a_fault_the_bytes_do_not_show_is_refused_and_the_previous_version_serves(fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    wire = "fp8" if "fp8" in fault else "full"
    with pytest.warns(rlsync.RlsyncWarning) if wire == "fp8" else nullcontext(), engine(wire) as (module, receiver, writer):
        push(writer, trainer(11), 1)
        before = params(module)
        if fault == "skipped parameter":
            skip_one_parameter(receiver)
        else:
            fp8_scale_left_at_zero(monkeypatch)
        with pytest.raises(CanaryError, match=r"deviate from the trainer's by .* the largest, .* at token \d+ of canary sequence \d") as refused:
            push(writer, trainer(22), 2)
        print(fault, refused.value)
        assert refused.value.args and receiver.version == 1
        after = params(module)
        assert all(torch.equal(before[n], after[n]) for n in before)  # the previous version, every byte of it


@pytest.mark.parametrize("fault", ["skipped parameter", "fp8 scale at zero"])
def test_without_the_canary_the_same_fault_passes_silently(fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    wire = "fp8" if "fp8" in fault else "full"
    with pytest.warns(rlsync.RlsyncWarning) if wire == "fp8" else nullcontext(), engine(wire, canary=False) as (module, receiver, writer):
        push(writer, trainer(11), 1)
        if fault == "skipped parameter":
            skip_one_parameter(receiver)
        else:
            fp8_scale_left_at_zero(monkeypatch)
        model = trainer(22)
        push(writer, model, 2)  # the writer sends its canary; this engine does not check it
        assert receiver.version == 2 and writer.last_canary_deviation is None  # "live", and wrong:
        canary = Canary.of(model)
        mean, _, _ = canary.deviation(rlsync.causal_lm_logprobs(module, canary.tokens))
        assert mean > canary.tolerance


def test_with_verify_a_commit_that_misses_a_parameter_is_caught_in_the_parameters() -> None:
    """Checksums alone (canary off): the landed bytes match the trainer's, the parameter does not."""
    with engine(canary=False, verify=True) as (module, receiver, writer):
        push(writer, trainer(11), 1)
        before = params(module)
        skip_one_parameter(receiver)
        with pytest.raises(rlsync.PeerLostError, match=rf"parameter '{SKIPPED}' holds other bytes than the ones that landed"):
            push(writer, trainer(22), 2)
        assert receiver.version == 1 and all(torch.equal(before[n], p) for n, p in params(module).items())


def test_the_canary_check_and_its_report() -> None:
    canary = Canary([[1, 2, 3]], [[-1.0, -2.0]], tolerance=0.1)
    assert canary.check([[-1.05, -2.05]]) == pytest.approx(0.05)
    with pytest.raises(CanaryError, match=r"by 0.5500 .* the largest, 1.0000, at token 2 of canary sequence 0") as refused:
        canary.check([[-1.1, -3.0]])
    assert refused.value.at == (0, 1) and refused.value.largest == pytest.approx(1.0)
    with pytest.raises(CanaryError, match="nan"):
        canary.check([[float("nan"), -2.0]])
    with pytest.raises(CanaryError, match="shape"):
        canary.check([[-1.0]])
    assert rlsync.canary_tokens(100) == rlsync.canary_tokens(100) and len(rlsync.canary_tokens(100)) == 2


def test_in_place_a_version_the_canary_refuses_is_undone_from_the_last_one() -> None:
    """``landing="in_place"``: the writer writes the parameters themselves; a version whose canary deviates (here the
    bytes of another model than the one the canary was computed with) is undone from the reader's copy of the last
    version, and the module serves that one."""
    from rlsync.testing import MemoryTransport

    module = trainer(0).to(torch.bfloat16)
    options = SyncOptions(transport=MemoryTransport)
    with ModuleReceiver(module, options=options, landing="in_place") as receiver:
        writer = WeightsWriter(from_state_dict(sent(module)), None, 0, [receiver.address], options=options)
        push(writer, trainer(11), 1)
        assert receiver.version == 1 and 0 < writer.last_canary_deviation < 0.02  # type: ignore[operator]
        before = params(module)
        writer.multi_put(sent(trainer(33)))  # one model's bytes, another's canary
        with pytest.raises(CanaryError, match="deviate from the trainer's"):
            writer.complete(2, canary=Canary.of(trainer(22)))
        assert receiver.version == 1 and all(torch.equal(before[n], p) for n, p in params(module).items())
        writer.close()
