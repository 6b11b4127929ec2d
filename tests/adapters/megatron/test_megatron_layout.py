"""A live megatron-core model's shards into a reader of the checkpoint's tensors (issue #68): real megatron-core
(``GPTModel``, local layer spec) on the CPU, ranks on gloo (``_support/megatron_ranks.py``), each putting its own
parameters as ``rlsync.adapters.megatron.layout_of`` describes them. Judged by what lands: the checkpoint's tensors,
loaded into transformers' Llama, give megatron's own logits (tensor parallelism 2: the fused QKV groups, gate/up,
row-parallel columns, the padded vocabulary); under pipeline parallelism 2 each stage's layers land where their
global layer number says. Each byte once (the plan's count)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _support import megatron_ranks as mr  # noqa: E402

PROMPT = [5, 17, 42, 99, 3, 250]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sync(tp: int, pp: int, dtype: str = "float32", versions: int = 1, moe: bool = False,
          ep: int = 1) -> tuple[Any, list[dict[str, Any]]]:
    """Run ``tp * pp * ep`` megatron ranks (``ep``: data parallel ranks the experts split over) into one reader of the
    checkpoint's tensors; (the reader's tensors, each rank's results)."""
    from rlsync import SyncOptions, WeightsReader
    from rlsync.layouts import from_state_dict

    shapes = mr.checkpoint_tensors(moe, getattr(torch, dtype))
    world = tp * pp * ep
    reader = WeightsReader(None, from_state_dict(shapes), 0, options=SyncOptions(timeout=120))
    try:
        context = mr.ranks_context()
        results = context.Queue()
        ranks_running = mr.start_ranks(mr.rank_main, (world, _free_port(), tp, pp, [[reader.address]], versions, dtype,
                                                       PROMPT, results, moe, ep), world)
        # read before joining: a rank's large result stays in its queue's pipe until someone reads it
        ranks = sorted((results.get(timeout=300) for _ in range(world)), key=lambda r: r["rank"])
        while not ranks_running.join():
            pass
        assert reader.version == versions
        landed = {name: torch.as_tensor(view).view(getattr(torch, dtype)).view(shapes[name].shape).clone()
                  for name, view in reader.buffers().items()}
        return landed, ranks
    finally:
        reader.close()


def _hf_logits(state: dict[str, torch.Tensor], where: Path, moe: bool = False) -> torch.Tensor:
    return mr.hf_logits(mr.save_checkpoint(state, where, moe), PROMPT)


def test_tensor_parallel_2_lands_the_checkpoint_that_computes_megatrons_own_logits(tmp_path: Path) -> None:
    landed, ranks = _sync(tp=2, pp=1)
    ours = _hf_logits(landed, tmp_path)
    theirs = torch.from_numpy(ranks[0]["logits"])[:, : mr.VOCAB]  # the padded vocabulary's extra rows are not the checkpoint's
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    total = sum(t.numel() * 4 for t in landed.values())
    assert sum(r["sent"][0] for r in ranks) == total  # each byte once, padding rows never
    assert all(r["sent"][0] == r["plan"] > 0 for r in ranks)


def test_pipeline_parallel_2_puts_each_stages_layers_at_their_global_number() -> None:
    landed, ranks = _sync(tp=1, pp=2)
    first, last = ({n: torch.from_numpy(a) for n, a in r["params"].items()} for r in ranks)
    # the stages' layer 0 are the model's layers 0 and 1; embedding on the first, final norm and head on the last
    for stage, params in enumerate((first, last)):
        assert torch.equal(landed[f"model.layers.{stage}.mlp.down_proj.weight"], params["decoder.layers.0.mlp.linear_fc2.weight"])
        assert torch.equal(landed[f"model.layers.{stage}.self_attn.o_proj.weight"],
                           params["decoder.layers.0.self_attention.linear_proj.weight"])
    assert torch.equal(landed["model.embed_tokens.weight"], first["embedding.word_embeddings.weight"][: mr.VOCAB])
    assert torch.equal(landed["lm_head.weight"], last["output_layer.weight"][: mr.VOCAB])
    assert torch.equal(landed["model.norm.weight"], last["decoder.final_layernorm.weight"])
    assert sum(r["sent"][0] for r in ranks) == sum(t.numel() * 4 for t in landed.values())


def test_expert_parallel_2_lands_each_ranks_experts_as_the_checkpoints_and_computes_megatrons_own_logits(
        tmp_path: Path) -> None:
    """A Qwen3-MoE-like megatron-core model, its 4 experts over 2 expert-parallel ranks (2 each): each rank's local
    experts land as the checkpoint's experts of their global number, router and QK norms included."""
    landed, ranks = _sync(tp=1, pp=1, moe=True, ep=2)
    ours = _hf_logits(landed, tmp_path, moe=True)
    theirs = torch.from_numpy(ranks[0]["logits"])[:, : mr.VOCAB]
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    assert any(f"mlp.experts.{mr.EXPERTS - 1}.down_proj.weight" in n for n in landed)
    total = sum(t.numel() * 4 for t in landed.values())
    assert sum(r["sent"][0] for r in ranks) == total  # each byte once: the replicated attention from one rank alone
    assert all(r["sent"][0] == r["plan"] for r in ranks)
