"""Rollout samples with a policy version on every generated token, and the version clock that
stamps them.

The clock fences stamping against publishing: a generation step holds ``clock.step()`` while it
samples, and a new version becomes stampable only after every step that started under the old
one has finished (``clock.advance(v)`` waits for them). So a token is never stamped with a
version the engine had not finished applying, nor with an old one after the switch.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np

from rlsync.core._errors import RolloutBufferError, VersionError, whole_number


class Sample:
    """One rollout: prompt and generated tokens, behaviour log-probs and versions per generated token; optionally,
    per generated token, the sampling mask's kept-set size (``kept``: reapply it in the trainer with
    ``rlsync.masked_logprobs(..., kept=)``) and, for MoE models, the experts each MoE layer routed it to
    (``routes``: ``[generated, layers, top_k]``, row j the experts of the forward step that sampled generated token j,
    which ran at the position before it; or ``[len(tokens) - 1, layers, top_k]``, every position the engine ran, the
    prompt's first, which is what replaying the routing in the trainer needs: the last token was sampled, never run.
    Either way the rows end at position ``len(tokens) - 2``. The smallest unsigned dtype that holds the ids.)"""

    __slots__ = ("group", "kept", "logprobs", "meta", "newest_version", "oldest_version", "prompt_id", "prompt_len",
                 "reward", "routes", "sample_id", "tokens", "versions")

    def __init__(
        self,
        prompt_id: str,
        tokens: np.ndarray,
        prompt_len: int,
        logprobs: np.ndarray,
        versions: np.ndarray,
        *,
        group: str | None = None,
        reward: float = 0.0,
        sample_id: str | None = None,
        meta: dict[str, Any] | None = None,
        kept: np.ndarray | None = None,
        routes: np.ndarray | None = None,
    ) -> None:
        generated = len(tokens) - prompt_len
        if len(logprobs) != generated or len(versions) != generated:
            raise RolloutBufferError(
                f"sample of prompt {prompt_id!r}: {generated} generated tokens but {len(logprobs)} log-probs "
                f"and {len(versions)} versions; give one of each per generated token"
            )
        if kept is not None and len(kept) != generated:
            raise RolloutBufferError(f"sample of prompt {prompt_id!r}: {generated} generated tokens but {len(kept)} "
                                     "kept-set sizes; give one per generated token")
        if routes is not None and (routes.ndim != 3 or len(routes) not in (generated, len(tokens) - 1)):
            raise RolloutBufferError(f"sample of prompt {prompt_id!r}: routes of shape {routes.shape}; give [{generated} "
                                     f"generated tokens (or {len(tokens) - 1} positions run), MoE layers, experts per token]")
        self.prompt_id = prompt_id
        self.group = prompt_id if group is None else group
        self.tokens = tokens
        self.prompt_len = prompt_len
        self.logprobs = logprobs
        self.versions = versions
        self.reward = reward
        self.sample_id = sample_id or uuid.uuid4().hex
        self.meta = meta or {}
        self.kept = kept
        self.routes = routes
        self.oldest_version = int(versions.min()) if generated else -1
        self.newest_version = int(versions.max()) if generated else -1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Sample({self.prompt_id!r}, tokens={len(self.tokens)}, versions={sorted(set(self.versions.tolist()))})"


class WireSample(msgspec.Struct, array_like=True):
    """A sample as bytes for backends that store or ship it (msgpack; never pickle)."""

    sample_id: str
    prompt_id: str
    group: str
    prompt_len: int
    reward: float
    tokens: bytes
    logprobs: bytes
    versions: bytes
    meta: dict[str, Any]
    kept: bytes = b""  # int16 per generated token, empty: not recorded
    routes: bytes = b""  # [generated, layers, top_k] in routes_dtype, empty: not recorded
    routes_shape: list[int] = []
    routes_dtype: str = ""


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(WireSample)


def _route_ids(routes: np.ndarray) -> np.ndarray:
    """Routes in the smallest unsigned dtype that holds their expert ids (48 layers x top-8 of 256 experts: 384 bytes
    per token)."""
    top = int(routes.max()) if routes.size else 0
    if routes.size and int(routes.min()) < 0:
        raise RolloutBufferError(f"routes hold a negative expert id ({int(routes.min())})")
    return np.ascontiguousarray(routes, np.uint8 if top < 1 << 8 else np.uint16 if top < 1 << 16 else np.uint32)


def encode_sample(s: Sample) -> bytes:
    routes = None if s.routes is None else _route_ids(s.routes)
    return _enc.encode(WireSample(
        s.sample_id, s.prompt_id, s.group, s.prompt_len, s.reward,
        np.ascontiguousarray(s.tokens, np.int32).tobytes(), np.ascontiguousarray(s.logprobs, np.float32).tobytes(),
        np.ascontiguousarray(s.versions, np.int32).tobytes(), s.meta,
        b"" if s.kept is None else np.ascontiguousarray(s.kept, np.int16).tobytes(),
        b"" if routes is None else routes.tobytes(), [] if routes is None else list(routes.shape),
        "" if routes is None else routes.dtype.name,
    ))


def decode_sample(data: bytes) -> Sample:
    w = _dec.decode(data)
    routes = None
    if w.routes_shape:
        if w.routes_dtype not in ("uint8", "uint16", "uint32") or len(w.routes_shape) != 3:
            raise RolloutBufferError(f"sample {w.sample_id!r}: routes of dtype {w.routes_dtype!r} and shape {w.routes_shape}")
        routes = np.frombuffer(w.routes, np.dtype(w.routes_dtype)).reshape(w.routes_shape)
    return Sample(
        w.prompt_id, np.frombuffer(w.tokens, np.int32), w.prompt_len, np.frombuffer(w.logprobs, np.float32),
        np.frombuffer(w.versions, np.int32), group=w.group, reward=w.reward, sample_id=w.sample_id, meta=w.meta,
        kept=np.frombuffer(w.kept, np.int16) if w.kept else None, routes=routes,
    )


class PolicyVersionClock:
    """The policy version generation stamps tokens with; see the module docstring."""

    def __init__(self, version: int = 0) -> None:
        self._version = whole_number("version", version, 0)
        self._steps = 0
        self._advancing = False
        self._cond = threading.Condition()

    @property
    def version(self) -> int:
        return self._version

    @contextmanager
    def step(self) -> Iterator[int]:
        """Hold while sampling tokens; yields the version to stamp them with."""
        with self._cond:
            self._cond.wait_for(lambda: not self._advancing)
            self._steps += 1
            version = self._version
        try:
            yield version
        finally:
            with self._cond:
                self._steps -= 1
                self._cond.notify_all()

    def advance(self, version: int, apply: Any = None) -> None:
        """Make ``version`` the stamped version once running steps finish; ``apply()`` (optional)
        runs in between, with no step running: swap the weights there."""
        with self._cond:
            if version <= self._version:
                raise VersionError(f"policy version {version} is not newer than {self._version}")
            self._advancing = True
            self._cond.wait_for(lambda: self._steps == 0)
        try:
            if apply is not None:
                apply()
            with self._cond:
                self._version = version
        finally:
            with self._cond:
                self._advancing = False
                self._cond.notify_all()
