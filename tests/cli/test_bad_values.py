"""#58: every public constructor and CLI flag that takes a number or a name, fed bad values (negative, zero, NaN,
infinite, the wrong type, huge, a typo): each ends in a clear one-line error naming what it got, within a second,
never a hang, a traceback or a run of the bench. Before #58 several hung (`--size 0`, `--tensors 10000000000`,
`--train fsdp:dp=100000000`, `--wire delta --lr nan`), ran on a negative or out-of-range number (`plan --rank -1`,
`--nic-gbps inf`), or ended in a traceback (`--device tpu`, `--tokens 1000000000000`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

import rlsync
from rlsync import layouts
from rlsync.cli import app

NAN, INF = float("nan"), float("inf")
LAYOUT = None  # a one-tensor layout, built once rlsync is imported (the module fixture)
SPEC = None  # a preset's model, the same
# seconds: each refusal takes milliseconds once rlsync and torch are imported (well under a second on an idle
# machine); 5 lets a CI machine busy with another session pass, while a hang or a bench that started takes far longer
WITHIN = 5.0


def within_a_second(call: Callable[[], Any]) -> Any:
    """``call()``'s result or exception, or a failure when it is still running after ``WITHIN`` seconds (a hang, or
    a bench that started)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:  # noqa: BLE001 - the test inspects what was raised
            outcome["raised"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(WITHIN)
    assert not worker.is_alive(), f"still running after {WITHIN} s: a hang, or work that the value should have stopped"
    return outcome


CONSTRUCTORS: list[tuple[str, Callable[[Any], Any], list[Any]]] = [
    ("SyncOptions(timeout)", lambda v: rlsync.SyncOptions(timeout=v), [-1, 0, NAN, "x", None]),
    ("SyncOptions(port)", lambda v: rlsync.SyncOptions(port=v), [-1, 70000, NAN, "x"]),
    ("SyncOptions(transport)", lambda v: rlsync.SyncOptions(transport=v), ["shmm", 3, ""]),
    ("SyncOptions(wire)", lambda v: rlsync.SyncOptions(wire=v), ["fp4", 3]),
    ("SyncOptions(verify)", lambda v: rlsync.SyncOptions(verify=v), ["yes", 2]),
    ("make_buffer(batch_size)", lambda v: rlsync.make_buffer("memory", batch_size=v), [0, -1, NAN, "x", 10**30, None, True]),
    ("make_buffer(max_staleness)", lambda v: rlsync.make_buffer("memory", batch_size=2, max_staleness=v), [-1, NAN, "x", 1.5]),
    ("make_buffer(group_size)", lambda v: rlsync.make_buffer("memory", batch_size=2, group_size=v), [0, -2, NAN]),
    ("make_buffer(on_stale)", lambda v: rlsync.make_buffer("memory", batch_size=2, on_stale=v), ["skip", None]),
    ("make_buffer(backend)", lambda v: rlsync.make_buffer(v, batch_size=2), ["memroy", 3]),
    ("MaxStaleness", lambda v: rlsync.MaxStaleness(v), [-1, NAN, "x", True]),
    ("WeightsReader(rank)", lambda v: rlsync.WeightsReader(LAYOUT, LAYOUT, v), [-1, "x", NAN, 1.0]),
    ("WeightsReader(landing)", lambda v: rlsync.WeightsReader(LAYOUT, LAYOUT, 0, landing=v), ["directt", 3]),
    ("WeightsWriter(rank)", lambda v: rlsync.WeightsWriter(LAYOUT, LAYOUT, v, ["tcp://127.0.0.1:1"]), [-1, "x", NAN]),
    ("WeightsWriter(readers)", lambda v: rlsync.WeightsWriter(LAYOUT, LAYOUT, 0, v), ["tcp://127.0.0.1:1", [3], {0: 3}]),
    ("PolicyVersionClock", lambda v: rlsync.PolicyVersionClock(v), [-1, NAN, "x"]),
    ("layouts.fsdp(world)", lambda v: layouts.fsdp(SPEC.tensors, v), [0, -1, "x", NAN]),
    ("layouts.zero3(world)", lambda v: layouts.zero3(SPEC.tensors, v), [0, -1]),
    ("layouts.flat_partitions(world)", lambda v: layouts.flat_partitions(SPEC.tensors, v), [0, -1]),
    ("layouts.megatron(tp)", lambda v: layouts.megatron(SPEC, v), [0, -1, "x"]),
    ("layouts.megatron(pp)", lambda v: layouts.megatron(SPEC, 1, v), [0, -1]),
    ("layouts.engine_tp(tp)", lambda v: layouts.engine_tp(SPEC, v), [0, -1]),
    ("layouts.engine_tp(replicas)", lambda v: layouts.engine_tp(SPEC, 1, v), [0, -1]),
    ("layouts.replicated(ranks)", lambda v: layouts.replicated(SPEC.tensors, v), [[-1], "x"]),
    ("canary_tokens(vocab_size)", lambda v: rlsync.canary_tokens(v), [0, -1, NAN]),
    ("importance_weights(cap)", lambda v: rlsync.importance_weights(np.zeros(2), np.zeros(2), cap=v), [0, -1, NAN, INF, "x"]),
]


@pytest.mark.parametrize(("name", "make", "values"), CONSTRUCTORS, ids=[c[0] for c in CONSTRUCTORS])
def test_a_constructor_given_a_bad_value_says_so_in_one_line(name: str, make: Callable[[Any], Any], values: list[Any]) -> None:
    for value in values:
        outcome = within_a_second(lambda: make(value))
        raised = outcome.get("raised")
        assert isinstance(raised, (rlsync.ConfigError, rlsync.PluginError)), f"{name} with {value!r}: {outcome}"
        shown = [value, *(value if isinstance(value, list) else [])]  # a list's bad element is named alone
        assert "\n" not in str(raised) and any(repr(v) in str(raised) or str(v) in str(raised) for v in shown), str(raised)


# (arguments, what the error must name); bench cases would otherwise start a bench, plan cases build a plan
FLAGS: list[tuple[list[str], str]] = [
    (["plan", "--nic-gbps", "-5"], "--nic-gbps"), (["plan", "--nic-gbps", "nan"], "--nic-gbps"),
    (["plan", "--nic-gbps", "0"], "--nic-gbps"), (["plan", "--host-us-per-tensor", "-1"], "--host-us-per-tensor"),
    (["plan", "--host-us-per-tensor", "nan"], "--host-us-per-tensor"), (["plan", "--rank", "-1"], "--rank"),
    (["plan", "--rank", "99999"], "--rank"), (["plan", "--rank", "x"], "--rank"),
    (["plan", "--relay-per-node", "-1"], "--relay-per-node"), (["plan", "--train", "fsdp:dp=100000000"], "--train"),
    (["plan", "--train", "fsdp:dp=0"], "--train"), (["plan", "--train", "fsdp:dp=-2"], "--train"),
    (["plan", "--train", "megatorn:tp=2"], "--train"), (["plan", "--infer", "vllm:tp=100000000"], "--infer"),
    (["plan", "--infer", "vllm:tp=x"], "--infer"), (["plan", "--model", "nosuch"], "nosuch"),
    (["plan", "--wire", "delta=nan"], "--wire"), (["plan", "--wire", "delta=-0.5"], "--wire"),
    (["plan", "--wire", "fp4"], "--wire"),
    (["bench", "--size", "0"], "--size"), (["bench", "--size", "-1GiB"], "--size"), (["bench", "--size", "abc"], "--size"),
    (["bench", "--size", "1e30GiB"], "--size"), (["bench", "--size", "100000TiB"], "--size"),
    (["bench", "--tensors", "10", "--size", "100000TiB"], "--size"), (["bench", "--device", "cpu", "--size", "100000TiB"], "--size"),
    (["bench", "--wire", "delta", "--size", "100000TiB"], "--size"),
    (["bench", "--repeats", "0"], "--repeats"), (["bench", "--repeats", "-2"], "--repeats"),
    (["bench", "--tensors", "0"], "--tensors"), (["bench", "--tensors", "-5"], "--tensors"),
    (["bench", "--tensors", "10000000000"], "--tensors"),
    (["bench", "--wire", "delta", "--lr", "nan"], "--lr"), (["bench", "--wire", "delta", "--lr", "-1"], "--lr"),
    (["bench", "--wire", "delta", "--lr", "inf"], "--lr"), (["bench", "--wire", "delta", "--steps", "0"], "--steps"),
    (["bench", "--wire", "delta", "--link-gbps", "0"], "--link-gbps"),
    (["bench", "--wire", "delta", "--link-gbps", "nan"], "--link-gbps"),
    (["bench", "--wire", "delta", "--link-gbps", "1", "--fanout-ranks", "100000"], "--fanout-ranks"),
    (["bench", "--wire", "fp8"], "--wire"), (["bench", "--link-gbps", "1"], "--link-gbps"),
    (["bench", "--device", "cpu", "--path-timeout", "0"], "--path-timeout"),
    (["bench", "--device", "tpu"], "--device"), (["bench", "--transports", "shmm"], "shmm"),
    (["bench", "--engine", "sglangx"], "sglangx"), (["bench", "--engine", "vllm", "--engine-model", "huge"], "huge"),
    (["bench", "--sampling-mask", "--tokens", "0"], "--tokens"),
    (["bench", "--sampling-mask", "--tokens", "1000000000000"], "--tokens"),
    (["launch", "opnrlhf"], "opnrlhf"),
]


@pytest.mark.parametrize(("args", "named"), FLAGS, ids=[" ".join(a) for a, _ in FLAGS])
def test_a_flag_given_a_bad_value_is_a_usage_error_naming_it(args: list[str], named: str) -> None:
    outcome = within_a_second(lambda: CliRunner().invoke(app, args))
    result = outcome["result"]
    if isinstance(result.exception, rlsync.RlsyncError):  # `rlsync` prints it as one line and exits 2 (cli.main)
        message = str(result.exception)
        assert "\n" not in message and named in message, message
    else:  # typer's usage error: exit 2, the option named in its box
        assert result.exit_code == 2 and not isinstance(result.exception, (AssertionError, typer.Exit)), result.output
        assert named in " ".join(result.output.replace("│", " ").split()), result.output


@pytest.fixture(autouse=True, scope="module")
def imported() -> None:
    """What the refusals stand in front of is imported first: the second is for the check, not for torch's import."""
    import rlsync.bench  # noqa: F401
    import rlsync._plan_command  # noqa: F401

    rlsync.SyncOptions()
    rlsync.make_buffer("memory", batch_size=1)
    global LAYOUT, SPEC
    import torch

    from rlsync.layouts import from_state_dict, load_model_spec

    LAYOUT = from_state_dict({"w": torch.zeros(8)})
    SPEC = load_model_spec("qwen2.5-0.5b")
