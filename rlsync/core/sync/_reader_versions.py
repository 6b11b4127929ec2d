"""A reader's version state: the parts of a version as writers finish them, its checks, and the flip that makes it live.

``VersionLanding`` is one part of ``WeightsReader`` (its other part, ``ReaderService``, runs the control socket): the
slots and what each writer's part of them holds, deltas from the inbox, checksums, the hand-off to the engine
(``on_version``), and, in place, the engine's pause, the saved last version and the undo."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Mapping

import torch

from rlsync.core.sync._checksum import Checksums, digest, for_memory
from rlsync.core.sync._control import Ack, Begin, Done, Go, Refuse
from rlsync.core.sync._delta import INBOX_SHARE
from rlsync.core.sync._delta import apply as apply_delta
from rlsync.core.sync._device_order import synchronize_devices
from rlsync.core._errors import CanaryError
from rlsync.core.sync._regions import ALIGN, as_tensor
from rlsync.core.sync._reader_state import ReaderState
from rlsync.core.sync._transport import Landing, Region

MAX_VERSION = 2**53  # versions are step counts: a claim past this is no step (and no float64 holds it exactly)
_log = logging.getLogger("rlsync")


class VersionLanding(ReaderState):
    def _open_inbox(self) -> Landing:
        """The inbox for delta writers: each writer a part of ``INBOX_SHARE`` times its bytes for this rank."""
        if self._inbox is None:
            at = 0
            for writer in sorted(self._expected):
                nbytes = sum(n for _, runs in self._pair_runs.get((writer, self.rank), []) for _, _, n in runs)
                capacity = -(-int(nbytes * INBOX_SHARE) // ALIGN) * ALIGN
                self._inbox_parts[writer] = (at, capacity)
                at += capacity
            self._inbox = self._transport.landing(max(at, ALIGN), 1, self._transport_options)
        return self._inbox

    def _discard_partners(self, restarted: int, epoch: int) -> None:
        """Writer rank ``restarted`` came back with a new session (its old one died, maybe mid-version). Parts of
        the unfinished version sent by sessions as old as the dead one may pair with bytes it never finished, so
        they are discarded and their senders told to send again; parts from sessions that started after an
        earlier restart (the rest of a restarting trainer) are kept. The slot is not live and the next version
        overwrites it."""
        stale = {r: d for r, d in self._done.items() if r != restarted and self._sessions[r][1] <= epoch}
        if not stale:
            return
        version = self._pending_version
        self._done = {r: d for r, d in self._done.items() if r not in stale}
        self.discarded.append(-1 if version is None else version)
        reason = (f"reader rank {self.rank} discarded the parts of unfinished version {version} from writer ranks "
                  f"{sorted(stale)}: writer rank {restarted} restarted before the version completed; complete it "
                  f"again from every writer rank")
        for writer, (ident, _) in stale.items():
            self._channel.send(Refuse(reason, "restart"), ident)
            self._active.pop(writer, None)  # its session sends the version again, or ends: neither loses this one

    def _finish_part(self, identity: bytes, msg: Done) -> None:
        started = time.perf_counter()
        if self.plan is None or msg.writer_rank not in self._sessions:
            self._channel.send(Refuse("send a Hello before Done"), identity)
            return
        refused = self._refused_version(msg.version)
        if refused is not None:
            self._channel.send(Refuse(refused, "version"), identity)
            return
        if msg.slot != self._target_slot:
            self._channel.send(Refuse(f"wrote slot {msg.slot}, expected {self._target_slot}; reconnect", "version"), identity)
            return
        held = self._held.get(msg.writer_rank, {}).pop(msg.slot, None)  # from here its part holds the new bytes
        if msg.delta_base is not None:
            error = self._land_delta(msg, held)
            if error is not None:
                self._channel.send(Refuse(error, "delta"), identity)
                return
        if self.landing_mode == "in_place" and self._paused_at is None:
            self._channel.send(Refuse(f"in-place reader rank {self.rank}: version {msg.version} was written without a "
                                      f"Begin, or after it was undone; send it again", "load"), identity)
            return
        self._now_landing(msg.version)
        self._done[msg.writer_rank] = (identity, msg)
        if not self._expected <= self._done.keys():
            return
        done, self._done = self._done, {}
        self._pending_version = None
        error = self._verify(done) if self._checksum else None
        kind = "checksum" if error is not None else "load"
        if error is not None and self._on_refused is not None:
            self._on_refused(msg.version, error)
        self.landed_canary = next((d.canary for _, d in done.values() if d.canary is not None), None)
        sums = {w: d.checksums for w, (_, d) in done.items() if d.checksums is not None}
        self.landed_digest = digest(sums) if error is None and self._checksum and len(sums) == len(done) else None
        self.canary_deviation = None
        if error is None and self._on_version is not None:
            try:
                self._on_version(msg.version, self.buffers(self._target_slot))
            except CanaryError as exc:  # the engine computes with other weights than were sent: refused, named
                error, kind = str(exc), "canary"
            except Exception as exc:  # noqa: BLE001 - reported to every writer, version stays out
                error = f"the engine failed to load version {msg.version}: {exc!r}"
        self.landed_canary = None
        if error is not None:
            if self.landing_mode == "in_place":
                self._undo(error, msg.version)
            for ident, _ in done.values():
                self._channel.send(Refuse(error, kind), ident)
            return
        for writer in done:
            self._held.setdefault(writer, {})[self._target_slot] = msg.version
        with self._cond:
            if self.landing_mode == "direct":
                self._live_slot, self._target_slot = self._target_slot, self._live_slot
            self._version = msg.version
            self.digest = self.landed_digest
            self._cond.notify_all()
        self._resume()  # in place: the engine serves the new version
        for writer, (ident, _) in done.items():
            part = digest({writer: sums[writer]}) if writer in sums else None
            self._channel.send(Ack(msg.version, self._target_slot, self.canary_deviation, part), ident)
        self.last_commit_seconds = time.perf_counter() - started
        if self.landing_mode == "in_place":
            self._save()  # the new last version, copied while the engine serves it; the next Begin waits for it
        stats: dict[str, object] = {"rank": self.rank, "writers": sorted(done)}
        if self.canary_deviation is not None:
            stats["canary_deviation"] = self.canary_deviation
        self._plugins.hook.rlsync_weights_applied(version=msg.version, stats=stats)

    def _refused_version(self, version: int) -> str | None:
        """Why a writer may not claim ``version``: it must be newer than the live one (a restarted trainer resumes
        at its own step, which is), and below ``MAX_VERSION`` (a step count, not any 64-bit number)."""
        if version <= self._version:
            return f"version {version} is not newer than live version {self._version}"
        if version >= MAX_VERSION:
            return f"version {version} is not a step count (at most {MAX_VERSION - 1}): refused"
        return None

    def _land_delta(self, msg: Done, held: int | None) -> str | None:
        """Write a writer's delta from its inbox part into the target slot; what went wrong, if anything."""
        offset, capacity = self._inbox_parts.get(msg.writer_rank, (0, 0))
        if self._inbox is None or msg.delta_nbytes > capacity:
            return f"reader rank {self.rank} has no inbox of {msg.delta_nbytes} bytes for writer rank {msg.writer_rank}: send in full"
        assert self._landing is not None
        started = time.perf_counter()
        try:
            return self._copy_and_apply(msg, held, offset)
        finally:
            self.delta_seconds += time.perf_counter() - started

    def _copy_and_apply(self, msg: Done, held: int | None, offset: int) -> str | None:
        assert self._landing is not None and self._inbox is not None
        if held != msg.delta_base:  # one step from the live slot: copy this writer's part of it here first, locally
            source = next((slot for slot, version in self._held.get(msg.writer_rank, {}).items()
                           if version == msg.delta_base and slot != msg.slot), None)
            if source is None:
                return (f"writer rank {msg.writer_rank} sent a delta against version {msg.delta_base}, but reader rank "
                        f"{self.rank} holds its part of that version in no slot (slot {msg.slot}: "
                        f"{'unknown bytes' if held is None else f'version {held}'}): send in full")
            into, out_of = as_tensor(self._landing.regions[msg.slot]), as_tensor(self._landing.regions[source])
            for _, runs in self._pair_runs.get((msg.writer_rank, self.rank), []):
                for _, at, nbytes in runs:
                    into[at : at + nbytes].copy_(out_of[at : at + nbytes])
        try:
            apply_delta(as_tensor(self._inbox.regions[0][offset : offset + msg.delta_nbytes]), as_tensor(self._landing.regions[msg.slot]))
        except ValueError as exc:
            return f"reader rank {self.rank}: a bad delta from writer rank {msg.writer_rank} ({exc}): send in full"
        return None

    def _verify(self, done: Mapping[int, tuple[bytes, Done]]) -> str | None:
        """Each writer's per-buffer CRC-32 against the bytes that landed; the first mismatch, named."""
        assert self.plan is not None and self._landing is not None
        for writer, (_, msg) in done.items():
            got = Checksums(for_memory(self._landing.memory))  # per source buffer, over its runs in plan order, as the writer
            for buffer, runs in self._pair_runs.get((writer, self.rank), []):
                got.add(buffer, (self._landed(self._target_slot, d, n) for _, d, n in runs))
            for buffer, value in got.values.items():
                sent = None if msg.checksums is None else msg.checksums.get(buffer)
                if sent != value:
                    tensor = self._tensors_of.get((writer, buffer), buffer)
                    return (f"checksum mismatch in tensor {tensor!r} (from writer rank {writer}) for version {msg.version}: "
                            f"what landed differs from what was sent; version refused, the previous one stays live")
        return None

    def _landed(self, slot: int, offset: int, nbytes: int) -> Region:
        """``nbytes`` that landed at ``offset`` of ``slot`` (in place: inside the buffer that offset falls in)."""
        assert self._landing is not None
        if self.landing_mode != "in_place":
            return self._landing.regions[slot][offset : offset + nbytes]
        index = bisect.bisect_right(self._starts, offset) - 1
        at = offset - self._starts[index]
        return self._targets[self._order[index]][at : at + nbytes]

    def _now_landing(self, version: int) -> None:
        """``version`` is the one landing now: parts of another that never completed are dropped."""
        if self._pending_version != version:
            self._pending_version = version
            self._done = {r: d for r, d in self._done.items() if d[1].version == version}

    def _begin(self, identity: bytes, msg: Begin) -> None:
        """A writer is about to write ``msg.version`` into the engine's tensors: pause the engine, then say go. To a
        reader that lands off to the side, a Begin asks whether it would take ``msg.version`` and says the version is
        under way: a writer whose connection closes before its Done then gives it up at once (every writer asks
        before its first byte; a node relay asks again after writing every reader's bytes of its host and before
        telling any: one that died or would refuse is found while every rank still serves the previous version)."""
        if msg.writer_rank not in self._sessions:
            self._channel.send(Refuse("a Begin before a Hello"), identity)
            return
        refused = self._refused_version(msg.version)
        if refused is not None:
            self._channel.send(Refuse(refused, "version"), identity)
            return
        if self.landing_mode != "in_place":
            self._now_landing(msg.version)
            self._channel.send(Go(msg.version), identity)
            return
        if self._paused_at is None:
            self._mirror.wait()  # the last version is saved before a byte of the next lands
            self._pause(True)
            synchronize_devices(self._targets.values())  # what the engine queued on its device reads the old bytes first
            self._paused_at = time.monotonic()
            self._now_landing(msg.version)
        self._channel.send(Go(msg.version), identity)

    def _lost_part(self, reason: str) -> None:
        """Give up the version landing now (a writer's part will not come): in place, the engine gets its last version
        back; the writers that finished their part hear why, and so does the engine (``on_lost``)."""
        version = self._pending_version
        assert version is not None
        finished = [identity for identity, _ in self._done.values()]
        for writer in self._done:
            self._active.pop(writer, None)  # told to send again below: its session ending loses nothing more
        if self._paused_at is not None:
            self._undo(reason, version)
        else:
            _log.warning("reader rank %d: %s", self.rank, reason)
            self._done = {}
            self._pending_version = None
            self.discarded.append(version)
        for identity in finished:
            self._channel.send(Refuse(reason, "restart"), identity)
        if self._on_lost is not None:
            self._on_lost(version, reason)

    def _save(self) -> None:
        self._mirror.stage_all({name: self._targets[name] for name in self._order})  # one batched copy a version

    def _undo(self, reason: str, version: int | None = None) -> None:
        """Put the engine's last version back into its tensors and resume it: the version landing now is void."""
        version = self._pending_version if version is None else version
        _log.warning("in-place reader rank %d: %s; version %d restored", self.rank, reason, self._version)
        self._mirror.wait()
        saved = self._mirror.buffers
        with torch.no_grad():  # one batched copy back, however many tensors
            torch._foreach_copy_([self._targets[name] for name in self._order], [saved[name] for name in self._order])
        synchronize_devices(self._targets.values())  # restored before the engine's next forward, on whatever stream it runs
        self._done = {}
        self.discarded.append(-1 if version is None else version)
        self._pending_version = None
        self._resume()

    def _resume(self) -> None:
        if self._paused_at is not None:
            self._paused_at = None
            self._pause(False)
