"""verl's weight-sync routes through rlsync, side by side, on one model and one layout (issue #67).

    python scripts/verl_routes_bench.py [--ranks 2] [--hidden 1024] [--layers 8] [--vocab 32000] [--tp 2] [--replicas 1]

``--ranks`` FSDP2 trainer ranks (``fully_shard`` on a CPU gloo mesh, an fp32 model as verl's FSDP trainer holds it)
sync ``--replicas`` rollout replicas of ``--tp`` tensor-parallel GPUs each, three versions a route:

- ``gathered`` (verl's path before rlsync's routes; still rlsync's for LoRA and non-bf16 rollouts): every rank
  ``full_tensor()``s every parameter (an all-gather, in fp32), keeps its row chunk and sends it to every rollout GPU,
  each of which receives the whole model (verl's ``CheckpointEngineWorker`` then hands it to vLLM's loader);
- ``shards``: every rank casts its own local shard to bf16 and sends it (``rlsync.layouts.from_dtensors``), no
  collective, still to every rollout GPU whole;
- ``engine`` (rlsync's route for FSDP2 into verl's vLLM rollout): the same shards, each straight into the slice of
  the tensor-parallel worker that reads it (readers holding ``rlsync.layouts.engine_tp``: vLLM's fused per-rank
  parameters), every byte once per replica.

It prints one JSON line per route: the bytes one version put on the link (all ranks, against ``rlsync.build_plan``'s
figure for the same layouts), the most one rollout GPU received, the bytes the ranks gathered, the tensor copies a rank
made, seconds per version (the median of the three), and the trainer ranks' peak resident memory above what they held
before the first sync. Real torch.distributed, real FSDP2, real readers over shared memory; on a GPU the same command
runs on the CPU (this is the ranks' host path, not the device's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).float()


def _rank(rank: int, args: argparse.Namespace, port: int, addresses: list[list[str]], results: Any) -> None:
    """``addresses``: one list per destination (a whole-model reader, or an engine replica's workers)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rlsync import SyncOptions, WeightsWriter
    from rlsync.layouts import from_dtensors, fsdp, writer_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    mesh = init_device_mesh("cpu", (args.ranks,))
    model = _model(args)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    named = dict(model.state_dict())
    options = SyncOptions(timeout=600)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report: dict[str, Any] = {"route": args.route, "rank": rank}
    seconds, gathered, copies = [], 0, 0
    writers: list[WeightsWriter] = []
    for version in (1, 2, 3):
        dist.barrier()
        started = time.perf_counter()
        if args.route == "gathered":  # as rlsync's verl backend on verl's get_per_tensor_param: gather, keep a chunk
            metas, chunks = [], {}
            for name, param in named.items():
                full = param.full_tensor()
                gathered += full.numel() * full.element_size()
                from rlsync.layouts import TensorMeta

                meta = TensorMeta(name, str(full.dtype).removeprefix("torch."), tuple(full.shape))
                metas.append(meta)
                [box] = [s.box for s in fsdp([meta], args.ranks).shards if s.rank == rank] or [None]
                if box is not None:
                    chunks[name] = full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))].clone()
                    copies += 2  # the gathered tensor, its chunk
            src, me = fsdp(metas, args.ranks), rank
        else:  # shards, engine: each rank's own shard, cast to the rollout's bf16: no collective
            src, me = from_dtensors(named, dtype="bfloat16"), writer_rank(named, rank)
            chunks = {name: t.to_local().to(torch.bfloat16).contiguous() for name, t in named.items()
                      if any(s.rank == me and s.tensor == name for s in src.shards)}
            copies += len(chunks)
        if not writers:
            writers = [WeightsWriter(src, None, me, group, options=options) for group in addresses]
            report["plan_bytes"] = sum(w.stats.bytes_sent for w in writers)  # the whole plan's, every rank
            report["per_gpu_bytes"] = max(w.stats.max_receiver_bytes for w in writers)
        for writer in writers:
            writer.multi_put(chunks)
            writer.complete(version)
        seconds.append(time.perf_counter() - started)
        report["wire_bytes"] = sum(w.last_bytes for w in writers)
    report.update(seconds=statistics.median(seconds), gathered_bytes=gathered // 3, copies=copies // 3,
                  peak_mib=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
    for writer in writers:
        writer.close()
    results.put(report)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel GPUs a rollout replica")
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from rlsync import SyncOptions, WeightsReader
    from rlsync.layouts import engine_tp, model_spec

    print(f"{args.ranks} FSDP2 ranks (CPU, gloo), a Qwen2 of hidden {args.hidden}, {args.layers} layers, vocab "
          f"{args.vocab}, fp32 in training, into {args.replicas} replica(s) of TP={args.tp} over shm", file=sys.stderr)
    config = _model(args).config.to_dict()
    spec = model_spec({**config, "torch_dtype": "bfloat16", "dtype": "bfloat16"})
    options = SyncOptions(timeout=600, transport="shm")
    for route in ("gathered", "shards", "engine"):
        args.route = route
        if route == "engine":  # each replica's workers hold their slices, as vLLM's loader lays them out
            readers = [[WeightsReader(None, engine_tp(spec, tp=args.tp), r, options=options) for r in range(args.tp)]
                       for _ in range(args.replicas)]
        else:  # every rollout GPU a whole copy
            readers = [[WeightsReader(None, None, 0, replicas=1, options=options)]
                       for _ in range(args.replicas * args.tp)]
        context = mp.get_context("spawn")
        results = context.Queue()
        groups = [[reader.address for reader in group] for group in readers]
        mp.start_processes(_rank, args=(args, _free_port(), groups, results), nprocs=args.ranks,
                           join=True, start_method="spawn")
        ranks = sorted((results.get(timeout=30) for _ in range(args.ranks)), key=lambda r: r["rank"])
        for group in readers:
            for reader in group:
                reader.close()
        print(json.dumps({
            "route": route, "wire_bytes": sum(r["wire_bytes"] for r in ranks), "plan_bytes": ranks[0]["plan_bytes"],
            "per_gpu_bytes": ranks[0]["per_gpu_bytes"],
            "gathered_bytes": sum(r["gathered_bytes"] for r in ranks), "copies_per_rank": ranks[0]["copies"],
            "seconds": max(r["seconds"] for r in ranks), "peak_mib_per_rank": max(r["peak_mib"] for r in ranks)}))


if __name__ == "__main__":
    main()
