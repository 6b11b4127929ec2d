"""What the OpenRLHF tests run inside Ray: trainer ranks holding OpenRLHF's real ``ActorPPOTrainer`` (patched by
the launcher's worker hook), and OpenRLHF's real vLLM engine actor (``RolloutRayActor``).

Stand-ins, each a FAKE named as such, for what needs CUDA:
- ``FakeStrategy`` stands for ``openrlhf.utils.deepspeed.DeepspeedStrategy`` (its ``setup_distributed`` and
  ``deepspeed.initialize`` need CUDA): it carries ``args`` (the fields the sync reads: ``args.vllm.*``,
  ``args.ds.zero_stage``) and the process group is plain gloo ``torch.distributed``.
- ``ActorPPOTrainer.__init__`` is not run (it builds the loss, the replay buffer and ends in
  ``torch_dist_barrier_and_cuda_sync``, which calls ``torch.cuda.synchronize``): the trainer object gets the
  attributes its ``_init_vllm_sync_group`` and ``broadcast_to_vllm`` read (``strategy``, ``actor.model.module``,
  ``vllm_engines``), as ``ActorPPOTrainer.__init__`` sets them.
- ``fake_zero3`` partitions parameters as DeepSpeed ZeRO-3 does (``deepspeed/runtime/zero/partition_parameters.py``:
  ``param.data`` emptied, ``ds_shape``/``ds_numel`` the full shape and size, ``ds_tensor`` this rank's flat
  partition of ``ceil(numel / world)`` elements, zero-padded at the end), and gathers a module's parameters for
  its forward and frees them after, as ZeRO-3's module hooks do (``deepspeed/runtime/zero/parameter_offload.py``,
  ``DeepSpeedZeRoOffload.setup_zero_stage3_hooks``: an all-gather on every rank, so forwards are collective).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from _support import model_trainer as models

PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 77]]
NEW_TOKENS = 8


def nudged(seed: int, arch: str = "qwen2") -> torch.nn.Module:
    """The model of ``seed`` after a small step: every 50th value of each tensor moved (2 % of them changed)."""
    model = models.build(arch, seed)
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[::50] += 0.25
    return model


class FakeStrategy:
    def __init__(self, zero_stage: int) -> None:
        self.args = SimpleNamespace(vllm=SimpleNamespace(enable_prefix_caching=False, sync_backend="nccl", enable_sleep=False),
                                    ds=SimpleNamespace(zero_stage=zero_stage, tensor_parallel_size=1),
                                    train=SimpleNamespace(async_enable=False, partial_rollout_enable=False))


def lora(seed: int) -> torch.nn.Module:
    """The model of 100 under a PEFT LoRA (as OpenRLHF's ``Actor`` wraps it for ``--ds.lora.rank 8``) whose adapter has
    moved (B from ``seed``: PEFT starts B at zero)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(models.build("qwen2", 100), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.5)
    return model


def fake_zero3(model: torch.nn.Module, rank: int, world: int) -> None:
    import torch.distributed as dist

    for p in model.parameters():
        full = p.data.reshape(-1)
        size = -(-full.numel() // world)
        part = torch.zeros(size, dtype=p.dtype)
        piece = full[rank * size:(rank + 1) * size]
        part[: piece.numel()] = piece
        p.ds_shape, p.ds_numel, p.ds_tensor = p.shape, full.numel(), part  # type: ignore[attr-defined]
        p.data = torch.empty(0, dtype=p.dtype)

    def gather(module: torch.nn.Module, _args: Any) -> None:
        for p in module._parameters.values():
            if p is not None:
                pieces = [torch.empty_like(p.ds_tensor) for _ in range(world)]  # type: ignore[attr-defined]
                dist.all_gather(pieces, p.ds_tensor)  # type: ignore[attr-defined]
                p.data = torch.cat(pieces)[: p.ds_numel].view(p.ds_shape)  # type: ignore[attr-defined]

    def release(module: torch.nn.Module, _args: Any, _out: Any) -> None:
        for p in module._parameters.values():
            if p is not None:
                p.data = torch.empty(0, dtype=p.dtype)

    for module in model.modules():
        if any(p is not None for p in module._parameters.values()):
            module.register_forward_pre_hook(gather)
            module.register_forward_hook(release)


class TrainerRank:
    """One DeepSpeed rank of OpenRLHF's policy actor, as far as the weight sync sees it."""

    def __init__(self, rank: int, world: int, init_method: str, engines: list[Any], zero_stage: int) -> None:
        import torch.distributed as dist
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        self.rank, self.world, self.zero_stage = rank, world, zero_stage
        self.trainer = ActorPPOTrainer.__new__(ActorPPOTrainer)
        self.trainer.strategy = FakeStrategy(zero_stage)
        self.trainer.args = self.trainer.strategy.args
        self.trainer.vllm_engines = engines
        self.trainer.actor = SimpleNamespace(model=SimpleNamespace(module=None), is_vlm=False)

    def patched(self) -> dict[str, object]:
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

        replaced = {name: getattr(ActorPPOTrainer, name).__module__ for name in ("_init_vllm_sync_group", "broadcast_to_vllm")}
        from openrlhf.models import actor
        from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

        from rlsync.patches.openrlhf import _actor_class

        wrapped = {name: hasattr(getattr(ActorPPOTrainer, name), "__wrapped__") for name in ("__init__", "training_step")}
        masked = all(hasattr(f, "__wrapped__") for f in (actor.Actor.forward, actor.log_probs_from_logits, actor.compute_entropy,
                                                          _actor_class(PolicyModelActor).init_model_from_pretrained))
        return {**replaced, **wrapped, "sampling_mask": masked}

    def load(self, seed: int, nudge: bool = False, with_lora: bool = False) -> None:
        model = lora(seed) if with_lora else nudged(seed) if nudge else models.build("qwen2", seed)
        if self.zero_stage == 3:
            fake_zero3(model, self.rank, self.world)
        self.trainer.actor.model.module = model

    def init_sync(self) -> None:
        if self.rank == 0:  # as ActorPPOTrainer.__init__ calls it
            self.trainer._init_vllm_sync_group("nccl")

    def sync(self) -> int:
        self.trainer.broadcast_to_vllm()
        return int(self.trainer._rlsync_version)

    def sent(self) -> int:
        """Bytes this rank moved for the last version (a delta moves only changed values)."""
        return sum(w.last_bytes for w in self.trainer._rlsync_writers)


def engine_kwargs(model: str, tp: int = 1) -> dict[str, Any]:
    """The keyword arguments ``openrlhf.trainer.ray.vllm_engine.create_vllm_engines`` gives ``RolloutRayActor`` for
    one engine with OpenRLHF's defaults, on CPU (no placement group of GPU bundles, ``num_gpus=0``). For TP>1
    OpenRLHF picks vLLM's Ray executor; here it is vLLM's multiprocessing one (no GPU bundles to place Ray workers
    on): the workers and the worker extension they run are the same."""
    return {"model": model, "enforce_eager": True, "worker_extension_cls": "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap",
            "tensor_parallel_size": tp, "seed": 0, "distributed_executor_backend": "uni" if tp == 1 else "mp", "max_model_len": 128,
            "enable_prefix_caching": False, "dtype": "bfloat16", "trust_remote_code": True, "full_determinism": False,
            "bundle_indices": None, "num_gpus": 0, "enable_sleep_mode": False, "agent_func_path": None,
            "remote_rm_url": None, "mm_pad_token_ids": set(), "skip_tokenizer_init": True}


def greedy_of_engine(engine: Any) -> list[list[int]]:
    import ray
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    outs = ray.get([engine.generate.remote(p, params) for p in PROMPTS])
    return [list(o.outputs[0].token_ids) for o in outs]


def _digest(model_dir: str) -> str:
    """What a fresh engine's answer depends on: the bytes of the checkpoint's files (config and weights)."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


_FRESH: dict[str, list[list[int]]] = {}  # checkpoint digest -> the fresh engine's greedy output, for this process


def fresh_greedy(model_dir: str) -> list[list[int]]:
    """A new in-process vLLM engine loading ``model_dir`` from disk; its answer is kept by the checkpoint's bytes, so
    a checkpoint several tests compare with (the same seeds' weights) starts one engine, not one per test."""
    key = _digest(model_dir)
    if key not in _FRESH:
        _FRESH[key] = _fresh_greedy(model_dir)
    return [list(tokens) for tokens in _FRESH[key]]


def _fresh_greedy(model_dir: str) -> list[list[int]]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              distributed_executor_backend="uni", max_model_len=128, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    got = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    llm.llm_engine.engine_core.shutdown()
    del llm
    return got


def fresh_lora_greedy(model_dir: str, adapters: list[str]) -> list[list[list[int]]]:
    """A new in-process vLLM engine loading ``model_dir`` and serving each PEFT adapter directory in turn."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", distributed_executor_backend="uni",
              max_model_len=128, seed=0, enable_lora=True, max_lora_rank=8, max_loras=1)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    got = []
    for i, adapter in enumerate(adapters, start=1):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                            lora_request=LoRARequest(f"adapter{i}", i, adapter))
        got.append([list(o.outputs[0].token_ids) for o in outs])
    llm.llm_engine.engine_core.shutdown()
    del llm
    return got


def word_tokenizer() -> Any:
    """A real transformers tokenizer (``tokenizers``' WordLevel, built here: no download) whose words ``w0`` ..
    ``w255`` are the tiny models' token ids."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0")


def experts_given(model: torch.nn.Module) -> tuple[list[torch.Tensor], Any]:
    """Per MoE layer (in order), the expert ids each forward of ``model`` hands its experts module (``[tokens, top_k]``:
    transformers 5 MoE blocks call ``experts(hidden, top_k_index, top_k_weights)``), and a callable that unhooks."""
    given: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda m, args, out: given.append(args[1].detach().clone()))
             for m in model.modules() if type(m).__name__.endswith("Experts")]
    return given, lambda: [h.remove() for h in hooks]


class EngineHandle:
    """A FAKE of OpenRLHF's engine actor handle (``RolloutRayActor``, a Ray actor): ``get_num_unfinished_requests``
    and ``generate_responses`` with its signature, answering each sample with a response of the executor's fields
    and keeping the episode name each request carried in its sampling parameters."""

    def __init__(self) -> None:
        self.named: list[tuple[str, str, str | None]] = []

    def get_num_unfinished_requests(self) -> int:
        return 0

    def generate_responses(self, prompt: str, label: str, sampling_params: Any, max_length: int, hf_tokenizer: Any,
                           num_samples: int = 1, images: Any = None) -> list[dict[str, Any]]:
        from rlsync.adapters.openrlhf._episodes import EXTRA

        self.named.append((prompt, label, (sampling_params.extra_args or {}).get(EXTRA)))
        return [{"prompt": prompt, "label": label, "observation_tokens": [5, 6, 7], "action_ranges": [(1, 3)],
                 "rollout_log_probs": None, "reward": 0.0, "scores": 0.0, "truncated": False, "extra_logs": {}}] * num_samples

    def take(self) -> list[tuple[str, str, str | None]]:
        named, self.named = self.named, []
        return named
