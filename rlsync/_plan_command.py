"""``rlsync plan``: build a transfer plan for a model preset between two parallel layouts and report it."""

from __future__ import annotations

import json
import time

from rich.console import Console
from rich.table import Table

from rlsync.core._builders import fsdp, replicated, zero3
from rlsync.core._errors import ConfigError
from rlsync.core._layout import Layout
from rlsync.core._layout_parallel import engine_tp, megatron
from rlsync.core._planner import build_plan
from rlsync.core._presets import PRESETS, ModelSpec, load_model_spec

TRAINERS = {"fsdp": ("dp",), "zero3": ("dp",), "megatron": ("tp", "pp", "dp", "ep", "etp")}
ENGINES = {"vllm": ("tp", "replicas"), "sglang": ("tp", "replicas"), "hf": ("replicas",)}


def parse_spec(spec: str, kinds: dict[str, tuple[str, ...]], option: str) -> tuple[str, dict[str, int]]:
    """``"megatron:tp=8,pp=4"`` -> ``("megatron", {"tp": 8, "pp": 4})``, with errors that show the form."""
    kind, _, rest = spec.partition(":")
    if kind not in kinds:
        raise ConfigError(f"{option} {spec!r}: unknown kind {kind!r}; use one of {', '.join(kinds)}, e.g. '{next(iter(kinds))}:{next(iter(kinds.values()))[0]}=8'")
    values: dict[str, int] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in kinds[kind] or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{option} {spec!r}: bad item {item!r}; {kind} takes positive integers for {', '.join(kinds[kind])}")
        values[key] = int(value)
    return kind, values


def trainer_layout(spec: ModelSpec, train: str) -> Layout:
    kind, v = parse_spec(train, TRAINERS, "--train")
    if kind == "fsdp":
        return fsdp(spec.tensors, v.get("dp", 1))
    if kind == "zero3":
        return zero3(spec.tensors, v.get("dp", 1))
    return megatron(spec, v.get("tp", 1), v.get("pp", 1), v.get("dp", 1), v.get("ep", 1), v.get("etp"))


def engine_layout(spec: ModelSpec, infer: str) -> Layout:
    kind, v = parse_spec(infer, ENGINES, "--infer")
    if kind == "hf":
        return replicated(spec.tensors, range(v.get("replicas", 1)))
    return engine_tp(spec, v.get("tp", 1), v.get("replicas", 1))


def plan_report(model: str, train: str, infer: str, nic_gbps: float, rank: int | None = None) -> dict[str, object]:
    """Everything ``rlsync plan`` prints, as a dict (the ``--json`` output)."""
    spec = load_model_spec(model)
    started = time.perf_counter()
    src, dst = trainer_layout(spec, train), engine_layout(spec, infer)
    layouts_done = time.perf_counter()
    plan = build_plan(src, dst, dst_ranks=None if rank is None else [rank])
    done = time.perf_counter()
    st = plan.stats
    return {
        "model": spec.name,
        "train": train,
        "infer": infer,
        "tensors": len(spec.params),
        "parameters": spec.numel,
        "model_bytes": spec.nbytes,
        "dst_ranks": "all" if rank is None else [rank],
        "bytes_needed": st.bytes_needed,
        "bytes_sent": st.bytes_sent,
        "transfers": st.transfers,
        "senders": st.senders,
        "receivers": st.receivers,
        "max_sender_bytes": st.max_sender_bytes,
        "max_receiver_bytes": st.max_receiver_bytes,
        "sender_lower_bound": st.sender_lower_bound,
        "redundancy": st.redundancy,
        "imbalance": st.imbalance if rank is None else None,
        "layout_seconds": layouts_done - started,
        "plan_seconds": done - layouts_done,
        "build_seconds": done - started,
        "nic_gbps": nic_gbps,
        "predicted_seconds": st.predicted_seconds(nic_gbps),
    }


def _gb(n: object) -> str:
    return f"{int(n) / 1e9:,.2f} GB"  # type: ignore[call-overload]


def run(*, model: str, train: str, infer: str, nic_gbps: float, rank: int | None, list_models: bool, json_output: bool) -> None:
    console = Console()
    if list_models:
        for name in sorted(PRESETS):
            s = load_model_spec(name)
            console.print(f"{name:16} {s.numel / 1e9:8.2f}B parameters  {len(s.params):5} tensors")
        return
    report = plan_report(model, train, infer, nic_gbps, rank)
    if json_output:
        print(json.dumps(report))
        return
    table = Table(title=f"rlsync plan: {report['model']}  {train} -> {infer}", show_header=False)
    rows = [
        ("tensors", f"{report['tensors']:,} ({int(report['parameters']) / 1e9:,.2f}B parameters, {_gb(report['model_bytes'])})"),  # type: ignore[call-overload]
        ("destination ranks", str(report["dst_ranks"])),
        ("bytes to move", _gb(report["bytes_needed"])),
        ("bytes sent", f"{_gb(report['bytes_sent'])} (redundancy {report['redundancy']:.3f})"),
        ("transfers", f"{report['transfers']:,}"),
        ("senders / receivers", f"{report['senders']} / {report['receivers']}"),
        ("max per sender", _gb(report["max_sender_bytes"])),
        ("max per receiver", _gb(report["max_receiver_bytes"])),
    ]
    if report["imbalance"] is not None:
        rows.append(("sender lower bound", f"{_gb(report['sender_lower_bound'])} (imbalance {report['imbalance']:.3f})"))
    rows += [
        ("build time", f"{report['build_seconds']:.2f} s (layouts {report['layout_seconds']:.2f} s, plan {report['plan_seconds']:.2f} s)"),
        ("predicted transfer", f"{report['predicted_seconds']:.2f} s at {nic_gbps:g} Gbit/s per NIC"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
