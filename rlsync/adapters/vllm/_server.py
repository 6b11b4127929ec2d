"""The trainer's side of a stock vLLM server started with ``--weight-transfer-config '{"backend": "rlsync"}'``.

``VllmServer(url).publish(named_tensors)`` makes one version live on the server through vLLM's own
weight-transfer routes (``/init_weight_transfer_engine`` once, then ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update`` per version) while a ``WeightsWriter`` in this process
moves the bytes. The tensor list is taken from the first version published; the server's dtype decides
what is sent (the trainer's tensors are cast, as vLLM's loader would on copy). The server serves the
old version or the new one, never a mix: its engine loads a version only once every byte has landed.
Plain HTTP with JSON (the standard library), nothing pickled.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.parse
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from rlsync import (
    Canary,
    ConfigError,
    PeerLostError,
    RlsyncWarning,
    SyncOptions,
    VersionError,
    WeightsWriter,
    version_label,
)
from rlsync.adapters.vllm._lora import refuse_unsupported
from rlsync.adapters.vllm._route_auth import RouteCredential
from rlsync.adapters.vllm._server_calls import ServerCalls
from rlsync.core import shift_port, span, with_key
from rlsync.adapters.vllm._lora_versions import path_of
from rlsync.layouts import from_state_dict, tied_aliases



@dataclass(frozen=True)
class PublishStats:
    version: int
    bytes: int  # bytes this process sent (every tensor once per engine worker that reads it)
    seconds: float  # from the first byte put to the version live on the server
    tensors: int
    canary_deviation: float | None = None  # the server's canary deviation (mean nats per token), when checked
    label: str = ""  # the weight version the server reports: "V", or "V+DIGEST" of the bytes with verify
    adapter: str | None = None  # publish_lora: the adapter's name on the server, "NAME@V" (what requests give as model)


@cache
def _warn_paused_once(url: str) -> None:
    warnings.warn(f"the vLLM server at {url} is paused during the weight sync (TRL's async trainer pauses it): it runs "
                  f"no request before resume, so the versions' canary is not checked there. Sync without pausing "
                  f"(RlsyncSyncCallback) to have it checked, or SyncOptions(canary=False) to not compute it",
                  RlsyncWarning, stacklevel=3)


def reserve_ports(host: str, count: int) -> int:
    """A port P such that P, P+1, ..., P+count-1 are free on ``host`` now: engine worker r binds P + r."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = int(probe.getsockname()[1])
        if base + count > 65535:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise ConfigError(f"found no {count} consecutive free ports on {host}")


class VllmServer(ServerCalls):
    """Drives one vLLM server's weight-transfer routes with rlsync as the backend.

    ``url``: the server's base URL (``http://127.0.0.1:8000``). ``options`` (``rlsync.SyncOptions``):
    ``transport`` (``shm``, same host, the default; or ``tcp``), ``timeout`` (seconds a version may take to go
    live), ``host`` (where the engine's workers bind their readers; default: the server's own host), ``wire``
    (``"full"`` or ``"delta"``: only the values that changed since the server's last version) and ``verify``
    (a CRC per tensor checked by the engine on landing; a mismatch refuses the version, naming the tensor).
    """

    def __init__(self, url: str, *, options: SyncOptions | None = None) -> None:
        options = options or SyncOptions()
        if options.codec is not None:
            raise ConfigError(f"wire={options.wire!r}: a vLLM server takes 'full' or 'delta' (fp8 needs an fp8 engine's tensor list)")
        server_host = urllib.parse.urlparse(url).hostname or "127.0.0.1"
        host = options.host if options.host != SyncOptions.host else server_host  # the workers bind beside the server
        super().__init__(url, options.replace(host="127.0.0.1" if host == "localhost" else host))
        self._writer: WeightsWriter | None = None
        self._lora: dict[str, Any] | None = None  # adapter-only sync (publish_lora): its config, name and keep
        self._adapters: list[str] = []  # the adapter versions the server serves, oldest first
        self._names: list[str] = []
        self._dtype: Any = None
        self._workers = 0
        self._credential: RouteCredential | None = None  # signs the current init's requests
        self.version = 0  # the last version this object made live

    # --- weights ------------------------------------------------------------------------------------------
    def publish(self, named_tensors: Iterable[tuple[str, Any]], version: int | None = None, *,
                canary: Canary | None = None) -> PublishStats:
        """Make ``named_tensors`` live on the server as ``version`` (default: the next one after the server's live one).

        The first call fixes the tensor list (names, shapes; the server's dtype); later calls must send the
        same tensors. Returns once the server serves the new version; on any error the server still serves
        the previous one.

        ``canary`` (``rlsync.Canary.of(model)``, of the weights sent): once the version is loaded and before it
        serves, the server's prompt log-probs of its tokens are checked against it; a version that deviates is
        undone (``CanaryError``, naming the largest deviation; the server serves the previous version). The
        deviation is ``PublishStats.canary_deviation``. A paused server (``pause()``) runs no request: its canary
        is not checked, and a warning says so.
        """
        with span("sync", route="vllm-http") as timeline:
            stats = self._publish(named_tensors, version, canary)
            timeline.update(version=stats.version, bytes=stats.bytes)
        return stats

    def _publish(self, named_tensors: Iterable[tuple[str, Any]], version: int | None, canary: Canary | None) -> PublishStats:
        started = time.perf_counter()
        dtype = self._server_dtype()
        # cast as they come (an iterator may gather each parameter and release it after it is taken), then drop the
        # names that are still one tensor (a tied lm_head.weight already in the server's dtype); a tied alias cast
        # into a copy is left out by the engine itself
        state = {name: _cast(t, dtype) for name, t in named_tensors}
        for alias in tied_aliases(state):
            del state[alias]
        writer = self._writer_for(state, lora=None, version=version)
        version = self._next(writer, version)
        writer.multi_put(state)  # checks names, dtypes and sizes before the server waits for anything
        deviation, label = self._go_live(writer, version, canary, adapter=None)
        return PublishStats(version, writer.last_bytes, time.perf_counter() - started, len(state), deviation, label)

    def publish_lora(self, tensors: Mapping[str, Any], peft_config: Mapping[str, Any], version: int | None = None, *,
                     name: str = "policy", keep: int = 2, canary: Canary | None = None) -> PublishStats:
        """Make a PEFT LoRA adapter live on the server as adapter ``NAME@VERSION``; nothing of the base model moves.

        ``tensors, peft_config = rlsync.wire.lora_state(model)``. The server needs ``--enable-lora --max-lora-rank R``
        and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (its ``/v1/load_lora_adapter`` route registers each version).
        Requests use a version by naming it (``"model": stats.label``); the newest ``keep`` versions stay served (a
        rollout started on one finishes on it), older ones are unloaded. ``canary`` (``rlsync.Canary.of`` the PEFT
        model): checked with the new adapter before this returns, as in ``publish``; a version that deviates is
        unloaded again and ``CanaryError`` raised. ``PublishStats.adapter`` is the name requests give
        (``NAME@VERSION``); ``PublishStats.label`` what ``/weight_info`` reports (the same, with the digest under verify).
        """
        refuse_unsupported(peft_config)
        started = time.perf_counter()
        dtype = self._server_dtype()
        state = {n: _cast(t, dtype) for n, t in tensors.items()}
        writer = self._writer_for(state, lora={"config": dict(peft_config), "name": name, "keep": keep}, version=version)
        version = self._next(writer, version)
        writer.multi_put(state)
        adapter = f"{name}@{version}"
        deviation, label = self._go_live(writer, version, canary, adapter=adapter)
        self._adapters.append(adapter)
        while len(self._adapters) > keep:  # no request can name it from now on (the engine drops its tensors too)
            self.call("/v1/unload_lora_adapter", {"lora_name": self._adapters.pop(0)})
        return PublishStats(version, writer.last_bytes, time.perf_counter() - started, len(state), deviation, label, adapter)

    def _server_dtype(self) -> Any:
        import torch

        if self._dtype is None:
            self._dtype = getattr(torch, str(self.config()["model_config"]["dtype"]).removeprefix("torch."))
        return self._dtype

    def _writer_for(self, state: dict[str, Any], lora: dict[str, Any] | None, version: int | None) -> WeightsWriter:
        if self._writer is None:
            self._open(state, lora, version)
        elif (lora is None) != (self._lora is None):
            raise ConfigError("this VllmServer already sends " + ("full weights" if self._lora is None else "adapters") +
                              ": one route per connection (close() it, or use another VllmServer)")
        elif list(state) != self._names:
            extra, missing = sorted(set(state) - set(self._names)), sorted(set(self._names) - set(state))
            raise ConfigError(f"the tensors changed since the first version (new: {extra[:5]}, gone: {missing[:5]}); "
                              "the server's tensor list is fixed at the first publish")
        assert self._writer is not None
        return self._writer

    def _next(self, writer: WeightsWriter, version: int | None) -> int:
        # version 0 is the checkpoint the server started from: a fresh server's first published version is 1; a server
        # that serves version N (another client made it live) goes on at N + 1 (its readers say N, not vLLM's label)
        return max(writer.next_version, self.version + 1) if version is None else version

    def _update(self, info: dict[str, Any], timeout: float | None = None) -> Any:
        """``/update_weights`` with ``info``, signed for the current init."""
        assert self._credential is not None
        return self.call("/update_weights", {"update_info": self._credential.update(info)}, timeout=timeout)

    def _start(self) -> None:
        """``/start_weight_update``. vLLM's own route, open to every HTTP client of a dev-mode server: one that left an
        update session open (it changes nothing of rlsync's) is closed first, once."""
        try:
            self.call("/start_weight_update", {})
        except PeerLostError as exc:
            if "already active" not in str(exc):
                raise
            self.call("/finish_weight_update", {})
            self.call("/start_weight_update", {})

    def _go_live(self, writer: WeightsWriter, version: int, canary: Canary | None, *,
                 adapter: str | None) -> tuple[float | None, str]:
        """The version's bytes (put already) go live: sent while the engine waits for them, loaded, its canary
        checked (``adapter``: registered under that name first, and checked with it), bound to its digests under
        verify, then made what the server serves. Any failure leaves the server on the previous version."""
        self._start()
        failure: list[BaseException] = []

        if canary is not None and self.paused:
            _warn_paused_once(self.url)
            canary = None

        def send() -> None:
            try:
                writer.complete(version, canary=canary)  # the engine holds the version undoable until it is checked
            except BaseException as exc:  # noqa: BLE001 - reported on the caller's thread below
                failure.append(exc)

        sender = threading.Thread(target=send, name="rlsync-vllm-server-publish", daemon=True)
        sender.start()
        try:
            self._update({"version": version, "timeout": self.options.timeout}, timeout=self.options.timeout + 60)
        except Exception:
            sender.join(timeout=5)
            if failure:
                raise failure[0] from None
            raise
        deviation = None
        try:  # loaded, not yet live: the trainer's writer waits for finish_weight_update
            if adapter is not None:
                self._load_adapter(adapter, version)
            if canary is not None:
                if adapter is None:
                    self.call("/reset_prefix_cache")  # the canary must run on the new weights
                deviation = canary.check(self.prompt_logprobs(canary.tokens, model=adapter),
                                         where=f"the vLLM server at {self.url}")
        except Exception as exc:
            if adapter is not None:
                self._unload_quietly(adapter)
            self._update({"version": version, "refused": str(exc)})
            self.call("/finish_weight_update", {})
            if adapter is None:
                self.call("/reset_prefix_cache")
            sender.join(self.options.timeout)
            raise
        label = str(version)
        if writer.last_digests:  # verify: each worker checks its landed version is the bytes this writer sent
            digests = [writer.last_digests[r] for r in range(self._workers)]
            try:
                self._update({"version": version, "digests": digests})
            except Exception:
                if adapter is not None:
                    self._unload_quietly(adapter)
                sender.join(self.options.timeout)
                raise failure[0] if failure else VersionError(f"the vLLM server at {self.url} refused version {version}'s "
                                                              f"digests {digests}") from None
            label = version_label(version, digests)
        if adapter is not None:
            label = f"{adapter.rsplit('@', 1)[0]}@{label}"
        self._update({"version": version, "commit": True})  # live now: the writer's complete returns
        self.call("/finish_weight_update", {"weight_version": label})
        sender.join(self.options.timeout)
        if failure:
            raise failure[0]
        reported = self.weight_version()
        if reported != label:  # vLLM's label, which any HTTP client of a dev-mode server may set: said, not trusted
            warnings.warn(f"the vLLM server at {self.url} reports weight version {reported!r} after version {version} went "
                          f"live as {label!r}: something else set its label (/update_weight_version answers any HTTP "
                          f"client of a dev-mode server; keep its port on loopback)", RlsyncWarning, stacklevel=3)
        writer.next_version = version + 1
        self.version = version
        return deviation, label

    def _load_adapter(self, adapter: str, version: int) -> None:
        """Register the landed adapter version with the API server (and so with every worker's LoRA manager)."""
        try:
            self.call("/v1/load_lora_adapter", {"lora_name": adapter, "lora_path": path_of(adapter.rsplit("@", 1)[0], version)})
        except ConfigError:
            raise ConfigError(f"the vLLM server at {self.url} has no /v1/load_lora_adapter route: start it with "
                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (and --enable-lora --max-lora-rank R)") from None

    def _unload_quietly(self, adapter: str) -> None:
        try:
            self.call("/v1/unload_lora_adapter", {"lora_name": adapter})
        except (PeerLostError, ConfigError):
            pass  # never registered: nothing to unload

    def _open(self, state: dict[str, Any], lora: dict[str, Any] | None, version: int | None) -> None:
        """A signed init (``_route_auth``): the readers' key derives from it and crosses no wire; ``version`` given, the
        engine's readers go on from the one before it (a trainer resumed from its checkpoint), else from the version
        the engine serves, which the readers report (vLLM's label is any HTTP client's to set)."""
        tensors = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in state.items()]
        workers = int(self.call("/get_world_size", method="GET")["world_size"])
        host, plain = self.options.host, self.options.to_mapping()  # plain: the transport by name, for JSON
        base = reserve_ports(host, workers)
        credential = RouteCredential(self.options.secret.encode() if self.options.secret else None)
        address = f"tcp://{host}:{base}"
        info: dict[str, Any] = {"address": address, "tensors": tensors, "transport": plain["transport"],
                                "verify": plain["verify"], "live_version": None if version is None else version - 1}
        if lora is not None:
            info.update(lora=lora["config"], lora_name=lora["name"], keep=lora["keep"])
        self.call("/init_weight_transfer_engine", {"init_info": credential.init(info)})
        self._credential = credential
        readers = [shift_port(with_key(address, credential.reader_secret), r) for r in range(workers)]
        self._workers = workers
        self._writer = WeightsWriter(from_state_dict(state), None, 0, readers, options=self.options.replace(secret=None))
        self.version = max(self.version, self._writer.next_version - 1)
        self._names = list(state)
        self._lora = lora
        self._adapters = []

    def close(self) -> None:
        """Release the server's receiving side (a later trainer can connect again) and this writer."""
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        writer.close()
        self._dtype = None
        try:  # signed, inside an update session (vLLM's /shutdown_weight_transfer_engine carries nothing to sign)
            self._start()
            self._update({"version": self.version, "release": True}, timeout=60)
            self.call("/finish_weight_update", {}, timeout=60)
        except (PeerLostError, ConfigError):
            pass  # the server is gone or older: nothing of ours is left to release there


def _cast(tensor: Any, dtype: Any) -> Any:
    """What the server loads: its dtype (vLLM's loader casts the same way on copy), cast where the tensor lives
    (on a GPU the smaller dtype is what crosses PCIe); the writer copies device memory into reused host buffers."""
    return tensor.detach().to(dtype)
