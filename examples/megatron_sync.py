"""A megatron-core trainer's weights into a vLLM engine: every rank sends its own tensor-parallel shards, as they are,
straight into the engine workers that read them; nothing is gathered, each byte crosses once per version.

    pip install -e '.[megatron,vllm]'
    python examples/megatron_sync.py                           # trainer TP=2 into an engine at TP=2, 3 versions
    python examples/megatron_sync.py --tp 2 --engine-tp 1 --report runs/megatron.json

The trainer: ``--tp`` megatron-core ranks (a tiny Llama-like ``GPTModel`` built here; yours comes from your own
training script), each running the loop below after every optimizer step. The engine: vLLM in this process, started
with rlsync's weight-transfer backend, taking each version through vLLM's own weight-update calls. After each version
the script compares the engine's log-probabilities of a prompt with megatron's own forward of the same weights.

The loop a megatron-core user writes (``trainer_rank`` below) is these lines:

    layout = layout_of(model, vocab_size=hf_config.vocab_size, dtype=torch.bfloat16)  # every rank's shards
    writer = WeightsWriter(layout, None, writer_rank(), engine_addresses)
    for version in ...:
        ...                                                          # the optimizer step
        writer.multi_put({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()})
        writer.complete(version)                                     # returns once the engine holds it

On a machine without a GPU megatron-core runs on the CPU once two CUDA-only calls are substituted (``_cpu_only``):
that is this example's, not something rlsync does to your trainer.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from trl_grpo import require  # noqa: E402 - one line naming what is missing, before anything starts

VOCAB, PADDED_VOCAB, HIDDEN, HEADS, GROUPS, FFN, LAYERS = 300, 320, 256, 4, 2, 256, 2
PROMPT = [5, 17, 42, 99, 3, 250]


def hf_config() -> Any:
    """The engine's (Hugging Face) config of the same model."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=GROUPS, rms_norm_eps=1e-5,
                       max_position_embeddings=128, tie_word_embeddings=False)


def _cpu_only() -> None:
    """megatron-core has no CPU mode: it asks for the current CUDA device when it builds layers, and forks the CUDA
    random state around dropout (off here). Without a GPU, answer both for it."""
    import torch
    from megatron.core.tensor_parallel import random as megatron_random

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        megatron_random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]


def build_model(tp: int) -> Any:
    """This rank's megatron-core ``GPTModel``: Llama-like, grouped-query attention, a padded vocabulary."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    _cpu_only()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                               ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
                               layernorm_epsilon=1e-5, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, tensor_model_parallel_size=tp, pipeline_dtype=torch.float32)
    torch.manual_seed(0)
    return GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=PADDED_VOCAB, max_sequence_length=128, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False, parallel_output=False)


def megatron_logprobs(model: Any, tokens: list[int]) -> list[float]:
    """megatron's own log-probability of each next token of ``tokens`` (fp32)."""
    import torch

    n = len(tokens)
    mask = torch.triu(torch.ones(1, 1, n, n), diagonal=1).bool()  # megatron's default mask is built on "cuda"
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), torch.arange(n)[None], mask)[0, :, :VOCAB].float()
    return torch.log_softmax(logits, -1)[torch.arange(n - 1), torch.tensor(tokens[1:])].tolist()


def trainer_rank(rank: int, tp: int, port: int, engine_addresses: list[str], versions: int, results: Any) -> None:
    """One megatron rank: per version an optimizer step (here: a deterministic nudge of every weight), then its own
    shards into the engine."""
    import torch
    import torch.distributed as dist

    from rlsync import WeightsWriter
    from rlsync.adapters.megatron import layout_of, writer_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    model = build_model(tp)
    layout = layout_of(model, vocab_size=hf_config().vocab_size, dtype=torch.bfloat16)  # checked against this rank's
    writer = WeightsWriter(layout, None, writer_rank(), engine_addresses)
    for version in range(1, versions + 1):
        with torch.no_grad():  # the optimizer step
            for i, (_, p) in enumerate(sorted(model.named_parameters())):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * version + i)) * 0.02)
        writer.multi_put({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()})
        writer.complete(version)
        results.put({"rank": rank, "version": version, "bytes": writer.last_bytes, "plan": writer.bytes_per_version,
                     "logprobs": megatron_logprobs(model, PROMPT)})
    writer.close()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_engine(model_dir: Path, engine_tp: int) -> Any:
    """vLLM with rlsync's weight-transfer backend (a server: ``--weight-transfer-config '{"backend": "rlsync"}'``)."""
    from vllm import LLM

    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128,
               tensor_parallel_size=engine_tp, seed=0, weight_transfer_config={"backend": "rlsync"},
               **({"distributed_executor_backend": "uni"} if engine_tp == 1 else {}))


def engine_logprobs(llm: Any) -> list[float]:
    from vllm import SamplingParams

    from rlsync.adapters.vllm import prompt_logprobs_of

    llm.reset_prefix_cache()
    [out] = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                         use_tqdm=False)
    return prompt_logprobs_of([out], [PROMPT])[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="the trainer's tensor-parallel ranks")
    parser.add_argument("--engine-tp", type=int, default=2, help="the vLLM engine's tensor-parallel workers")
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--report", type=Path, help="write what each version moved and matched here (JSON)")
    args = parser.parse_args()
    require("megatron", "vllm", "transformers", install="pip install -e '.[megatron,vllm]'")
    import torch
    import torch.multiprocessing as mp
    from transformers import LlamaForCausalLM

    from rlsync.core import keyed, shift_port

    if not torch.cuda.is_available():  # vLLM on the CPU: a small KV cache; one core per engine worker
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if args.engine_tp > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c % os.cpu_count()) for c in range(args.engine_tp)))
    print(f"starting vLLM (TP={args.engine_tp}) with rlsync's weight-transfer backend...", flush=True)
    with tempfile.TemporaryDirectory() as where:
        initial = LlamaForCausalLM(hf_config()).to(torch.bfloat16)
        initial.save_pretrained(where)
        llm = start_engine(Path(where), args.engine_tp)
        tensors = [[name, "bfloat16", list(t.shape)] for name, t in initial.state_dict().items()]
    address = keyed(f"tcp://127.0.0.1:{free_port()}")  # the engine's readers: worker r on its port + r
    llm.init_weight_transfer_engine({"init_info": {"address": address, "tensors": tensors}})
    engine_addresses = [shift_port(address, r) for r in range(args.engine_tp)]
    results = mp.get_context("spawn").Queue()
    print(f"starting {args.tp} megatron-core ranks...", flush=True)
    ranks = mp.start_processes(trainer_rank, args=(args.tp, free_port(), engine_addresses, args.versions, results),
                               nprocs=args.tp, join=False, start_method="spawn")
    model_bytes = sum(t.numel() * 2 for t in initial.state_dict().values())
    report = []
    print(f"{'version':>7} {'bytes sent':>12} {'plan':>12} {'model':>12} {'seconds':>8} {'max |engine - megatron|':>24}")
    for version in range(1, args.versions + 1):
        started = time.monotonic()
        llm.start_weight_update()  # a server: VllmServer(...).publish does these three
        llm.update_weights({"update_info": {"version": version, "timeout": 300.0}})
        llm.finish_weight_update(weight_version=str(version))
        seconds = time.monotonic() - started
        ours = engine_logprobs(llm)
        per_rank = sorted((results.get(timeout=300) for _ in range(args.tp)), key=lambda r: r["rank"])
        theirs = per_rank[0]["logprobs"]
        row = {"version": version, "bytes": sum(r["bytes"] for r in per_rank), "plan": sum(r["plan"] for r in per_rank),
               "model_bytes": model_bytes, "seconds": seconds, "engine_logprobs": ours, "megatron_logprobs": theirs,
               "max_logprob_difference": max(abs(a - b) for a, b in zip(ours, theirs))}
        report.append(row)
        print(f"{version:>7} {row['bytes']:>12,} {row['plan']:>12,} {model_bytes:>12,} {seconds:>8.2f} "
              f"{row['max_logprob_difference']:>24.4f}", flush=True)
    while not ranks.join():
        pass
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=1))
    llm.llm_engine.engine_core.shutdown()
    del llm  # released here, not in the interpreter's teardown (where it aborted the process once in three runs here)
    gc.collect()
    if any(r["bytes"] != r["plan"] or r["max_logprob_difference"] > 0.05 for r in report):
        sys.exit("the engine did not get each byte once, or does not compute what megatron computes (see above)")
    print("each version: every byte once (the plan's count: the model, and a copy of the norms for each engine worker "
          "that holds them whole), and the engine's log-probs within bf16 rounding of megatron's forward")


if __name__ == "__main__":
    main()
