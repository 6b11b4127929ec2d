"""megatron-core trainers (NeMo-RL, slime, a loop of one's own): the layout of a live ``GPTModel`` on this rank.

    from rlsync import WeightsWriter
    from rlsync.adapters.megatron import layout_of, writer_rank

    layout = layout_of(model, vocab_size=hf_config.vocab_size, dtype=torch.bfloat16)  # every rank's, checked
    writer = WeightsWriter(layout, None, writer_rank(), engine_addresses)
    writer.multi_put({name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()})
    writer.complete(version)

``layout_of`` reads the parallel sizes and ranks (tensor, pipeline, data, expert and expert-tensor parallel) from
``megatron.core.parallel_state`` and the rest from the model
(``rlsync.layouts.from_megatron``: its config, padded vocabulary, tied embeddings, parameters). Importing this module
imports nothing of megatron; ``layout_of`` does.
"""

from __future__ import annotations

from typing import Any

from rlsync.layouts import Layout, from_megatron


def gpt_model(model: Any) -> Any:
    """The ``GPTModel`` inside megatron's wrappers (``DistributedDataParallel``, ``Float16Module``: ``.module``)."""
    while not hasattr(model, "vocab_size") and hasattr(model, "module"):
        model = model.module
    return model


def layout_of(model: Any, *, vocab_size: int | None = None, dtype: Any = None) -> Layout:
    """Every rank's layout of ``model`` (this rank's megatron-core ``GPTModel``, wrapped or not), in the checkpoint's
    names; ``vocab_size``: the checkpoint's vocabulary (default the model's, unpadded); ``dtype``: what crosses
    (default the parameters')."""
    from megatron.core import parallel_state as ps

    gpt = gpt_model(model)
    return from_megatron(dict(gpt.named_parameters()), gpt.config, padded_vocab_size=int(gpt.vocab_size),
                         vocab_size=vocab_size, tied=bool(getattr(gpt, "share_embeddings_and_output_weights", False)),
                         tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                         pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                         dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                         ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size(),
                         ep_rank=ps.get_expert_model_parallel_rank(), dtype=dtype)


def writer_rank() -> int:
    """This rank's writer rank in ``layout_of``'s layout: megatron's order, tensor-parallel fastest, then data, then
    pipeline (the global rank, where megatron's parallel state is laid out as it is by default)."""
    from megatron.core import parallel_state as ps

    tp, dp = ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()
    return int((ps.get_pipeline_model_parallel_rank() * dp + ps.get_data_parallel_rank()) * tp
               + ps.get_tensor_model_parallel_rank())


__all__ = ["gpt_model", "layout_of", "writer_rank"]
