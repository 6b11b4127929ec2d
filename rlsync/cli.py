"""The ``rlsync`` command: ``plan``, ``bench``, ``launch``, ``doctor``, ``timeline``, ``simulate``.

Each command's work lives in its own module and is imported only when that command runs,
so ``rlsync --help`` stays fast and needs no optional dependency.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="rlsync",
    help="Weight export, rollout buffering and staleness gating for RL post-training.",
    no_args_is_help=True,
    add_completion=False,
)


def _version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        typer.echo(f"rlsync {version('rlsync')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print rlsync's version and exit.")] = False,
) -> None:
    """Weight export, rollout buffering and staleness gating for RL post-training."""


@app.command()
def plan(
    model: Annotated[str, typer.Option(help="A preset (see --list-models), a config.json or its directory, or a Hugging Face hub id (its config.json, with huggingface_hub).")] = "qwen2.5-7b",
    train: Annotated[str, typer.Option(help="Trainer layout, e.g. 'fsdp:dp=8' or 'megatron:tp=8,pp=4,dp=8,ep=8'.")] = "fsdp:dp=8",
    infer: Annotated[str, typer.Option(help="Inference layout, e.g. 'vllm:tp=16,replicas=8'.")] = "vllm:tp=2,replicas=4",
    nic_gbps: Annotated[float, typer.Option(help="Per-rank NIC rate in Gbit/s for the predicted time.")] = 400.0,
    rank: Annotated[Optional[int], typer.Option(help="Plan only this destination rank's part.")] = None,
    wire: Annotated[str, typer.Option(help="What crosses the wire: 'bf16' (the model's dtype), 'fp8' (an fp8 block-quantized engine) or 'delta=FRACTION' (changed values only).")] = "bf16",
    relay_per_node: Annotated[int, typer.Option(min=0, help="0 (the default): the trainer's writers send each engine rank its bytes over its own NIC. N: each node of N engine ranks lands versions in one rlsync.NodeRelay (every tensor the node holds crosses its NIC once, whole).")] = 0,
    host_us_per_tensor: Annotated[float, typer.Option(help="A writer's host time per tensor run it sends, in µs (default: "
                                                           "measured by `rlsync bench --tensors 20000`; measure yours).")] = 0.7,
    list_models: Annotated[bool, typer.Option("--list-models", help="List the model presets and exit.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Build a transfer plan between a trainer layout and an inference layout and report it."""
    from rlsync import _plan_command

    _plan_command.run(
        model=model, train=train, infer=infer, nic_gbps=nic_gbps, rank=rank,
        list_models=list_models, json_output=json_output, wire=wire, relay_per_node=relay_per_node,
        host_us_per_tensor=host_us_per_tensor,
    )


MAX_TOKENS = 1 << 20  # --sampling-mask: positions in one micro-batch (its logits are tokens x vocabulary floats)
MAX_FANOUT_RANKS = 64  # --fanout-ranks: engine ranks behind one relay host, each a process with two copies of the model


def _check_bench_numbers(*, lr: float, link_gbps: float | None, tokens: int, fanout_ranks: int | None,
                         device: str | None) -> None:
    """The bench's numbers and device, checked before any work: a NaN or negative rate ran (or hung) the bench, a huge
    micro-batch died in the allocator, an unknown device was a traceback."""
    import math

    if not (math.isfinite(lr) and lr > 0):
        raise typer.BadParameter(f"--lr {lr}: a learning rate above 0, e.g. 1e-6")
    if link_gbps is not None and not (math.isfinite(link_gbps) and link_gbps > 0):
        raise typer.BadParameter(f"--link-gbps {link_gbps}: a rate above 0 in Gbit/s, e.g. 1")
    if tokens > MAX_TOKENS:
        raise typer.BadParameter(f"--tokens {tokens}: at most {MAX_TOKENS:,} positions in one micro-batch")
    if fanout_ranks is not None and fanout_ranks > MAX_FANOUT_RANKS:
        raise typer.BadParameter(f"--fanout-ranks {fanout_ranks}: at most {MAX_FANOUT_RANKS} (a process and two copies "
                                 f"of the model each)")
    if device is not None:
        import torch

        try:
            torch.device(device)
        except (RuntimeError, ValueError):
            raise typer.BadParameter(f"--device {device!r}: a torch device, e.g. 'cpu', 'cuda' or 'cuda:1'") from None


@app.command()
def bench(
    size: Annotated[Optional[str], typer.Option(help="Bytes of weights to sync, e.g. '1GiB', '256MiB' (default 1GiB; "
                                                     "with --device: 8GiB on cuda, 256MiB on cpu).")] = None,
    transports: Annotated[Optional[str], typer.Option(help="Comma-separated transports to measure (default: "
                                                           "those of shm,nixl,tcp,torchdist that run here; with --device: all that run there).")] = None,
    device: Annotated[Optional[str], typer.Option(help="Trainer and engine on this device ('cuda', 'cuda:1' or 'cpu'): "
                                                       "every transport and landing there, against device copies and the "
                                                       "bucketed recipe.")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Timed repetitions per path; the median is reported.")] = 3,
    buffer: Annotated[bool, typer.Option("--buffer", help="Benchmark the rollout buffer backends instead.")] = False,
    sampling_mask: Annotated[bool, typer.Option("--sampling-mask", help="Benchmark the trainer's log-probs under a "
                                                "top-k/top-p mask (time and memory per micro-batch; on --device).")] = False,
    tokens: Annotated[int, typer.Option(min=1, help="With --sampling-mask: positions in the micro-batch.")] = 512,
    engine: Annotated[Optional[str], typer.Option(help="Sync into a running engine ('vllm') instead of a plain process.")] = None,
    engine_model: Annotated[str, typer.Option(help="Model for --engine: '125m' (a Qwen2 of 125M parameters) or 'tiny' (a quick check).")] = "125m",
    wire: Annotated[Optional[str], typer.Option(help="Compare full versions with 'delta' versions over real AdamW steps, over the first of --transports (default tcp: a link between hosts, where a delta's planes are zstd-compressed; over shm they go as they are) (needs transformers).")] = None,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps (versions) for --wire.")] = 8,
    lr: Annotated[float, typer.Option(help="AdamW learning rate for --wire (RL post-training uses ~1e-6).")] = 1e-6,
    link_gbps: Annotated[Optional[float], typer.Option(help="With --wire delta: trainer and readers on two network "
                                                             "namespaces joined by a link limited to this many Gbit/s "
                                                             "(tc tbf; needs root), over tcp.")] = None,
    fanout_ranks: Annotated[Optional[int], typer.Option(min=0, help="With --link-gbps: engine ranks of the far host "
                                                                   "behind one rlsync.NodeRelay (default 4; 0: no relay "
                                                                   "host; it takes two copies of the model per rank).")] = None,
    tensors: Annotated[Optional[int], typer.Option(help="Host cost per tensor: the same bytes (--size, default 64MiB) "
                                                       "as 1 and as this many tensors, over the first of --transports "
                                                       "(default shm): a first version, then --repeats measured. With "
                                                       "--device: every path there, with the bytes as this many tensors.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Host cost per tensor on a preset's own tensors (rlsync plan "
                                                     "--list-models), as a trainer holds them: experts one by one "
                                                     "(qwen3-30b-a3b: about 19,000; kimi-k2: about 70,000). With "
                                                     "--device: every path there, on those tensors.")] = None,
    scale: Annotated[str, typer.Option(help="With --model: each tensor's share of its real size, e.g. 1/256 (the "
                                            "count stays the model's).")] = "1/256",
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    path_timeout: Annotated[float, typer.Option(min=1, help="With --device: seconds one path may take; a path that "
                                                            "takes longer is reported as failed and the next runs.")] = 600,
) -> None:
    """Measure weight sync (or the rollout buffer) against the baselines, in one run."""
    _check_bench_numbers(lr=lr, link_gbps=link_gbps, tokens=tokens, fanout_ranks=fanout_ranks, device=device)
    if fanout_ranks is not None and (wire is None or link_gbps is None):
        raise typer.BadParameter("--fanout-ranks puts a host of engine ranks across the link of --wire delta --link-gbps G: "
                                 "add those, or leave --fanout-ranks out")
    if device is not None and not sampling_mask and wire is None:
        from rlsync.bench import run_device

        run_device(device=device, size=size, transports=transports, repeats=repeats, json_output=json_output,
                   path_timeout=path_timeout, tensors=tensors, model=model, scale=scale)
    elif wire is not None:
        if wire != "delta":
            raise typer.BadParameter(f"--wire {wire!r}: the bench compares 'delta' with full versions (fp8 is a tensor "
                                     f"list, see `rlsync plan --wire fp8`)")
        from rlsync.bench import run_wire

        run_wire(size=size or "1GiB", steps=steps, lr=lr, transport=(transports or "tcp").split(",")[0], json_output=json_output,
                 link_gbps=link_gbps, device=device or "cpu", **({} if fanout_ranks is None else {"fanout": fanout_ranks}))
    elif tensors is not None or model is not None:
        from rlsync.bench import run_tensors

        run_tensors(tensors=tensors, size=size, versions=repeats + 1, transport=(transports or "shm").split(",")[0],
                    json_output=json_output, model=model, scale=scale)
    elif link_gbps is not None:
        raise typer.BadParameter("--link-gbps measures full against delta versions over a slow link: add --wire delta")
    elif sampling_mask:
        from rlsync.bench import run_mask

        run_mask(device=device, repeats=repeats, json_output=json_output, tokens=tokens)
    elif buffer:
        from rlsync.bench import run_buffer

        run_buffer(json_output=json_output, repeats=repeats)
    elif engine is not None:
        from rlsync.bench import run_engine

        run_engine(engine=engine, json_output=json_output, repeats=repeats, model=engine_model)
    else:
        from rlsync.bench import run_weights

        run_weights(size=size, transports=transports, repeats=repeats, json_output=json_output)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    framework: Annotated[str, typer.Argument(help="The framework whose entry point to run: 'openrlhf'.")],
) -> None:
    """Run a framework's own entry point with rlsync's weight sync: rlsync launch openrlhf [--max-staleness N] -- <its arguments>."""
    if framework != "openrlhf":
        raise typer.BadParameter(f"no launcher for {framework!r}: verl and TRL take rlsync as a flag or an object (see the README)")
    from rlsync.adapters.openrlhf import main as launch_openrlhf

    launch_openrlhf(ctx.args)  # reached in-process only: the `rlsync` command hands argv over in main(), `--` included


@app.command()
def timeline(
    run: Annotated[Path, typer.Argument(help="A timeline rlsync recorded: a .jsonl file, or a directory of them (one per process).")],
    picture: Annotated[Optional[Path], typer.Option(help="Where the Gantt chart goes (PNG; default beside RUN; needs matplotlib).")] = None,
    trace: Annotated[Optional[Path], typer.Option(help="Where the Chrome trace goes (default beside RUN: RUN.trace.json).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Where a run's time went: each pool's busy and idle shares and what it waited for, the staleness of the tokens
    trained on, seconds per sync; a Gantt chart (PNG) and a Chrome trace (chrome://tracing, Perfetto) beside it."""
    from rlsync._timeline_command import timeline_command

    timeline_command(run, picture, trace, json_output)


@app.command()
def simulate(
    timeline: Annotated[Optional[Path], typer.Option(help="Fit the costs to this recorded run (a lockstep run sees each cost alone).")] = None,
    run: Annotated[int, typer.Option(help="Which run of the timeline (its run spans, from 0).")] = 0,
    modes: Annotated[str, typer.Option(help="Comma-separated: lockstep, one-step-off, async, async-partial.")] = "lockstep,one-step-off,async,async-partial",
    steps: Annotated[Optional[int], typer.Option(min=1, help="Optimizer steps (default: the run's, or 20).")] = None,
    max_staleness: Annotated[int, typer.Option(min=0, help="async: versions generation may run ahead.")] = 1,
    prompts: Annotated[Optional[int], typer.Option(min=1, help="Prompts per batch (a request each).")] = None,
    group: Annotated[Optional[int], typer.Option(min=1, help="Sequences per prompt (GRPO's group).")] = None,
    train_seconds: Annotated[Optional[float], typer.Option(min=0, help="Seconds of one optimizer step (half on twice the training GPUs, say).")] = None,
    sync_seconds: Annotated[Optional[float], typer.Option(min=0, help="Seconds of one weight sync (measured, or what rlsync plan predicts).")] = None,
    step_seconds: Annotated[Optional[float], typer.Option(min=0, help="The engine's fixed seconds per decode step.")] = None,
    seq_step_seconds: Annotated[Optional[float], typer.Option(min=0, help="The engine's seconds per decode step per sequence in flight.")] = None,
    lengths: Annotated[Optional[str], typer.Option(help="Completion lengths to draw from, comma-separated tokens (e.g. '12,12,96').")] = None,
    draw: Annotated[bool, typer.Option("--draw", help="Draw each request's length from the run's at random (the mean of --repeats runs) instead of taking them in the order the run asked for them.")] = False,
    repeats: Annotated[int, typer.Option(min=1, help="With --draw or --lengths: runs per mode with other draws of the lengths; the mean is printed.")] = 20,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Predict samples/s, each pool's idle shares and the staleness of lockstep, one-step-off, async and async with
    partial rollouts, from a recorded run's costs or from costs given as flags (a discrete-event model: docs/timeline.md)."""
    from rlsync.core import ConfigError
    from rlsync._timeline_command import simulate_command

    try:
        drawn = [int(x) for x in lengths.split(",")] if lengths else None
    except ValueError:
        raise ConfigError(f"--lengths {lengths!r}: comma-separated whole numbers of tokens, e.g. '12,12,96'") from None
    simulate_command(timeline, run, [m.strip() for m in modes.split(",") if m.strip()], steps, max_staleness,
                     {"prompts": prompts, "group": group, "train_seconds": train_seconds, "sync_seconds": sync_seconds,
                      "step_seconds": step_seconds, "seq_step_seconds": seq_step_seconds, "lengths": drawn},
                     json_output, repeats, replay=timeline is not None and not draw)


@app.command()
def doctor() -> None:
    """Report which transports, backends and adapters can run on this machine (exit 1: an installed engine
    is broken; the fix is printed)."""
    from rlsync import _doctor

    raise typer.Exit(_doctor.run())


def main() -> None:
    """Run the CLI; rlsync's own errors print as one line (what, which, the fix) and exit 2."""
    try:
        if sys.argv[1:3] == ["launch", "openrlhf"]:  # its arguments go through untouched: click would drop the `--`
            from rlsync.adapters.openrlhf import main as launch_openrlhf

            launch_openrlhf(sys.argv[3:])
        else:
            app()
    except Exception as exc:
        # rlsync's errors live in rlsync.core, which imports torch: looked up only once something failed (an
        # RlsyncError was raised from there, so the module is loaded), to keep `rlsync --help` at a fraction of a second
        core = sys.modules.get("rlsync.core")
        if core is None or not isinstance(exc, core.RlsyncError):
            raise
        typer.echo(f"rlsync: error: {type(exc).__name__}: {exc}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
