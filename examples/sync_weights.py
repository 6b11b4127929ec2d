"""Weights from a trainer process into an engine process on this machine, with the plain install: what moved, how
fast, and that the engine then computes exactly what the trainer's weights compute.

    pip install torch -e .                         # nothing else (on a machine without a GPU: torch==2.13.0)
    python examples/sync_weights.py                # a torch model of about 256 MiB in bf16, 5 versions, shared memory
    python examples/sync_weights.py --size 64MiB --transport tcp
    python examples/sync_weights.py --model qwen2  # a tiny transformers Qwen2 instead (pip install 'rlsync[hf]')

The trainer (this process) takes SGD steps on float32 weights and publishes their bf16 copy as a new version after
each one (``WeightsWriter``); the engine (a second process this script starts) serves a bf16 model through
``ModuleReceiver``, which lands each version and switches it in atomically. After each version the engine runs a fixed
input through its model and sends back a CRC-32 of the output; the trainer compares it with the same forward on its
own bf16 copy.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
import zlib
from typing import Any


def build(model: str, nbytes: int, seed: int) -> Any:
    """The model both sides run: a stack of square linear layers of about ``nbytes`` in bf16, or a tiny Qwen2."""
    import torch

    torch.manual_seed(seed)
    if model == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
        return Qwen2ForCausalLM(config).eval()
    width = 1024
    layers = max(1, round(nbytes / (2 * width * (width + 1))))
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(layers)])


def forward_crc(model: Any, kind: str) -> int:
    """CRC-32 of the model's output on a fixed input: equal on both sides only if every weight is."""
    import torch

    torch.manual_seed(1234)
    with torch.no_grad():
        if kind == "qwen2":
            out = model(torch.randint(0, 512, (2, 16))).logits
        else:
            out = model(torch.randn(4, model[0][0].in_features, dtype=torch.bfloat16))
    return zlib.crc32(out.float().contiguous().numpy().tobytes())


def engine(args: argparse.Namespace) -> None:
    """The engine process: a bf16 model of other weights, a receiver, and a forward after each version."""
    import torch

    import rlsync
    from rlsync.adapters.hf import ModuleReceiver

    torch.set_num_threads(1)  # the same reduction order as the trainer's check
    model = build(args.model, args.nbytes, seed=1).to(torch.bfloat16)
    with ModuleReceiver(model, options=rlsync.SyncOptions(transport=args.transport)) as receiver:
        print(json.dumps({"address": receiver.address}), flush=True)
        for line in sys.stdin:  # "VERSION": run the model on it
            version = receiver.wait_for_version(int(line), timeout=60)
            with receiver.serving():
                print(json.dumps({"version": version, "crc": forward_crc(model, args.model)}), flush=True)


def trainer(args: argparse.Namespace) -> None:
    import torch

    import rlsync
    from rlsync.layouts import from_state_dict

    torch.set_num_threads(1)
    model = build(args.model, args.nbytes, seed=0)
    served = build(args.model, args.nbytes, seed=0).to(torch.bfloat16)  # the trainer's own bf16 copy, for the check
    export = {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}  # what is published
    nbytes = sum(t.nbytes for t in export.values())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    copy = {name: torch.empty_like(t) for name, t in export.items()}
    for _ in range(2):  # the second pass: memory already touched, as the transport's is after its first version
        started = time.perf_counter()
        for name, t in export.items():
            copy[name].copy_(t)
        memcpy = nbytes / (time.perf_counter() - started) / 1e9  # this machine's own copy of the same bytes
    child = subprocess.Popen([sys.executable, __file__, "--role", "engine", "--model", args.model, "--size", args.size,
                              "--transport", args.transport], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        address = json.loads(child.stdout.readline())["address"]
        print(f"trainer: {len(export)} tensors, {nbytes / 2**20:.1f} MiB bf16, to the engine process over {args.transport} "
              f"(memcpy here: {memcpy:.2f} GB/s)")
        with rlsync.WeightsWriter(from_state_dict(export), None, 0, [address],
                                  options=rlsync.SyncOptions(transport=args.transport)) as writer:
            for version in range(1, args.versions + 1):
                loss = sum(0.5 * p.pow(2).sum() for p in model.parameters())  # a step that moves every weight by 1 %
                optimizer.zero_grad()
                loss.backward()  # type: ignore[union-attr]
                optimizer.step()
                with torch.no_grad():
                    for name, t in model.state_dict().items():
                        export[name].copy_(t)
                started = time.perf_counter()
                writer.multi_put(export)
                writer.complete(version)  # returns once the engine serves this version
                seconds = time.perf_counter() - started
                served.load_state_dict(export)
                child.stdin.write(f"{version}\n")
                child.stdin.flush()
                answer = json.loads(child.stdout.readline())
                same = answer["version"] == version and answer["crc"] == forward_crc(served, args.model)
                print(f"version {version}: {nbytes / 2**20:.1f} MiB live in {seconds:.3f} s ({nbytes / seconds / 1e9:.2f} GB/s, "
                      f"{nbytes / seconds / 1e9 / memcpy:.2f}x memcpy); the engine's output "
                      f"{'equals' if same else 'DIFFERS FROM'} the trainer's")
                if not same:
                    raise SystemExit("the engine computes something else than the trainer's weights: a bug, please report it")
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["mlp", "qwen2"], default="mlp", help="mlp: torch only; qwen2: needs transformers")
    parser.add_argument("--size", default="256MiB", help="bytes of bf16 weights of the mlp model, e.g. 64MiB, 1GiB")
    parser.add_argument("--transport", default="shm", help="shm (one machine), tcp, or any installed transport")
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--role", choices=["trainer", "engine"], default="trainer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "trainer":  # importing torch and building both models takes a while: say what is happening
        print(f"sync_weights: building a {args.model} model of {args.size} and starting the engine process...", flush=True)
    from rlsync import ConfigError
    from rlsync.bench import parse_size  # the one size parser of rlsync's commands: 256MiB, 1GiB, 64MB

    try:
        args.nbytes = parse_size(args.size)
    except ConfigError as exc:
        parser.error(str(exc))
    if args.model == "qwen2" and importlib.util.find_spec("transformers") is None:
        raise SystemExit("--model qwen2 needs transformers: pip install 'rlsync[hf]' (or leave --model out: torch only)")
    engine(args) if args.role == "engine" else trainer(args)


if __name__ == "__main__":
    main()
