"""SGLang adapter: new weights reach an SGLang engine through rlsync, loaded by SGLang's own loader.

SGLang runs a *custom weight loader* inside each tensor-parallel worker when
``update_weights_from_tensor(named_tensors, load_format=<import path>)`` names one that the server
allows (``--custom-weight-loader``; ``ModelRunner.update_weights_from_tensor`` in
``python/sglang/srt/model_executor/model_runner.py`` calls ``dynamic_import(load_format)(model,
named_tensors)``). rlsync's loader is ``rlsync.adapters.sglang.load_landed``: the named tensors it gets
carry only a small JSON control message; the weights themselves travel over rlsync (shared memory,
NIXL, TCP) into the worker and are handed to ``model.load_weights`` once every byte of a version is
there. Fail closed: at ``start`` every worker runs its own loader once on NaN-filled stand-ins of the
offered tensors (then puts its weights back), so a name the loader refuses or a parameter no tensor fills
is a ``ConfigError`` before a byte moves; a version whose load fails is rolled back (each update keeps a
host copy of the worker's parameters until it is loaded); a trainer that dies midway leaves the engine on
the previous version.

Engine side (``sglang.Engine(..., custom_weight_loader=[LOADER])`` or
``--custom-weight-loader rlsync.adapters.sglang.load_landed``)::

    sync = SglangWeights(engine, tensors, address="tcp://127.0.0.1:PORT")  # [(name, dtype, shape), ...]
    sync.start()                     # each worker binds PORT + its tensor-parallel rank
    # the trainer: WeightsWriter(from_state_dict(state), None, 0, sync.addresses)  (layout learned from the engine)
    sync.apply(version)              # pause, load the landed version, set the weight version, continue

Every worker receives whole checkpoint tensors (SGLang's loader narrows them to its slice); learning
each worker's part, as the vLLM adapter does, is not done for SGLang yet.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rlsync import DEFAULT_TIMEOUT, ConfigError, RlsyncError, StagedReceiver, SyncOptions
from rlsync.core import HostStaging, host_port, keyed, shift_port, split_address

#: the import path to allow with ``--custom-weight-loader`` and to pass as ``load_format``
LOADER = "rlsync.adapters.sglang.load_landed"
CONTROL = "rlsync.control"  # the one named tensor rlsync's loader receives

_receiver: StagedReceiver | None = None  # one per SGLang worker process


def _tp_rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank
    except ImportError:  # no SGLang here: a single in-process worker (the tests' fake)
        return 0
    return int(get_tensor_model_parallel_rank())


def control_tensor(message: dict[str, Any]) -> Any:
    """A JSON message as a uint8 tensor: what SGLang's ``update_weights_from_tensor`` can carry."""
    import torch

    return torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8)


def load_landed(model: Any, named_tensors: Sequence[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader (runs in each worker): start receiving, or load the next version."""
    global _receiver
    [(name, tensor)] = named_tensors
    if name != CONTROL:
        raise ConfigError(f"{LOADER} takes rlsync's control message, got tensor {name!r}: send weights with "
                          f"rlsync.adapters.sglang.SglangWeights, not update_weights_from_tensor directly")
    message = json.loads(bytes(tensor.cpu().numpy()).decode())
    if message["op"] == "start":
        if _receiver is not None:
            _receiver.close()
        _check_names(model, message["tensors"])
        host, port = host_port(shift_port(message["address"], _tp_rank()))
        key = split_address(message["address"])[1]  # the driver's key: only its trainer may write (None: RLSYNC_SECRET)
        _receiver = StagedReceiver(message["tensors"], options=SyncOptions(transport=message["transport"], host=host, port=port,
                                                                          secret=key))
        return
    if _receiver is None:
        raise ConfigError("rlsync received no 'start' in this SGLang worker: call SglangWeights.start() first")
    version, views, finish = _receiver.next(message["timeout"])
    if version != message["version"]:
        error = RlsyncError(f"SGLang expected weight version {message['version']}, the trainer sent {version}")
        finish(error)
        raise error
    previous = _Snapshot(model)
    try:
        model.load_weights(views)
    except Exception as exc:
        previous.restore()  # the version that was live, whole
        finish(exc)  # the trainer's complete() raises it too
        raise
    finish(None)


_snapshot_buffers = HostStaging()  # host buffers for the rollback snapshot (pinned on a GPU), reused every version


class _Snapshot:
    """A host copy of a model's parameters (each shared one once), to put back after a failed load. It goes into
    host buffers allocated on the first version and reused after (``HostStaging``): no device memory, no fresh
    host allocation per version."""

    def __init__(self, model: Any) -> None:
        params = {id(p): p for p in model.parameters()}
        self.saved = [(p, _snapshot_buffers.stage(str(i), p)) for i, p in enumerate(params.values())]
        _snapshot_buffers.wait()

    def restore(self) -> None:
        import torch

        with torch.no_grad():
            for param, old in self.saved:
                param.copy_(old)


def _check_names(model: Any, tensors: Sequence[Sequence[Any]]) -> None:
    """Run the engine's own loader on NaN stand-ins of ``tensors``, then put the weights back: a tensor it
    refuses, or a parameter that no tensor reaches, is a ``ConfigError`` naming it."""
    import torch

    from rlsync.layouts import tensor_metas

    metas = tensor_metas(tensors)

    def stand_ins(chosen: Sequence[Any]) -> Any:
        return ((m.name, torch.full(m.shape, float("nan"), dtype=getattr(torch, m.dtype))) for m in chosen)

    snapshot = _Snapshot(model)
    try:
        try:
            model.load_weights(stand_ins(metas))
        except Exception as exc:  # noqa: BLE001 - re-raised below, naming the tensor
            refused = next((m.name for m in metas if not _loads(model, stand_ins([m]))), "?")
            raise ConfigError(f"SGLang's loader refused checkpoint tensor {refused!r} ({type(exc).__name__}: {exc}): "
                              f"offer tensors under the checkpoint's own names, or leave this one out") from exc
        unfilled = [n for n, p in model.named_parameters() if p.is_floating_point() and not bool(p.isnan().any())]
        if unfilled:
            raise ConfigError(f"no checkpoint tensor fills the engine's parameter(s) {unfilled[:5]}: the trainer must "
                              f"send them (under the checkpoint's names)")
    finally:
        snapshot.restore()


def _loads(model: Any, weights: Any) -> bool:
    try:
        model.load_weights(weights)
    except Exception:  # noqa: BLE001 - looking for the tensor the loader refuses
        return False
    return True


class SglangWeights:
    """Driver side: start rlsync in every worker of ``engine`` and apply versions as they land.

    ``engine`` is an ``sglang.Engine`` (or anything with its weight-update methods: the HTTP client in
    ``scripts/check_sglang_gpu.py``). ``tensors``: ``[(checkpoint name, dtype, shape), ...]``.
    """

    def __init__(self, engine: Any, tensors: Sequence[Sequence[Any]], *, address: str, tp_size: int = 1,
                 transport: str = "shm") -> None:
        self.engine = engine
        self.tensors = [[str(n), str(d), [int(x) for x in s]] for n, d, s in tensors]
        self.address = keyed(address)  # with a key (unless RLSYNC_SECRET is set): only this driver's trainer may write
        self.transport = transport
        self.addresses = [shift_port(self.address, r) for r in range(tp_size)]

    def _call(self, message: dict[str, Any], flush_cache: bool) -> None:
        result = self.engine.update_weights_from_tensor([(CONTROL, control_tensor(message))], load_format=LOADER,
                                                        flush_cache=flush_cache)
        success, text = result[0], result[1]
        if not success:
            if "load_format" in text:
                raise ConfigError(f"SGLang refused rlsync's loader ({text}): start the engine with "
                                  f"--custom-weight-loader {LOADER} (sglang.Engine(custom_weight_loader=[{LOADER!r}]))")
            raise RlsyncError(f"SGLang failed to load the weights: {text}")

    def start(self) -> list[str]:
        """Every worker binds its reader; returns the addresses the trainer's writer connects to (rank order)."""
        self._call({"op": "start", "address": self.address, "tensors": self.tensors, "transport": self.transport},
                   flush_cache=False)
        return self.addresses

    def apply(self, version: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Pause generation, load ``version`` once it has landed, flush the cache, set it as the engine's
        weight version and continue. If the version never lands the engine continues on the old weights.

        Pausing and the version label use the engine's ``pause_generation`` / ``continue_generation`` /
        ``update_weight_version`` where it has them (SGLang's server routes of those names); SGLang's
        scheduler runs a weight update between two batches either way."""
        pause, resume = getattr(self.engine, "pause_generation", None), getattr(self.engine, "continue_generation", None)
        if pause is not None:
            pause()
        try:
            self._call({"op": "apply", "version": version, "timeout": timeout}, flush_cache=True)
            label = getattr(self.engine, "update_weight_version", None)
            if label is not None:
                label(str(version), abort_all_requests=False)
        finally:
            if resume is not None:
                resume()
