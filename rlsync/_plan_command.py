"""``rlsync plan``: build a transfer plan for a model preset between two parallel layouts and report it."""

from __future__ import annotations

import collections
import functools
import json
import re
import time
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from rlsync import Box, ConfigError, Layout, LayoutError, Plan, build_plan
from rlsync.core import INBOX_SHARE
from rlsync.layouts import PRESETS, ModelSpec, engine_tp, fsdp, load_model_spec, make_layout, megatron, own_buffer_shard, replicated, zero3
from rlsync.wire import fp8_model_spec

MAX_RANKS = 65_536  # ranks of one side (fsdp:dp=4096 took 75 s to plan on a 2-core machine)
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
    ranks = 1
    for key in ("tp", "pp", "dp", "ep", "replicas"):  # etp divides tp's ranks; it adds none
        ranks *= values.get(key, 1)
    if ranks > MAX_RANKS:  # a plan is built per rank: 10^8 ranks ran until memory ran out
        raise ConfigError(f"{option} {spec!r}: {ranks:,} ranks; rlsync plan takes up to {MAX_RANKS:,} a side")
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


#: bytes on the wire per changed bf16 value of a delta, per value of a full send: 1.33 bytes (a gap and the XOR of
#: old and new bits, zstd-compressed), measured over real AdamW steps by `rlsync bench --wire delta` (docs/benchmarks.md)
DELTA_BYTES_PER_CHANGE = 1.33 / 2


def parse_wire(wire: str) -> tuple[str, float]:
    """``"bf16"``, ``"fp8"`` or ``"delta=0.02"`` -> ``(kind, changed fraction)``."""
    kind, _, value = wire.partition("=")
    if kind in ("bf16", "fp8") and not value:
        return kind, 1.0
    if kind == "delta":
        try:
            fraction = float(value)
        except ValueError:
            fraction = -1.0
        if 0.0 <= fraction <= 1.0:
            return kind, fraction
    raise ConfigError(f"--wire {wire!r}: use 'bf16' (the model's dtype), 'fp8' (an fp8 block-quantized engine) or "
                      f"'delta=FRACTION' (the share of values that changed since the last version, e.g. delta=0.02)")


def relay_layout(dst: Layout, ranks_per_node: int) -> Layout:
    """What the trainer's writers send to when each node of ``ranks_per_node`` consecutive engine ranks lands its
    versions in one ``rlsync.NodeRelay``: one rank per node, holding whole every tensor a rank of that node holds."""
    held: dict[int, set[str]] = {}
    for s in dst.shards:
        held.setdefault(s.rank // ranks_per_node, set()).add(s.tensor)
    shards = [own_buffer_shard(t, Box.full(t.shape), node) for node, names in sorted(held.items())
              for t in dst.tensors if t.name in names]
    return make_layout(dst.tensors, shards)


#: a writer's host time per tensor it sends to a reader (one run), once a version is prepared: measured with
#: ``rlsync bench --tensors 20000`` over shm on a 2-core Xeon (docs/benchmarks.md); ``--host-us-per-tensor`` to change
HOST_US_PER_TENSOR = 0.7


@functools.lru_cache(maxsize=2)  # the wire and the rates change no plan: one built per layout pair (seconds for 1T)
def _built(model: str, train: str, infer: str, rank: int | None, relay_per_node: int,
           fp8: bool) -> tuple[ModelSpec, Plan, float, float]:
    """The model, its plan, and the seconds its layouts and its plan took to build."""
    spec = resolve_model(model)
    if fp8:
        spec = fp8_model_spec(spec)
    started = time.perf_counter()
    src, dst = trainer_layout(spec, train), engine_layout(spec, infer)
    if rank is not None and not 0 <= rank < dst.world_size:
        raise ConfigError(f"--rank {rank}: an engine rank of {infer!r}, from 0 to {dst.world_size - 1}")
    if relay_per_node:
        if rank is not None:
            raise ConfigError("--relay-per-node plans whole nodes: leave out --rank")
        dst = relay_layout(dst, relay_per_node)
    layouts_done = time.perf_counter()
    plan = build_plan(src, dst, dst_ranks=None if rank is None else [rank])
    return spec, plan, layouts_done - started, time.perf_counter() - layouts_done


def plan_report(model: str, train: str, infer: str, nic_gbps: float, rank: int | None = None, wire: str = "bf16",
                relay_per_node: int = 0, host_us_per_tensor: float = HOST_US_PER_TENSOR) -> dict[str, object]:
    """Everything ``rlsync plan`` prints, as a dict (the ``--json`` output).

    ``wire``: ``fp8`` plans for an engine that serves the fp8 block-quantized checkpoint format
    (the trainer quantizes, half the bytes plus scales); ``delta=F`` scales the plan's bytes by
    what an index+value delta of a changed share ``F`` costs, capped at a full send (what the writer does).
    ``relay_per_node`` 0 (the default): every engine rank takes its bytes over its own NIC, as the trainer's writers
    send them to each rank; N: each node of N engine ranks takes them through one ``rlsync.NodeRelay`` (its NIC
    takes every tensor the node holds, whole and once: ``relay_layout``; the forwarding inside the node is not
    counted). Either way the prediction is what rlsync's writers do in that setup.

    The prediction has two parts, printed apart: the bytes (the busiest NIC's at ``nic_gbps``) and the host (the
    busiest writer's tensor runs, one per tensor part it sends to a reader, at ``host_us_per_tensor`` each)."""
    if not nic_gbps > 0 or not host_us_per_tensor >= 0:
        raise ConfigError(f"--nic-gbps {nic_gbps} and --host-us-per-tensor {host_us_per_tensor}: a rate above 0 and a "
                          f"cost of 0 or more")
    kind, fraction = parse_wire(wire)
    spec, plan, layout_seconds, plan_seconds = _built(model, train, infer, rank, relay_per_node, kind == "fp8")
    st = plan.stats
    factor = fraction * DELTA_BYTES_PER_CHANGE if kind == "delta" else 1.0
    factor = 1.0 if factor > INBOX_SHARE else factor  # as the writer: a delta its reader's inbox cannot hold goes in full
    seconds = max(st.max_sender_bytes, st.max_receiver_bytes) * factor * 8 / (nic_gbps * 1e9)
    runs = collections.Counter(t.src_rank for t in plan.transfers)  # the runs each writer rank writes a version
    busiest_runs = max(runs.values(), default=0)
    host_seconds = busiest_runs * host_us_per_tensor / 1e6
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
        "relay_per_node": relay_per_node,
        "sender_lower_bound": st.sender_lower_bound,
        "redundancy": st.redundancy,
        "imbalance": st.imbalance if rank is None else None,
        "layout_seconds": layout_seconds,
        "plan_seconds": plan_seconds,
        "build_seconds": layout_seconds + plan_seconds,
        "wire": wire,
        "wire_bytes_factor": factor,
        "nic_gbps": nic_gbps,
        "bytes_seconds": seconds,
        "busiest_writer_runs": busiest_runs,
        "host_us_per_tensor": host_us_per_tensor,
        "host_seconds": host_seconds,
        "predicted_seconds": seconds + host_seconds,
    }


HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # owner/name, as the Hugging Face hub spells a model


def resolve_model(model: str) -> ModelSpec:
    """``--model``: a preset, a local directory or ``config.json``, or a hub id whose ``config.json`` huggingface_hub
    fetches (or finds in its cache: ``HF_HUB_OFFLINE=1`` works)."""
    if model in PRESETS or Path(model).exists() or not HUB_ID.match(model):
        return load_model_spec(model)
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise LayoutError(f"--model {model!r} looks like a Hugging Face hub id: reading its config.json needs "
                          f"huggingface_hub (pip install huggingface_hub), or pass a local config.json, its directory, "
                          f"or a preset (rlsync plan --list-models)") from None
    try:
        config = hf_hub_download(model, "config.json")
    except Exception as exc:  # no network, no such repository, a gated one: huggingface_hub says which
        raise LayoutError(f"--model {model!r}: huggingface_hub could not fetch its config.json "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); pass a local "
                          f"config.json or its directory instead") from None
    return msgspec.structs.replace(load_model_spec(config), name=model)  # not the cache's snapshot folder name


def _gb(n: object) -> str:
    return f"{int(n) / 1e9:,.2f} GB"  # type: ignore[call-overload]


def run(*, model: str, train: str, infer: str, nic_gbps: float, rank: int | None, list_models: bool, json_output: bool,
        wire: str = "bf16", relay_per_node: int = 0, host_us_per_tensor: float = HOST_US_PER_TENSOR) -> None:
    console = Console()
    if list_models:
        for name in sorted(PRESETS):
            s = load_model_spec(name)
            console.print(f"{name:16} {s.numel / 1e9:8.2f}B parameters  {len(s.params):5} tensors")
        return
    # a plan of thousands of ranks takes seconds: say what runs (on stderr, so --json stays one clean line)
    with Console(stderr=True).status(f"rlsync plan: planning {model} {train} -> {infer} ..."):
        report = plan_report(model, train, infer, nic_gbps, rank, wire, relay_per_node, host_us_per_tensor)
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
        ("max per receiver", _gb(report["max_receiver_bytes"]) + (
            f" (a node's NodeRelay: every tensor its {relay_per_node} engine ranks hold, whole, once)" if relay_per_node else
            " (an engine rank)")),
    ]
    if report["imbalance"] is not None:
        rows.append(("sender lower bound", f"{_gb(report['sender_lower_bound'])} (imbalance {report['imbalance']:.3f})"))
    rows += [
        ("build time", f"{report['build_seconds']:.2f} s (layouts {report['layout_seconds']:.2f} s, plan {report['plan_seconds']:.2f} s)"),
        ("wire", wire if report["wire_bytes_factor"] == 1.0 else f"{wire} (bytes x {report['wire_bytes_factor']:.3f})"),
        ("predicted: bytes", f"{report['bytes_seconds']:.2f} s at {nic_gbps:g} Gbit/s per NIC"),
        ("predicted: host", f"{report['host_seconds']:.3f} s ({report['busiest_writer_runs']:,} tensor runs on the "
                            f"busiest writer rank at {report['host_us_per_tensor']:g} us each)"),
        ("predicted transfer", f"{report['predicted_seconds']:.2f} s (bytes + host: the host part need not overlap)"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    console.print(LEGEND, markup=False, highlight=False, soft_wrap=True)  # its own line breaks, at any width


LEGEND = """What the rows mean:
  bytes to move       what the engine ranks hold in all: every byte a destination needs, counted once
  bytes sent          what the trainer's ranks send; redundancy = bytes sent / bytes to move (1.000: each byte once)
  transfers           the copies of the plan: one per (trainer rank, engine rank, tensor part)
  max per sender      the busiest trainer rank's bytes: its NIC's share of the work
  max per receiver    the busiest engine rank's (or node relay's) bytes: its NIC's share
  sender lower bound  the least the busiest trainer rank could send if the ranks that hold the same bytes shared
                      them perfectly; imbalance = max per sender / that bound (1.000: no rank sends more than it must)
  predicted: bytes    the busier of max per sender and max per receiver at --nic-gbps
  predicted: host     the busiest writer's host work: its tensor runs at --host-us-per-tensor each"""
