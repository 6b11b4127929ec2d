"""``redis``: rollout samples in Redis, so they survive a crash of the buffer's process, of a client
that held some, or of Redis itself (run Redis with ``appendonly yes`` and ``appendfsync always``).

Order: oldest policy version first, then first in, first out (as the memory backend): waiting samples
sit in a sorted set scored ``(oldest version + 1) * 2**32 + arrival number``.

Delivery: ``take`` leases samples to this client until ``lease_seconds`` from now; ``ack`` (the buffer
calls it when a batch goes to the trainer) removes them for good. A client that dies holding samples (an
incomplete group, a batch not yet handed out) lets its leases run out, and the next ``take`` by anyone
puts those samples back in the queue: at least once. A live client renews the leases of what it holds
at every ``take``. ``append`` adds a sample only if its id was never seen; a ``take`` retried after a
lost reply (Redis killed and restarted) returns what the first attempt leased (it is keyed by its
request id); ``ack`` is idempotent. All three are Lua scripts, atomic in Redis. Samples are msgpack
(never pickle).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from rlsync import RolloutBufferError, Sample, decode_sample, encode_sample

T = TypeVar("T")

# KEYS: ids (every id ever added), queue, payload, order, seq. ARGV: id, oldest version, payload, ...
_APPEND = """
local added = 0
for i = 1, #ARGV, 3 do
  if redis.call('SADD', KEYS[1], ARGV[i]) == 1 then
    local seq = redis.call('INCR', KEYS[5])
    local score = string.format('%.0f', (tonumber(ARGV[i + 1]) + 1) * 4294967296 + seq)
    redis.call('ZADD', KEYS[2], score, ARGV[i])
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 2])
    redis.call('HSET', KEYS[4], ARGV[i], score)
    added = added + 1
  end
end
return added
"""

# KEYS: queue, leased, payload, order, this request's record. ARGV: count, lease ms, held ids...
_TAKE = """
local function payloads(ids)
  local out = {}
  for _, id in ipairs(ids) do
    local p = redis.call('HGET', KEYS[3], id)
    if p then table.insert(out, p) end
  end
  return out
end
local done = redis.call('LRANGE', KEYS[5], 0, -1)
if redis.call('EXISTS', KEYS[5]) == 1 then return payloads(done) end  -- a retry: the same samples
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deadline = now + tonumber(ARGV[2])
for i = 3, #ARGV do redis.call('ZADD', KEYS[2], 'XX', deadline, ARGV[i]) end  -- renew what this client holds
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do  -- leases that ran out come back
  redis.call('ZREM', KEYS[2], id)
  redis.call('ZADD', KEYS[1], redis.call('HGET', KEYS[4], id), id)
end
local ids = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZADD', KEYS[2], deadline, id)
end
redis.call('RPUSH', KEYS[5], '')  -- exists even when empty
if #ids > 0 then redis.call('RPUSH', KEYS[5], unpack(ids)) end
redis.call('EXPIRE', KEYS[5], 3600)
return payloads(ids)
"""

# KEYS: queue, leased, payload, order. ARGV: ids
_ACK = """
for _, id in ipairs(ARGV) do
  redis.call('ZREM', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('HDEL', KEYS[4], id)
end
return #ARGV
"""


class RedisStorage:
    """A ``Storage`` for ``RolloutBuffer`` in Redis; see the module docstring.

    ``retry_seconds``: how long a call keeps retrying while Redis is unreachable (a restart).
    ``lease_seconds``: how long samples taken by a client that stops renewing (it died) stay with it.
    """

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, name: str = "rlsync", retry_seconds: float = 30.0,
                 lease_seconds: float = 600.0, client: Any = None) -> None:
        import redis

        self._redis = client if client is not None else redis.Redis.from_url(url, socket_timeout=10)
        self._errors = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
        self._name = name
        self._keys = {k: f"{name}:{k}" for k in ("ids", "queue", "leased", "payload", "order", "seq", "state")}
        self._append = self._redis.register_script(_APPEND)
        self._take = self._redis.register_script(_TAKE)
        self._ack = self._redis.register_script(_ACK)
        self.retry_seconds = retry_seconds
        self.lease_seconds = lease_seconds
        self._held: set[str] = set()  # taken by this client, not yet acknowledged

    def _retry(self, call: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.retry_seconds
        while True:
            try:
                return call()
            except self._errors as exc:
                if time.monotonic() > deadline:
                    raise RolloutBufferError(f"Redis unreachable for {self.retry_seconds} s: {exc}. Is redis-server running?") from exc
                time.sleep(0.05)

    def append(self, samples: Sequence[Sample]) -> None:
        args: list[str | int | bytes] = []
        for s in samples:
            args += [s.sample_id, s.oldest_version, encode_sample(s)]
        k = self._keys
        self._retry(lambda: self._append(keys=[k["ids"], k["queue"], k["payload"], k["order"], k["seq"]], args=args))

    def take(self, count: int) -> list[Sample]:
        record = f"{self._name}:take:{uuid.uuid4().hex}"
        k = self._keys
        args: list[str | int] = [count, int(self.lease_seconds * 1000), *sorted(self._held)]
        payloads = self._retry(lambda: self._take(keys=[k["queue"], k["leased"], k["payload"], k["order"], record], args=args))
        samples = [decode_sample(p) for p in payloads]
        self._held.update(s.sample_id for s in samples)
        return samples

    def ack(self, sample_ids: Sequence[str]) -> None:
        k = self._keys
        ids = list(sample_ids)
        self._retry(lambda: self._ack(keys=[k["queue"], k["leased"], k["payload"], k["order"]], args=ids))
        self._held.difference_update(ids)

    def __len__(self) -> int:
        return int(self._retry(lambda: self._redis.zcard(self._keys["queue"])))

    def load_state(self) -> dict[str, Any]:
        raw = self._retry(lambda: self._redis.hgetall(self._keys["state"]))
        return {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}

    def save_state(self, state: dict[str, Any]) -> None:
        self._retry(lambda: self._redis.hset(self._keys["state"], mapping={k: int(v) for k, v in state.items()}))

    def close(self) -> None:
        self._redis.close()
