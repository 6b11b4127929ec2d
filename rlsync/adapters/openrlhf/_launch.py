"""``rlsync launch openrlhf [OPTIONS] -- <OpenRLHF's usual arguments>`` (also ``python -m rlsync.adapters.openrlhf``).

Starts OpenRLHF's own entry point (``openrlhf.cli.train_ppo_ray``: its parser, its checks, its ``train``)
with the user's arguments, unchanged except for the weight sync: where ``train`` starts Ray (its ``ray.init``,
once OpenRLHF's parser and checks have accepted the arguments: a typo starts no cluster), rlsync starts it instead,
with OpenRLHF's runtime environment plus ``worker_process_setup_hook`` = ``rlsync.adapters.openrlhf.setup_worker``,
so that every Ray worker applies rlsync's trainer-side patches, and exports ``RLSYNC_OPENRLHF`` so that vLLM's engine
processes (which are not Ray workers) apply the engine side through the adapter's vLLM plugin.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from rlsync import DEFAULT_TIMEOUT, ConfigError, __version__
from rlsync.adapters.openrlhf._hooks import patch_trainer
from rlsync.adapters.openrlhf._versions import clock
from rlsync.core.timeline import ENV as TIMELINE_ENV
from rlsync.patches.openrlhf import OPTIONS_ENV, check_version, installed_version

ENTRY = "openrlhf.cli.train_ppo_ray"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlsync launch openrlhf",
                                description="Run OpenRLHF's train_ppo_ray with rlsync's weight sync. Put OpenRLHF's own "
                                            "arguments after `--`.")
    p.add_argument("--weight-sync", choices=["rlsync", "openrlhf"], default="rlsync",
                   help="rlsync (every trainer rank sends its share) or OpenRLHF's own broadcast, unpatched")
    p.add_argument("--transport", default="shm", help="shm (one machine, the default), tcp or nixl")
    p.add_argument("--host", default="127.0.0.1", help="where engine workers listen (loopback unless told otherwise)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds one sync may take")
    p.add_argument("--wire", choices=("full", "delta"), default="full",
                   help="delta: send only the values that changed since the last sync (a few percent at RL learning rates)")
    p.add_argument("--no-canary", dest="canary", action="store_false",
                   help="do not check each version's canary (the trainer's log-probs of a fixed batch) before it serves")
    p.add_argument("--lora-sync", choices=("adapter", "merged"), default="adapter",
                   help="with OpenRLHF's --ds.lora.rank: adapter (the engines serve the LoRA adapter, only its A/B "
                        "matrices cross each version) or merged (base + adapter, the whole model each version)")
    p.add_argument("--routing-replay", choices=("auto", "on", "off"), default="auto",
                   help="MoE policies: the trainer's forwards send each token to the experts that sampled it (recorded "
                        "by the engines); auto: wherever the model is MoE")
    p.add_argument("--sampling-mask", choices=("auto", "off"), default="auto",
                   help="the actor's log-probs under the rollouts' top-p (OpenRLHF's --rollout.top_p): auto, wherever it "
                        "is below 1; off: OpenRLHF's full-softmax log-probs")
    p.add_argument("--relay", choices=("auto", "on", "off"), default="auto",
                   help="a host of several vLLM engines takes each version once, in one engine actor there, which "
                        "forwards it to the others over shared memory (rlsync.NodeRelay); auto: where the transport "
                        "crosses hosts (tcp, nixl), on: also with shm, off: every engine takes its own copy")
    p.add_argument("--max-staleness", type=int, default=None,
                   help="async mode: drop samples generated more than N weight versions ago (rlsync's MaxStaleness)")
    p.add_argument("--episodes", metavar="REDIS_URL", default=None,
                   help="record every rollout's model turns and agent steps in this Redis (redis://HOST:6379/0): a run "
                        "restarted from its checkpoint replays them instead of generating and calling tools again")
    p.add_argument("--timeline", metavar="DIR", default=None,
                   help="record the run's timeline in DIR, a file per process (every sync, every train step with the "
                        "staleness of its samples, every generation phase); read it with `rlsync timeline DIR`")
    return p


def split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(rlsync's options, OpenRLHF's arguments): OpenRLHF's come after ``--``."""
    argv = list(argv)
    if "--" not in argv and any(a in ("-h", "--help") for a in argv):  # the launcher's own help, as a newcomer asks
        parser().parse_args(["--help"])
    if "--" not in argv:
        raise ConfigError("put OpenRLHF's arguments after `--`: rlsync launch openrlhf [--max-staleness N] -- --pretrain ...")
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def lora_rank(theirs: Sequence[str]) -> int:
    """OpenRLHF's ``--ds.lora.rank`` among its arguments (0: no LoRA); its own parser checks the rest."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--ds.lora.rank", dest="rank", type=int, default=0)
    return int(p.parse_known_args(list(theirs))[0].rank)


def ckpt_path(theirs: Sequence[str]) -> str:
    """OpenRLHF's ``--ckpt.path`` among its arguments (its default if not given)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--ckpt.path", dest="path", default="./ckpt/checkpoints_ppo_ray")  # train_ppo_ray's default
    return str(p.parse_known_args(list(theirs))[0].path)


def resumes(theirs: Sequence[str]) -> bool:
    """Whether OpenRLHF will resume from its checkpoint: ``--ckpt.load_enable`` and ``<--ckpt.path>/_actor`` there
    (what ``BasePPOTrainer.init_checkpoint_states`` and ``PolicyModelActor`` check)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--ckpt.load_enable", dest="load", action="store_true")
    return bool(p.parse_known_args(list(theirs))[0].load) and os.path.exists(os.path.join(ckpt_path(theirs), "_actor"))


def episodes_options(url: str | None, theirs: Sequence[str]) -> dict[str, object]:
    """``--episodes``: the URL, checked here (the redis extra, the URL's form, ``?kept_seconds``, a Redis that
    answers), and the run's log name: the checkpoint folder's, in a generation of its own for a run that does not
    resume from it (it replays nothing an earlier run there recorded)."""
    if url is None:
        return {"episodes": None}
    from rlsync.adapters.openrlhf._episodes import episodes_name, open_log

    log = open_log(url, episodes_name(ckpt_path(theirs)))
    try:
        name = log.run_name(fresh=not resumes(theirs))
    finally:
        log.close()
    return {"episodes": url, "episodes_name": name}


def ray_env(opts: dict[str, object]) -> dict[str, str]:
    """The environment every process of the run gets: OpenRLHF's own ``ray.init`` defaults, and rlsync's options."""
    return {
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
        OPTIONS_ENV: json.dumps(opts),
        # --timeline: every process of the run (the driver, Ray's workers, vLLM's engine processes) records its own file
        **({TIMELINE_ENV: str(opts["timeline"])} if opts.get("timeline") else {}),
    }


def start_ray(opts: dict[str, object], *args: Any, runtime_env: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """``ray.init(*args, runtime_env=..., **kwargs)`` with rlsync's worker hook and options added to the runtime env."""
    import ray

    if ray.is_initialized():
        raise ConfigError("Ray is already initialised in this process: the launcher must start it (with its worker hook)")
    env = {**((runtime_env or {}).get("env_vars") or {}), **ray_env(opts)}
    os.environ.update(env)  # this process and what it spawns; Ray workers get it from the runtime env too
    context = ray.init(*args, runtime_env={**(runtime_env or {}), "env_vars": env,
                                           "worker_process_setup_hook": "rlsync.adapters.openrlhf.setup_worker"}, **kwargs)
    clock(new_cluster=True)  # the run's version clock, owned by this process: it lives as long as the run
    # this process too: Ray pickles the actor classes it starts here (OpenRLHF's engine actor by value), patched
    patch_trainer()
    return context


def start_ray_in_openrlhfs_place(opts: dict[str, object]) -> None:
    """OpenRLHF's ``train`` starts Ray (``ray.init``, when none runs) after its parser and its checks of the arguments:
    rlsync's ``start_ray`` takes the place of that one call, with what OpenRLHF passes, so that arguments OpenRLHF
    refuses (a typo, ``--help``) start no cluster."""
    import ray

    if ray.is_initialized():
        raise ConfigError("Ray is already initialised in this process: the launcher must start it (with its worker hook)")
    openrlhfs = ray.init

    def init(*args: Any, **kwargs: Any) -> Any:
        ray.init = openrlhfs  # once: whoever calls it next gets Ray's own
        return start_ray(opts, *args, **kwargs)

    ray.init = init


def main(argv: Sequence[str] | None = None) -> None:
    own, theirs = split(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(own)
    version = installed_version()
    check_version(version)
    if args.episodes and args.weight_sync != "rlsync":
        raise ConfigError("--episodes records rollouts through rlsync's patches of OpenRLHF, which --weight-sync openrlhf "
                          "leaves out: drop one of the two")
    if args.timeline and args.weight_sync != "rlsync":
        raise ConfigError("--timeline records what rlsync's patches of OpenRLHF see, which --weight-sync openrlhf leaves "
                          "out: drop one of the two")
    if args.weight_sync == "rlsync":
        opts = {"rlsync": __version__, "openrlhf": version, "transport": args.transport, "host": args.host,
                "timeout": args.timeout, "max_staleness": args.max_staleness,
                "wire": args.wire, "canary": args.canary, "lora_rank": lora_rank(theirs), "lora_sync": args.lora_sync,
                "routing_replay": args.routing_replay, "sampling_mask": args.sampling_mask, "relay": args.relay,
                "timeline": os.path.abspath(args.timeline) if args.timeline else None,
                **episodes_options(args.episodes, theirs)}
        start_ray_in_openrlhfs_place(opts)
    sys.argv = [ENTRY, *theirs]
    runpy.run_module(ENTRY, run_name="__main__", alter_sys=True)
