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

from rlsync.core._errors import RolloutBufferError, VersionError


class Sample:
    """One rollout: prompt and generated tokens, behaviour log-probs and versions per generated token."""

    __slots__ = ("group", "logprobs", "meta", "newest_version", "oldest_version", "prompt_id", "prompt_len", "reward", "sample_id", "tokens", "versions")

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
    ) -> None:
        generated = len(tokens) - prompt_len
        if len(logprobs) != generated or len(versions) != generated:
            raise RolloutBufferError(
                f"sample of prompt {prompt_id!r}: {generated} generated tokens but {len(logprobs)} log-probs "
                f"and {len(versions)} versions; give one of each per generated token"
            )
        self.prompt_id = prompt_id
        self.group = prompt_id if group is None else group
        self.tokens = tokens
        self.prompt_len = prompt_len
        self.logprobs = logprobs
        self.versions = versions
        self.reward = reward
        self.sample_id = sample_id or uuid.uuid4().hex
        self.meta = meta or {}
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


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(WireSample)


def encode_sample(s: Sample) -> bytes:
    return _enc.encode(WireSample(
        s.sample_id, s.prompt_id, s.group, s.prompt_len, s.reward,
        np.ascontiguousarray(s.tokens, np.int32).tobytes(), np.ascontiguousarray(s.logprobs, np.float32).tobytes(),
        np.ascontiguousarray(s.versions, np.int32).tobytes(), s.meta,
    ))


def decode_sample(data: bytes) -> Sample:
    w = _dec.decode(data)
    return Sample(
        w.prompt_id, np.frombuffer(w.tokens, np.int32), w.prompt_len, np.frombuffer(w.logprobs, np.float32),
        np.frombuffer(w.versions, np.int32), group=w.group, reward=w.reward, sample_id=w.sample_id, meta=w.meta,
    )


class PolicyVersionClock:
    """The policy version generation stamps tokens with; see the module docstring."""

    def __init__(self, version: int = 0) -> None:
        self._version = version
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
