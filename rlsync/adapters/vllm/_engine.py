"""vLLM's native weight-transfer API with rlsync as its backend (``{"backend": "rlsync"}``).

Registered from the ``vllm.general_plugins`` entry point (``_plugin.register``); select it with
``LLM(..., weight_transfer_config={"backend": "rlsync"})`` or ``--weight-transfer-config
'{"backend": "rlsync"}'``. Per version the driver calls ``start_weight_update()``,
``update_weights({"update_info": {"version": v}})``, ``finish_weight_update(weight_version=...)``
while the trainer's ``WeightsWriter.complete(v)`` runs; ``complete`` returns once
``finish_weight_update`` has loaded the version (staged landing, vLLM's layerwise reload).

Worker ``r`` binds port ``PORT + r`` of the address in the init info (the trainer picks it), so the
trainer knows where to connect before the engine answers, and learns the layout from the workers
(``WeightsWriter(src, None, 0, addresses)``). At init every worker checks the tensor list against its
loader and learns its part of each tensor (``learn_parts``): a bad name fails the init, before a byte
moves. A version is loaded only once all its bytes have landed, all or nothing (``EngineCommit``):
a trainer that dies, a timeout or a loader error leaves the engine serving the previous version.

On a server whose routes reach HTTP clients (``VLLM_SERVER_DEV_MODE=1``) the init and every update must be signed by
the trainer (``_route_auth``: ``VllmServer`` signs them); the readers' key derives from the signed init, a signed
re-init closes what the last one opened, and the versions go on from the one the engine serves (its own count, not
vLLM's label, which any HTTP client may set) unless the signed init says where the trainer resumes.

With ``lora`` in the init info (a PEFT adapter's config) the tensors are a LoRA adapter's and the base model is
never touched: each version is kept for vLLM's own loader (``_lora_versions``), which the trainer's
``/v1/load_lora_adapter`` call then registers as adapter ``NAME@VERSION`` (``VllmServer.publish_lora``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlsync import DEFAULT_TIMEOUT, CanaryError, ConfigError, Finish, StagedReceiver, SyncOptions, VersionError
from rlsync.adapters.vllm._commit import EngineCommit
from rlsync.core import host_port, split_address
from rlsync.adapters.vllm._lora import adapter_receiver
from rlsync.adapters.vllm._lora_versions import AdapterVersions, install_loader
from rlsync.adapters.vllm._probe import check_declared_sizes, learn_parts, learn_placements
from rlsync.adapters.vllm._route_auth import RouteGuard, reader_secret

_log = logging.getLogger("rlsync")


@dataclass
class RlsyncInitInfo(WeightTransferInitInfo):
    address: str  # tcp://HOST:PORT: worker r's reader binds PORT + r
    tensors: list[Any] = field(default_factory=list)  # [[hf_name, dtype, shape], ...]
    transport: str = "shm"
    # No longer taken (a request must not name a file the engine writes): every worker's part of each tensor is
    # rlsync.reader_layout(address), from the engine's readers; given, the init is refused naming it
    boxes_file: str | None = None
    # the version the trainer goes on after (a trainer resumed from its checkpoint); None: the one the engine serves
    live_version: int | None = None
    # a CRC per tensor, sent by the trainer and checked on landing (the trainer's writer must send them)
    verify: bool = False
    # adapter-only sync: the PEFT adapter's config (adapter_config.json as data); tensors are its A/B matrices
    lora: dict[str, Any] | None = None
    lora_name: str = "policy"  # versions are served as adapters NAME@VERSION
    keep: int = 2  # adapter versions kept loadable (a rollout started on one may finish on it)


@dataclass
class RlsyncUpdateInfo(WeightTransferUpdateInfo):
    version: int
    timeout: float = DEFAULT_TIMEOUT
    # a second update_weights for the same version, after the trainer checked its canary against the loaded version
    # (rlsync.adapters.vllm.VllmServer.publish): the reason it failed; the engine undoes the version
    refused: str | None = None
    # a second update_weights for the same version, with verify: the digest of each worker's part the trainer sent
    # (WeightsWriter.last_digests, in worker order); a worker whose landed version has another undoes it
    digests: list[str] | None = None
    # signed: the version loaded (and checked) goes live now (finish_weight_update carries nothing a trainer signs)
    commit: bool = False
    # signed: the trainer is done with this engine's readers (what /shutdown_weight_transfer_engine did, unsigned)
    release: bool = False


def _options(init_info: RlsyncInitInfo, rank: int, secret: str | None) -> SyncOptions:
    """Worker ``rank``'s reader options: it binds PORT + rank of the init info's address, under ``secret`` (a signed
    init's derived one) or the key the address carries (an unsigned init's; None: a shared secret)."""
    host, port = host_port(init_info.address)
    key = split_address(init_info.address)[1]
    if secret is not None and key is not None:
        raise ConfigError("a signed init's address carries no key (the readers' key derives from the signed init)")
    return SyncOptions(transport=init_info.transport, host=host, port=port + rank, verify=init_info.verify,
                       secret=secret or key)


class RlsyncWeightTransferEngine(WeightTransferEngine[RlsyncInitInfo, RlsyncUpdateInfo]):
    init_info_cls = RlsyncInitInfo
    update_info_cls = RlsyncUpdateInfo
    supports_draft_weight_update = False

    # what a worker holds across inits: who may drive it, the version it serves, the receiving side of the last init
    _guard: RouteGuard | None = None
    _served = -1
    _receiver: Any = None
    _adapters: AdapterVersions | None = None
    _finish: Finish | None = None
    _undo: Callable[[], None] | None = None  # a version that came with a canary, until it is checked
    _held = -1  # the version loaded and waiting for its commit

    def _route_guard(self) -> RouteGuard:
        if self._guard is None:
            self._guard = RouteGuard()
        return self._guard

    def parse_init_info(self, init_dict: dict[str, Any]) -> RlsyncInitInfo:
        """Checked before anything else: the signature (``_route_auth``), then the fields."""
        info, self._init_nonce = self._route_guard().check_init(init_dict)
        parsed: RlsyncInitInfo = super().parse_init_info(info)
        return parsed

    def parse_update_info(self, update_dict: dict[str, Any]) -> RlsyncUpdateInfo:
        parsed: RlsyncUpdateInfo = super().parse_update_info(self._route_guard().check_update(update_dict))
        return parsed

    def init_transfer_engine(self, init_info: RlsyncInitInfo) -> None:
        from vllm.distributed.parallel_state import get_world_group

        if init_info.boxes_file is not None:
            raise ConfigError("init_info 'boxes_file' is no longer taken (a request must not name a file the engine "
                              "writes): every worker's part of each tensor is rlsync.reader_layout(address)")
        nonce, self._init_nonce = getattr(self, "_init_nonce", None), None
        secret = None if nonce is None else reader_secret(self._route_guard().key(), nonce)
        world = get_world_group()
        live = self._served if init_info.live_version is None else int(init_info.live_version)
        options = _options(init_info, world.rank, secret)
        check_declared_sizes(self.model, init_info.tensors, world.world_size)  # before the probe allocates for them
        if init_info.lora is not None:
            self._close_receiver()  # a re-init replaces what the last one opened (threads, ports, landing memory)
            self._route_guard().opened(nonce)
            self._init_lora(init_info, init_info.lora, world.rank, world.world_size, options, live)
            return
        tensors, boxes = learn_parts(self.model, init_info.tensors, world.cpu_group)  # an init it refuses changes nothing
        commit = EngineCommit(self.model, learn_placements(self.model, init_info.tensors))
        self._close_receiver()
        self._route_guard().opened(nonce)
        self._receiver = StagedReceiver(tensors, boxes=boxes, rank=world.rank, options=options, live_version=live)
        self._rank = world.rank
        self._digest: str | None = None
        self._commit = commit

    def _init_lora(self, init_info: RlsyncInitInfo, peft_config: dict[str, Any], rank: int, world: int,
                   options: SyncOptions, live: int) -> None:
        """Adapter-only sync: every worker receives the whole adapter (vLLM's LoRA layers slice it per rank)."""
        if getattr(self.model, "lora_manager", None) is None:
            raise ConfigError("this vLLM server serves no LoRA adapters: start it with --enable-lora --max-lora-rank R "
                              "(at least the adapter's rank) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
        install_loader()
        self._receiver = adapter_receiver(init_info.tensors, rank, world, options, live_version=live)
        self._adapters = AdapterVersions(init_info.lora_name, peft_config, init_info.keep)
        self._rank, self._digest = rank, None

    def _close_receiver(self) -> None:
        """Undo a version still held (its trainer is gone), then close the readers and the adapter versions."""
        if self._undo is not None:
            self._undo()
        elif self._finish is not None:  # loaded for good (no canary, no checksums): it is what the engine serves
            self._served = self._held
        if self._finish is not None:
            self._finish(ConfigError("the engine's weight transfer was initialised again before this version went live"))
        self._finish = self._undo = None
        receiver, adapters, self._receiver, self._adapters = self._receiver, self._adapters, None, None
        if receiver is not None:
            receiver.close()
        if adapters is not None:
            adapters.close()

    def start_weight_update(self) -> None:
        # Nothing to prepare: the reload starts only once a version's bytes have all landed (receive_weights),
        # so a trainer that never sends leaves the engine as it was. Nothing to reset either: a held version stays
        # held until its trainer's signed commit or refusal (this route is anyone's on a dev-mode server).
        pass

    def receive_weights(self, update_info: RlsyncUpdateInfo) -> None:
        if self._receiver is None:
            raise ConfigError("rlsync's weight transfer is not initialised (or was released): /init_weight_transfer_engine first")
        if update_info.release:
            self._close_receiver()
            return
        if update_info.commit:
            self._go_live()
            return
        if update_info.refused is not None:  # the trainer's canary check of the version loaded: failed
            self._refuse(update_info.refused, CanaryError)
            return
        if update_info.digests is not None:  # the version is bound to the trainer's bytes, or undone
            landed, sent = self._digest, update_info.digests[self._rank]
            if landed != sent:
                self._refuse(f"worker {self._rank} loaded version {update_info.version} with digest {landed}, the trainer "
                             f"sent digest {sent}: other bytes than the trainer's; version undone", VersionError)
                raise VersionError(f"digest {landed} on this worker, {sent} from the trainer: version undone")
            return
        version, views, finish = self._receiver.next(update_info.timeout)
        if version != update_info.version:
            error = VersionError(f"the engine expected version {update_info.version}, the trainer sent {version}")
            finish(error)
            raise error
        if self._adapters is not None:  # kept for vLLM's loader; live once the trainer's load and canary passed
            adapters = self._adapters
            adapters.add(version, {name: t.clone() for name, t in views})  # the staging slot takes the next version
            self._digest = self._receiver.reader.landed_digest  # with verify, the trainer checks it over HTTP
            self._finish, self._undo, self._held = finish, lambda: adapters.drop(version), version
            return
        reader = self._receiver.reader
        checked = reader.landed_canary is not None and reader.options.canary  # the trainer checks it over HTTP
        self._digest = reader.landed_digest  # with verify, the trainer checks it over HTTP too
        try:
            self._undo = self._commit.load(self.model, self.model_config, views, undoable=checked or self._digest is not None,
                                           verify=reader.options.verify)
        except Exception as exc:
            finish(exc)
            raise
        self._finish, self._held = finish, version

    def _refuse(self, reason: str, error: type[Exception]) -> None:
        finish, undo, self._finish, self._undo = self._finish, self._undo, None, None
        if finish is None or undo is None:
            raise ConfigError("update_weights with 'refused' or 'digests': no version with a canary or checksums is "
                              "loaded and waiting")
        undo()  # the engine is back on its previous version
        finish(error(reason))  # the trainer's complete(v) raises it

    def _go_live(self) -> None:
        finish, self._finish, self._undo = self._finish, None, None
        if self._adapters is not None:
            self._adapters.trim()
        if finish is not None:
            self._served = self._held
            finish(None)  # the trainer's complete(v) returns: v is what the engine serves

    def finish_weight_update(self) -> None:
        # a signed init's versions go live by its trainer's signed commit: this route carries nothing signed
        if self._route_guard().init_nonce is None:
            self._go_live()

    def shutdown(self) -> None:
        if self._route_guard().required or self._route_guard().init_nonce is not None:
            _log.info("rlsync: /shutdown_weight_transfer_engine carries no trainer's signature: the readers stay until "
                      "the trainer releases them, a signed init replaces them, or the server stops")
            return
        self._close_receiver()
