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
(never pickle), and signed by the run (``_redis_trust``): one it did not sign is refused before it is decoded,
counted (``foreign``) and removed, and the honest ones behind it are taken.

Episodes (``RedisEpisodes``, the ``rlsync.EpisodeLog`` of processes on any host): each a hash (prompt, epoch,
done) and a list of recorded steps; claimable ones in a sorted set scored by the order they were added (new)
or by their lease's deadline in Redis time (claimed); a claim by id takes the episode whose lease is free or ran
out. ``finish`` marks the episode done and adds its sample to the samples of the ``RedisStorage`` of the same
``name``, in one script: exactly once; finished without a sample, its hash and steps expire after ``kept_seconds``
(until then a claim by id replays them). Prompts and steps are signed too: a claim refuses an episode whose prompt this
run did not sign (removed, and the next one claimed) and replays the steps only up to the first it did not sign
(the rest are cut, and the generator records from there).
"""

from __future__ import annotations

import logging
import re
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar, cast

import msgspec

from rlsync import Claim, ConfigError, LeaseLostError, RolloutBufferError, Sample, decode_sample, encode_sample
from rlsync.plugins._redis_trust import EntrySigner

_log = logging.getLogger("rlsync")
T = TypeVar("T")

_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
# queues a sample id never seen, oldest version first then first in (the order's score kept for leases that run out)
_QUEUE = """
local function queue(ids, waiting, order, seq, id, version)
  if redis.call('SADD', ids, id) == 0 then return false end
  local score = string.format('%.0f', (tonumber(version) + 1) * 4294967296 + redis.call('INCR', seq))
  redis.call('ZADD', waiting, score, id)
  redis.call('HSET', order, id, score)
  return true
end
"""

# KEYS: ids (every id ever added), queue, payload, order, seq. ARGV: id, oldest version, ... The payloads were set
# by HSET in the same MULTI, outside Lua (large samples, MoE routes: copying them through Lua strings cost 2.5x);
# an id seen before keeps the payload it had, and one acknowledged already (no order) gets none back.
_APPEND = _QUEUE + """
local added = 0
for i = 1, #ARGV, 2 do
  if queue(KEYS[1], KEYS[2], KEYS[4], KEYS[5], ARGV[i], ARGV[i + 1]) then
    added = added + 1
  elseif redis.call('HEXISTS', KEYS[4], ARGV[i]) == 0 then
    redis.call('HDEL', KEYS[3], ARGV[i])
  end
end
return added
"""

# KEYS: queue, leased, payload, order, this request's record. ARGV: count, lease ms, held ids... Returns the ids
# leased (a retry: the first attempt's; the record's first entry is an empty marker); the payloads are read after.
_TAKE = _NOW + """
local done = redis.call('LRANGE', KEYS[5], 0, -1)
if redis.call('EXISTS', KEYS[5]) == 1 then return done end  -- a retry: the same samples
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
return ids
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

_NEW_BELOW: Final = 2**40  # episode scores: below, the order new ones were added; above, a lease's deadline (ms)

# KEYS: the episode's hash, claimable set, unfinished count, seq. ARGV: id, prompt
_EP_ADD = """
if redis.call('HSETNX', KEYS[1], 'prompt', ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'epoch', 0, 'done', 0)
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), ARGV[1])
redis.call('INCR', KEYS[3])
return 1
"""

# KEYS: claimable set. ARGV: key prefix of episodes, lease ms, owner, new-below
_EP_CLAIM = _NOW + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[4], now, 'LIMIT', 0, 1)  -- a lease that ran out: resume it first
if #ids == 0 then ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[4], 'LIMIT', 0, 1) end
if #ids == 0 then return false end
local id = ids[1]
local key = ARGV[1] .. id
local epoch = redis.call('HINCRBY', key, 'epoch', 1)
redis.call('HSET', key, 'owner', ARGV[3])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
return {id, epoch, redis.call('HGET', key, 'prompt'), redis.call('LRANGE', key .. ':steps', 0, -1)}
"""

# KEYS: the episode's hash, its steps, claimable set. ARGV: id, lease ms, owner, new-below
_EP_CLAIM_ID = _NOW + """
local e = redis.call('HMGET', KEYS[1], 'epoch', 'done', 'prompt')
if not e[1] then return false end
if e[2] == '1' then return {ARGV[1], e[1], e[3], redis.call('LRANGE', KEYS[2], 0, -1), 1} end
local score = redis.call('ZSCORE', KEYS[3], ARGV[1])
if score and tonumber(score) >= tonumber(ARGV[4]) and tonumber(score) > now then return false end  -- leased
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'owner', ARGV[3])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[2]), ARGV[1])
return {ARGV[1], epoch, e[3], redis.call('LRANGE', KEYS[2], 0, -1), 0}
"""

# KEYS: the episode's hash, its steps, claimable set. ARGV: id, epoch, step (-1: renew only), entry, lease ms
_EP_RECORD = _NOW + """
local e = redis.call('HMGET', KEYS[1], 'epoch', 'done')
if not e[1] then return -3 end
if e[2] == '1' or tonumber(e[1]) ~= tonumber(ARGV[2]) then return -1 end
local step = tonumber(ARGV[3])
if step >= 0 then
  local n = redis.call('LLEN', KEYS[2])
  if step == n then redis.call('RPUSH', KEYS[2], ARGV[4])
  elseif step > n or redis.call('LINDEX', KEYS[2], step) ~= ARGV[4] then return -2 end
end
redis.call('ZADD', KEYS[3], 'XX', now + tonumber(ARGV[5]), ARGV[1])
return 1
"""

# KEYS: the episode's hash, its steps, claimable set, unfinished count, then the samples' ids, queue, payload, order,
# seq. ARGV: id, epoch, oldest version, payload (empty: no sample; the steps are kept), seconds they are kept
_EP_FINISH = _QUEUE + """
local e = redis.call('HMGET', KEYS[1], 'epoch', 'done')
if not e[1] then return -3 end
if e[2] == '1' then return 0 end
if tonumber(e[1]) ~= tonumber(ARGV[2]) then return -1 end
redis.call('HSET', KEYS[1], 'done', 1)
if ARGV[4] == '' then
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  redis.call('EXPIRE', KEYS[2], ARGV[5])
else
  redis.call('DEL', KEYS[2])
end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DECR', KEYS[4])
if ARGV[4] ~= '' and queue(KEYS[5], KEYS[6], KEYS[8], KEYS[9], ARGV[1], ARGV[3]) then
  redis.call('HSET', KEYS[7], ARGV[1], ARGV[4])
end
return 1
"""


# KEYS: the episode's hash, its steps, claimable set. ARGV: id, the prompt found. A foreign episode goes, if unchanged
_EP_DROP_FOREIGN = """
if redis.call('HGET', KEYS[1], 'prompt') ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""

# KEYS: the episode's hash, its steps. ARGV: epoch, steps kept. The steps after the first foreign one go
_EP_TRIM = """
if tonumber(redis.call('HGET', KEYS[1], 'epoch')) ~= tonumber(ARGV[1]) then return 0 end
if tonumber(ARGV[2]) == 0 then redis.call('DEL', KEYS[2]) else redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[2]) - 1) end
return 1
"""

_STATE = msgspec.msgpack.Decoder(dict[str, int])  # the buffer's counters


_FOREIGN_CLAIMS = 64  # foreign episodes one claim removes before it gives up for now


def _count(value: Any, signer: EntrySigner, key: str) -> int:
    """A counter read from Redis (the Lua scripts' INCR and DECR keep them, unsigned): one that is not a whole number
    of at least 0 is someone else's, refused as 0."""
    text = (value.decode(errors="replace") if isinstance(value, bytes) else str(value)) if value is not None else "0"
    if not text.isdigit():
        signer.refused(f"{key}: {text[:40]!r} is not a count")
        return 0
    return int(text)


def _shown(url: str) -> str:
    """A Redis URL as errors and logs show it: without its password."""
    return re.sub(r"//[^/@]*@", "//<credentials>@", url)


def _retrying(errors: tuple[type[BaseException], ...], seconds: float, call: Callable[[], T], url: str) -> T:
    """``call()``, retried while Redis is unreachable (a restart), for up to ``seconds``; the first failure is logged
    at once, so that a wrong URL is not a silent wait."""
    deadline = time.monotonic() + seconds
    warned = False
    while True:
        try:
            return call()
        except errors as exc:
            if time.monotonic() > deadline:
                raise RolloutBufferError(f"no Redis answered at {_shown(url)} for {seconds:g} s ({exc}): start "
                                         f"redis-server there, or pass the right url= (retry_seconds= sets the wait)") from exc
            if not warned:
                _log.warning("Redis at %s does not answer (%s): retrying for up to %g s (retry_seconds)", _shown(url), exc,
                             seconds)
                warned = True
            time.sleep(0.05)


def _redis_module() -> Any:
    """redis-py, or a one-line error naming the extra that installs it."""
    try:
        import redis
    except ModuleNotFoundError as exc:
        if exc.name != "redis":
            raise
        raise ConfigError("the Redis buffer needs redis-py: pip install 'rlsync[redis]' (and a redis-server to talk to)") from None
    return redis


def _client(redis: Any, url: str) -> Any:
    """redis-py's client of ``url``; a URL it cannot take is one line naming the form (not redis-py's traceback), the
    URL shown without its password."""
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        shown = _shown(url) if isinstance(url, str) else url
        raise ConfigError(f"url={shown!r} is not a Redis URL (redis://, rediss:// or unix://); for example "
                          "redis://HOST:6379/0")
    try:
        return redis.Redis.from_url(url, socket_timeout=10)
    except ValueError as exc:
        raise ConfigError(f"url={_shown(url)!r}: {exc}; for example redis://HOST:6379/0") from None


class RedisStorage:
    """A ``Storage`` for ``RolloutBuffer`` in Redis; see the module docstring.

    ``retry_seconds``: how long a call keeps retrying while Redis is unreachable (a restart).
    ``lease_seconds``: how long samples taken by a client that stops renewing (it died) stay with it.
    ``key``: what the run's entries are signed with (default: ``rlsync.core.user_key()``; every process of the run
    must hold the same). ``foreign``: entries refused because this run did not sign them.
    """

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, name: str = "rlsync", retry_seconds: float = 30.0,
                 lease_seconds: float = 600.0, client: Any = None, key: bytes | None = None) -> None:
        redis = _redis_module()
        self._signer = EntrySigner(name, key)
        self._redis = client if client is not None else _client(redis, url)
        self._url = url
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
        return _retrying(self._errors, self.retry_seconds, call, self._url)

    def append(self, samples: Sequence[Sample]) -> None:
        if not samples:
            return
        args: list[str | int] = []
        for s in samples:
            args += [s.sample_id, s.oldest_version]
        payloads: dict[Any, Any] = {s.sample_id: self._signer.sign(encode_sample(s), "sample", s.sample_id)
                                    for s in samples}  # redis-py's own key types
        k = self._keys

        def append() -> None:
            # one round trip, not a MULTI: the payloads (native HSET, one command each), then the script that queues
            # the new ids, in that order on this connection. Redis executes a MULTI's commands only at EXEC and then
            # writes all their bytes to the AOF at once; pipelined, it executes each as it arrives while the rest
            # are still on the way: 64 routed samples (12 MB) in 22 ms instead of 44. A client killed between its
            # HSETs and the script leaves payloads no id points to (bytes, not samples: those were never queued;
            # its retry queues them).
            pipe = self._redis.pipeline(transaction=False)
            for sid, payload in payloads.items():
                pipe.hset(k["payload"], sid, payload)
            self._append(keys=[k["ids"], k["queue"], k["payload"], k["order"], k["seq"]], args=args, client=pipe)
            pipe.execute()

        self._retry(append)

    def take(self, count: int) -> list[Sample]:
        record = f"{self._name}:take:{uuid.uuid4().hex}"
        k = self._keys
        args: list[str | int] = [count, int(self.lease_seconds * 1000), *sorted(self._held)]
        ids = [i for i in self._retry(lambda: self._take(keys=[k["queue"], k["leased"], k["payload"], k["order"], record],
                                                          args=args)) if i]
        # read after the script (they are leased to this client: nobody acknowledges them meanwhile)
        payloads = self._retry(lambda: self._redis.hmget(k["payload"], ids)) if ids else []
        samples, foreign = [], []
        for sid, entry in zip(ids, payloads):
            if entry is None:
                continue
            name = sid.decode() if isinstance(sid, bytes) else str(sid)
            payload = self._signer.open(cast(bytes, entry), "sample", name)
            if payload is None:  # not this run's: removed, never decoded; the honest samples behind it come next
                foreign.append(name)
            else:
                samples.append(decode_sample(payload))
        if foreign:
            self._retry(lambda: self._ack(keys=[k["queue"], k["leased"], k["payload"], k["order"]], args=foreign))
        self._held.update(s.sample_id for s in samples)
        return samples

    @property
    def foreign(self) -> int:
        """Entries refused (and removed) because this run did not sign them."""
        return self._signer.foreign

    def ack(self, sample_ids: Sequence[str]) -> None:
        k = self._keys
        ids = list(sample_ids)
        self._retry(lambda: self._ack(keys=[k["queue"], k["leased"], k["payload"], k["order"]], args=ids))
        self._held.difference_update(ids)

    def __len__(self) -> int:
        return int(self._retry(lambda: self._redis.zcard(self._keys["queue"])))

    def load_state(self) -> dict[str, Any]:
        """The counters ``save_state`` kept, if this run signed them (else none: a fresh buffer's)."""
        entry = self._retry(lambda: self._redis.get(self._keys["state"] + ":signed"))
        if entry is None:
            return {}
        payload = self._signer.open(bytes(entry), "state")
        return {} if payload is None else dict(_STATE.decode(payload))

    def save_state(self, state: dict[str, Any]) -> None:
        payload = msgspec.msgpack.encode({str(k): int(v) for k, v in state.items()})
        self._retry(lambda: self._redis.set(self._keys["state"] + ":signed", self._signer.sign(payload, "state")))

    def close(self) -> None:
        self._redis.close()


def _kept_seconds_of(url: str, kept_seconds: float) -> tuple[str, float]:
    """``redis://HOST:6379/0?kept_seconds=172800``: the episodes' kept time read from their URL, so that every
    framework's one episodes option (verl's config key, TRL's ``episodes=``) sets it too; the URL without it."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    given = [value for key, value in query if key == "kept_seconds"]
    if given:
        try:
            kept_seconds = float(given[-1])
        except ValueError:
            kept_seconds = -1.0
        if not 0 < kept_seconds < float("inf"):
            raise ConfigError(f"kept_seconds={given[-1]!r} in {_shown(url)}: the seconds a finished episode keeps its "
                              f"steps for a replay, above 0 (e.g. ?kept_seconds=172800 for two days)")
        rest = urllib.parse.urlencode([(key, value) for key, value in query if key != "kept_seconds"])
        url = urllib.parse.urlunsplit(parts._replace(query=rest))
    return url, kept_seconds


class RedisEpisodes:
    """The ``rlsync.EpisodeLog`` in Redis: episodes recorded by generator processes on any host survive their
    death and Redis's (with ``appendonly yes``); finished ones go to the ``RedisStorage`` of the same ``name``."""

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, name: str = "rlsync", retry_seconds: float = 30.0,
                 client: Any = None, kept_seconds: float = 24 * 3600.0, key: bytes | None = None) -> None:
        redis = _redis_module()
        self._signer = EntrySigner(name, key)  # the samples' too: a finished episode's goes to RedisStorage(name)
        url, kept_seconds = _kept_seconds_of(url, kept_seconds)
        self.kept_seconds = kept_seconds  # an episode finished without a sample keeps its steps this long (a replay)
        self._redis = client if client is not None else _client(redis, url)
        self._url = url
        self._errors = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
        self._redis_errors = redis
        self._name = name
        self._prefix = f"{name}:ep:"
        self._keys = {k: f"{name}:{k}" for k in ("ids", "queue", "payload", "order", "seq", "ep-claimable", "ep-unfinished",
                                                 "ep-seq")}
        self._scripts = {n: self._redis.register_script(code) for n, code in
                         (("add", _EP_ADD), ("claim", _EP_CLAIM), ("claim-id", _EP_CLAIM_ID), ("record", _EP_RECORD),
                          ("finish", _EP_FINISH), ("drop-foreign", _EP_DROP_FOREIGN), ("trim", _EP_TRIM))}
        self.retry_seconds = retry_seconds
        self._setting: str | None = None  # the framework option that gave the URL (from_option), for its errors

    @classmethod
    def from_option(cls, url: str, *, name: str, option: str) -> RedisEpisodes:
        """The log a framework's episodes option gives (verl's config key, TRL's ``episodes=``, OpenRLHF's launcher
        flag), checked where the option is read: a URL redis-py cannot read, a bad ``?kept_seconds`` or the missing
        extra is a ``ConfigError`` that starts with ``option``, the setting as the user writes it with ``{url}`` where
        the value goes (shown without its credentials). Nothing is sent yet (redis-py connects at its first command)."""
        setting = option.format(url=repr(_shown(url)))
        try:
            log = cls(url, name=name)
        except ValueError as exc:  # redis-py's word for a URL it cannot read
            raise ConfigError(f"{setting}: {exc}; for example redis://HOST:6379/0") from None
        except ConfigError as exc:
            raise ConfigError(f"{setting}: {exc}") from None
        log._setting = setting
        return log

    def run_name(self, *, fresh: bool) -> str:
        """The name one run's episodes go under: this log's name (a trainer's output folder, as the adapters name it)
        and a generation. A fresh run (not resumed from a checkpoint) starts the next generation, so that it never
        replays what an earlier run in the same folder recorded; a resumed run goes on in the newest one (a name no
        run started this way yet: the name alone, as earlier versions of rlsync recorded it). Open the run's log
        with the name returned."""
        key = f"{self._name}:generation"
        command: Callable[[], Any] = (lambda: self._redis.incr(key)) if fresh else (lambda: self._redis.get(key))
        try:
            try:
                generation = _count(_retrying(self._errors, self.retry_seconds, command, self._url), self._signer, key)
            except self._redis_errors.ResponseError:  # INCR of a value that is not a count: someone else's
                self._signer.refused(f"{key}: not a count")
                generation = 1
                _retrying(self._errors, self.retry_seconds, lambda: self._redis.set(key, generation), self._url)
        except RolloutBufferError as exc:
            if self._setting is None:
                raise
            raise ConfigError(f"{self._setting}: no Redis answered at {_shown(self._url)} for {self.retry_seconds:g} s: "
                              f"start redis-server there, or point the option at one that runs") from exc
        return self._name if generation == 0 else f"{self._name}#{generation}"

    def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        return _retrying(self._errors, self.retry_seconds, lambda: self._scripts[script](keys=keys, args=args), self._url)

    def add(self, episode_id: str, prompt: bytes) -> bool:
        k = self._keys
        return bool(self._run("add", [self._prefix + episode_id, k["ep-claimable"], k["ep-unfinished"], k["ep-seq"]],
                              [episode_id, self._signer.sign(bytes(prompt), "prompt", episode_id)]))

    def claim(self, owner: str, lease_seconds: float, episode_id: str | None = None) -> Claim | None:
        """A claim whose prompt and steps this run signed: a foreign episode is removed (the next is claimed; by id,
        None: add it again), and the steps end before the first foreign one (those after it are cut)."""
        lease = int(lease_seconds * 1000)
        for _ in range(_FOREIGN_CLAIMS):
            if episode_id is None:
                got = self._run("claim", [self._keys["ep-claimable"]], [self._prefix, lease, owner, _NEW_BELOW])
            else:
                key = self._prefix + episode_id
                got = self._run("claim-id", [key, key + ":steps", self._keys["ep-claimable"]],
                                [episode_id, lease, owner, _NEW_BELOW])
            if not got:
                return None
            found, epoch, prompt, steps, *done = got
            found = found.decode()
            key = self._prefix + found
            opened = self._signer.open(bytes(prompt), "prompt", found)
            if opened is None:  # an episode this run never added
                self._run("drop-foreign", [key, key + ":steps", self._keys["ep-claimable"]], [found, bytes(prompt)])
                if episode_id is not None:
                    return None
                continue
            kept = []
            for index, step in enumerate(steps):
                payload = self._signer.open(bytes(step), "step", found, str(index))
                if payload is None:  # a step this run never recorded: it and what follows are cut
                    if not (done and done[0]):
                        self._run("trim", [key, key + ":steps"], [epoch, index])
                    break
                kept.append(payload)
            return Claim(found, int(epoch), opened, kept, done=bool(done and done[0]))
        return None

    def record(self, episode_id: str, epoch: int, step: int, entry: bytes, lease_seconds: float) -> None:
        key = self._prefix + episode_id
        signed = self._signer.sign(bytes(entry), "step", episode_id, str(step)) if step >= 0 else bytes(entry)
        self._answer(episode_id, epoch, self._run("record", [key, key + ":steps", self._keys["ep-claimable"]],
                                                  [episode_id, epoch, step, signed, int(lease_seconds * 1000)]), step)

    def finish(self, episode_id: str, epoch: int, sample: Sample | None) -> bool:
        key, k = self._prefix + episode_id, self._keys
        keys = [key, key + ":steps", k["ep-claimable"], k["ep-unfinished"], k["ids"], k["queue"], k["payload"], k["order"], k["seq"]]
        if sample is None:
            args: list[Any] = [episode_id, epoch, 0, b"", max(1, int(self.kept_seconds))]
        else:
            sample.sample_id = episode_id
            args = [episode_id, epoch, sample.oldest_version, self._signer.sign(encode_sample(sample), "sample", episode_id), 0]
        answer = self._run("finish", keys, args)
        return self._answer(episode_id, epoch, answer, None)

    @staticmethod
    def _answer(episode_id: str, epoch: int, answer: int, step: int | None) -> bool:
        if answer == -1:
            raise LeaseLostError(f"episode {episode_id}: claimed again by another generator (or finished); this "
                                 f"generator's epoch {epoch} is void")
        if answer == -2:
            raise ValueError(f"episode {episode_id}: step {step} does not follow the steps recorded")
        if answer == -3:
            raise RolloutBufferError(f"no episode {episode_id!r} was added")
        return answer == 1

    @property
    def foreign(self) -> int:
        """Entries refused because this run did not sign them (episodes, steps)."""
        return self._signer.foreign

    def unfinished(self) -> int:
        return _count(_retrying(self._errors, self.retry_seconds, lambda: self._redis.get(self._keys["ep-unfinished"]),
                                self._url), self._signer, self._keys["ep-unfinished"])

    def close(self) -> None:
        self._redis.close()
