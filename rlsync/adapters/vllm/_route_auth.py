"""Who may drive rlsync's engine through vLLM's weight-transfer routes: the trainer, proven by a signature.

A server started with ``VLLM_SERVER_DEV_MODE=1`` (which TRL's route needs) serves ``/init_weight_transfer_engine`` and
``/update_weights`` to anyone who reaches its port, with no credential of vLLM's own. So rlsync's engine takes those
requests only signed (``RouteCredential``, the trainer's; ``RouteGuard``, the engine's): an HMAC-SHA256 under a key
derived from ``rlsync.core.user_key()`` (``RLSYNC_SECRET``, or this user's key file: on one host the server and the
trainer hold it without anyone typing it; across hosts give both the same ``RLSYNC_SECRET``).

- An init carries a fresh nonce and the time it was signed; one seen before, or signed more than ``MAX_AGE`` seconds
  ago, is refused (a recording replays into nothing). The readers' key derives from the key and that nonce, so no
  request carries a key, and whoever reads the HTTP traffic learns none.
- Every update names its init's nonce and a counter that grows: an update of an earlier init, or one replayed, is
  refused before the engine waits for a byte.
- ``/shutdown_weight_transfer_engine``, ``/start_weight_update`` and ``/finish_weight_update`` carry no body rlsync
  can check: on a dev-mode server they change nothing of rlsync's (the trainer releases and commits by signed
  updates; a signed re-init closes what the last one opened).

Without the dev mode nothing reaches these routes over HTTP (the offline ``LLM`` calls them in its own process), and
an unsigned init is taken as before; ``RLSYNC_VLLM_SIGNED=1`` requires signatures there too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from collections import OrderedDict
from typing import Any

from rlsync import ConfigError
from rlsync.core import user_key

MAX_AGE = 300.0  # seconds an init's signature is good for (clocks of a run's hosts agree far better)
_SEEN = 4096  # init nonces remembered: a replay of any of them is refused
_LABEL = b"rlsync vllm weight-transfer routes"
SIGNED_ENV = "RLSYNC_VLLM_SIGNED"


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def signatures_required() -> bool:
    """Whether this worker's routes reach HTTP clients (vLLM's dev mode serves them), or signatures were asked for."""
    return _truthy("VLLM_SERVER_DEV_MODE") or _truthy(SIGNED_ENV)


def _route_key(key: bytes | None) -> bytes:
    return hmac.new(key if key is not None else user_key(), _LABEL, hashlib.sha256).digest()


def _mac(key: bytes, kind: str, body: dict[str, Any]) -> str:
    canonical = json.dumps([kind, body], sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()


def reader_secret(route_key: bytes, nonce: str) -> str:
    """The shared secret of the readers one init opens: derived, never sent."""
    return hmac.new(route_key, b"readers " + nonce.encode(), hashlib.sha256).hexdigest()


class RouteCredential:
    """The trainer's side: signs one init and the updates after it (``key``: default ``user_key()``)."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = _route_key(key)
        self.nonce = secrets.token_hex(16)
        self._counter = 0

    @property
    def reader_secret(self) -> str:
        return reader_secret(self._key, self.nonce)

    def init(self, info: dict[str, Any]) -> dict[str, Any]:
        auth = {"nonce": self.nonce, "issued": time.time()}
        return {**info, "auth": {**auth, "mac": _mac(self._key, "init", {**info, "auth": auth})}}

    def update(self, info: dict[str, Any]) -> dict[str, Any]:
        self._counter += 1
        auth = {"init": self.nonce, "counter": self._counter}
        return {**info, "auth": {**auth, "mac": _mac(self._key, "update", {**info, "auth": auth})}}


_UNSIGNED = ("this vLLM server serves its weight-transfer routes to any HTTP client (VLLM_SERVER_DEV_MODE=1), so "
             "rlsync takes only a trainer's signed requests: drive it with rlsync.adapters.vllm.VllmServer, which signs "
             "with this user's rlsync key (rlsync.core.key_file(), made on first use) or RLSYNC_SECRET, the same on both "
             "sides")


class RouteGuard:
    """The engine's side (one per worker): which init is current, and whether a request is that trainer's."""

    def __init__(self) -> None:
        self.required = signatures_required()
        self._key: bytes | None = None
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.init_nonce: str | None = None  # the current init's, when it was signed
        self._counter = 0

    def key(self) -> bytes:
        if self._key is None:
            self._key = _route_key(None)
        return self._key

    def check_init(self, raw: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """``(init info without its signature, its nonce or None when unsigned)``; raises ``ConfigError`` for an init
        rlsync must not take (unsigned where signatures are required, a bad or old signature, a replay)."""
        info = dict(raw)
        auth = info.pop("auth", None)
        if auth is None:
            if self.required:
                raise ConfigError(f"an unsigned /init_weight_transfer_engine was refused: {_UNSIGNED}")
            return info, None
        if not isinstance(auth, dict) or not isinstance(auth.get("nonce"), str) or not isinstance(auth.get("issued"), (int, float)):
            raise ConfigError("/init_weight_transfer_engine: 'auth' is not an rlsync signature ({nonce, issued, mac})")
        signed = {"nonce": auth["nonce"], "issued": auth["issued"]}
        if not hmac.compare_digest(str(auth.get("mac", "")), _mac(self.key(), "init", {**info, "auth": signed})):
            raise ConfigError(f"/init_weight_transfer_engine with a signature that does not verify: the trainer holds "
                              f"another key than this server ({_UNSIGNED})")
        if abs(time.time() - float(auth["issued"])) > MAX_AGE or auth["nonce"] in self._seen:
            raise ConfigError("/init_weight_transfer_engine signed earlier (a recorded request, or clocks more than "
                              f"{MAX_AGE:.0f} s apart): refused")
        self._seen[auth["nonce"]] = None
        while len(self._seen) > _SEEN:
            self._seen.popitem(last=False)
        return info, str(auth["nonce"])

    def opened(self, nonce: str | None) -> None:
        """The init of ``nonce`` is current: only its updates are taken from now on."""
        self.init_nonce, self._counter = nonce, 0

    def check_update(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The update info without its signature; raises ``ConfigError`` unless it is the current init's trainer's
        (unsigned updates pass only where inits may be unsigned and the current one was)."""
        info = dict(raw)
        auth = info.pop("auth", None)
        if auth is None:
            if self.required or self.init_nonce is not None:
                raise ConfigError(f"an unsigned /update_weights was refused: {_UNSIGNED}")
            return info
        if not isinstance(auth, dict) or not isinstance(auth.get("counter"), int) or auth.get("init") != self.init_nonce \
                or self.init_nonce is None:
            raise ConfigError("/update_weights signed for another init than this engine's current one: refused")
        signed = {"init": auth["init"], "counter": auth["counter"]}
        if not hmac.compare_digest(str(auth.get("mac", "")), _mac(self.key(), "update", {**info, "auth": signed})):
            raise ConfigError("/update_weights with a signature that does not verify: refused")
        if auth["counter"] <= self._counter:
            raise ConfigError("/update_weights replayed (its counter does not grow): refused")
        self._counter = auth["counter"]
        return info
