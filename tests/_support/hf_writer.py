"""Trainer process for the transformers receiver test: builds the same tiny Qwen2, gives it the
weights of ``--seed`` and pushes them as ``--version`` (run as a script)."""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlsync import SyncOptions, WeightsWriter
from rlsync.core import transports
from rlsync.layouts import from_state_dict


def tiny_qwen2(seed: int, tied: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config).eval()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--version", type=int, required=True)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--die-after-writes", type=int, default=0, help="SIGKILL itself after this many writes")
    parser.add_argument("--device", default="cpu", help="where the trainer's model lives (cuda: the GPU check)")
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--dtype", default="float32", help="the trainer's weights' dtype (bfloat16: what most GPU runs send)")
    parser.add_argument("--verify", action="store_true", help="checksums on: the receiver's SyncOptions(verify=True)")
    args = parser.parse_args()
    if args.die_after_writes:  # the writer's links, whatever the transport, die after that many writes
        transport, calls = transports().get(args.transport), [0]
        open_link = transport.open

        def open_dying(description, options=None):  # type: ignore[no-untyped-def]
            link = open_link(description, options)
            write = link.write

            def write_then_die(source, runs):  # type: ignore[no-untyped-def]
                calls[0] += 1
                if calls[0] > args.die_after_writes:
                    os.kill(os.getpid(), signal.SIGKILL)
                write(source, runs)

            link.write = write_then_die
            link.prepare = lambda parts: list(parts)  # a prepared version written part by part: it dies between two
            link.write_prepared = lambda prepared: [link.write(source, runs) for source, runs in prepared]
            return link

        transport.open = open_dying  # type: ignore[method-assign]
    model = tiny_qwen2(args.seed, args.tied).to(args.device, getattr(torch, args.dtype))
    state = model.state_dict()  # what a trainer has: a tied model's lm_head.weight alias included
    options = SyncOptions(transport=args.transport, verify=args.verify)
    with WeightsWriter(from_state_dict(state), None, 0, [args.address], options=options) as writer:  # layout from the receiver
        writer.multi_put(state)
        writer.complete(args.version)
        print(json.dumps({"host_staging_bytes": writer._staging.nbytes}), flush=True)
