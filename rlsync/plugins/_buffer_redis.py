"""``redis``: rollout samples in a Redis stream, so they survive a crash of the buffer's process
or of Redis itself (run Redis with ``appendonly yes`` and ``appendfsync always``).

Exactly once: ``append`` is a Lua script that adds a sample only if its id was never seen, and
``take`` is a Lua script that hands out the entries after a cursor and records their id range
under the request's id (the entries themselves are trimmed when the next request shows the
caller got them). Both are atomic, so a call retried after a lost reply (Redis killed and
restarted) adds or returns exactly what the first attempt did: no sample is lost, none is
delivered twice.
Samples are msgpack (never pickle). Order: first in, first out.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from rlsync.core._errors import BufferError
from rlsync.core._samples import Sample, decode_sample, encode_sample

T = TypeVar("T")

_APPEND = """
local added = 0
for i = 1, #ARGV, 2 do
  if redis.call('SADD', KEYS[1], ARGV[i]) == 1 then
    redis.call('XADD', KEYS[2], '*', 'd', ARGV[i + 1])
    added = added + 1
  end
end
return added
"""

_TAKE = """
-- KEYS: stream, cursor (id of the last entry handed out), batch (request id -> its id range)
local range = redis.call('HGET', KEYS[3], ARGV[2])
if range then
  local ends = {}
  for id in string.gmatch(range, '[^ ]+') do table.insert(ends, id) end
  local out = {}
  for _, entry in ipairs(redis.call('XRANGE', KEYS[1], ends[1], ends[2])) do table.insert(out, entry[2][2]) end
  return out
end
local cursor = redis.call('GET', KEYS[2])
-- the caller asking again means it holds the previous batch: drop those entries now
if cursor then
  local ms, seq = string.match(cursor, '(%d+)-(%d+)')
  redis.call('XTRIM', KEYS[1], 'MINID', ms .. '-' .. (tonumber(seq) + 1))
end
redis.call('DEL', KEYS[3])
local entries = redis.call('XRANGE', KEYS[1], cursor and ('(' .. cursor) or '-', '+', 'COUNT', tonumber(ARGV[1]))
local out = {}
for _, entry in ipairs(entries) do table.insert(out, entry[2][2]) end
if #entries > 0 then
  local first, last = entries[1][1], entries[#entries][1]
  redis.call('SET', KEYS[2], last)
  redis.call('HSET', KEYS[3], ARGV[2], first .. ' ' .. last)
  redis.call('SET', KEYS[4], #entries)
else
  redis.call('SET', KEYS[4], 0)
end
return out
"""


class RedisStorage:
    """A ``Storage`` for ``RolloutBuffer`` on a Redis stream; see the module docstring.

    ``retry_seconds``: how long a call keeps retrying while Redis is unreachable (a restart).
    """

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, name: str = "rlsync", retry_seconds: float = 30.0, client: Any = None) -> None:
        import redis

        self._redis = client if client is not None else redis.Redis.from_url(url, socket_timeout=10)
        self._errors = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
        self._keys = {k: f"{name}:{k}" for k in ("ids", "stream", "state", "cursor", "batch", "held")}
        self._append = self._redis.register_script(_APPEND)
        self._take = self._redis.register_script(_TAKE)
        self.retry_seconds = retry_seconds

    def _retry(self, call: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.retry_seconds
        while True:
            try:
                return call()
            except self._errors as exc:
                if time.monotonic() > deadline:
                    raise BufferError(f"Redis unreachable for {self.retry_seconds} s: {exc}. Is redis-server running?") from exc
                time.sleep(0.05)

    def append(self, samples: Sequence[Sample]) -> None:
        args: list[Any] = []
        for s in samples:
            args += [s.sample_id, encode_sample(s)]
        self._retry(lambda: self._append(keys=[self._keys["ids"], self._keys["stream"]], args=args))

    def take(self, count: int) -> list[Sample]:
        request = uuid.uuid4().hex
        k = self._keys
        payloads = self._retry(lambda: self._take(keys=[k["stream"], k["cursor"], k["batch"], k["held"]], args=[count, request]))
        return [decode_sample(p) for p in payloads]

    def __len__(self) -> int:
        def waiting() -> int:
            pipe = self._redis.pipeline()
            pipe.xlen(self._keys["stream"])
            pipe.get(self._keys["held"])
            total, held = pipe.execute()
            return int(total) - int(held or 0)  # minus the last batch, handed out but not yet trimmed

        return self._retry(waiting)

    def load_state(self) -> dict[str, Any]:
        raw = self._retry(lambda: self._redis.hgetall(self._keys["state"]))
        return {k.decode(): int(v) for k, v in raw.items()}

    def save_state(self, state: dict[str, Any]) -> None:
        self._retry(lambda: self._redis.hset(self._keys["state"], mapping={k: int(v) for k, v in state.items()}))

    def close(self) -> None:
        self._redis.close()
