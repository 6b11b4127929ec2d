"""A writer's versions: this rank's part of each, written to every reader at once (full, or a delta against what
the reader's slot holds), announced, and confirmed live.

``VersionPosting`` is one part of ``WeightsWriter`` (its other part, ``WriterSession``, opens and drops the sessions)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
import torch

from rlsync.core.sync._canary import Canary
from rlsync.core.sync._checksum import Checksums, digest
from rlsync.core.sync._control import Ack, Done, Refuse
from rlsync.core.sync._delta import encode as encode_delta
from rlsync.core.sync._device_order import ready_events, wait_ready
from rlsync.core._errors import (
    CanaryError,
    PeerLostError,
    TransferTimeoutError,
    TransportError,
    VersionError,
    WeightMismatchError,
)
from rlsync.core.sync._transport import Link, Run
from rlsync.core.timeline import recording
from rlsync.core.sync._writer_state import WriterState


class VersionPosting(WriterState):
    def complete(self, version: int, progress: Callable[[int], None] | None = None, *, canary: Canary | None = None) -> None:
        """Send this rank's part of ``version`` to every reader and return once it is live on each.

        ``canary`` (``rlsync.Canary.of(model)``, the weights being sent): every engine checks it before the version
        serves and refuses the version (``CanaryError`` here) when its own log-probs deviate; the largest deviation
        an engine reported is ``last_canary_deviation`` afterwards."""
        started = time.perf_counter()
        timeline = recording()
        began = timeline.now()
        sent, failed = self._write_parts(version, progress, canary, notify=True)
        self._confirm(version, progress, canary, sent, failed, started)
        timeline.event("sync", began, timeline.now(), version=version, bytes=self.last_bytes, rank=self.rank,
                       transport=self._transport.name)

    def _write_parts(self, version: int, progress: Callable[[int], None] | None, canary: Canary | None, *,
                     notify: bool) -> tuple[list[int], dict[int, str]]:
        """Write this rank's part of ``version`` to every reader (at once); with ``notify``, each reader's Done follows
        its bytes, else the Dones wait in ``_unsent`` for ``_notify`` (a relay that makes every reader of a host take
        its bytes before any reader hears of the version). The readers written to, and why the others failed."""
        if self._names_at[0] != self._epoch:  # what is put changed since the last version
            self._names_at = (self._epoch, sorted(self._sources), sorted(self._needed - self._sources.keys()))
        _, names, missing = self._names_at
        if missing:
            raise WeightMismatchError(f"writer rank {self.rank}: no tensor was put for {missing[:5]} (and {max(0, len(missing) - 5)} more)")
        self._plugins.hook.rlsync_before_export(version=version, names=list(names))
        self._ready = ready_events(self._streams.streams())
        self._streams.clear()
        wait_ready(self._ready)  # this thread's own reads of the sources (the delta's) after the streams that made them
        self.last_delta_seconds = 0.0
        if self._changes is not None:
            self._staging.wait()  # the delta reads every buffer first
            found = time.perf_counter()
            self._changes.record(version, self._sources | self._delta_sources)
            self.last_delta_seconds += time.perf_counter() - found
        self._sent = {}
        self.last_digests = {}
        failed: dict[int, str] = {}
        self._unsent = {}
        if len(self._runs) > 1:  # readers get their parts at once: publishing to N readers costs ~one reader
            with ThreadPoolExecutor(len(self._runs), thread_name_prefix=f"rlsync-writer-{self.rank}") as pool:
                outcomes = list(pool.map(lambda r: self._post(r, version, progress, canary, notify=notify), self._runs))
        else:
            outcomes = [self._post(r, version, progress, canary, notify=notify) for r in self._runs]
        self._staging.wait()
        sent = [r for r, error in zip(self._runs, outcomes) if error is None]
        failed.update({r: error for r, error in zip(self._runs, outcomes) if error is not None})
        return sent, failed

    def _notify(self) -> None:
        """Send the Dones ``_write_parts(notify=False)`` kept back."""
        unsent, self._unsent = self._unsent, {}
        for dst_rank, done in unsent.items():
            self._channels[dst_rank].send(done)

    def _confirm(self, version: int, progress: Callable[[int], None] | None, canary: Canary | None, sent: list[int],
                 failed: dict[int, str], started: float) -> None:
        """Wait for every notified reader's answer; raise unless ``version`` is live on all of them."""
        deviations: list[float] = []
        deadline = time.monotonic() + self.timeout
        for dst_rank in sent:
            channel = self._channels[dst_rank]
            try:
                got = channel.recv(timeout_ms=int(max(0.0, deadline - time.monotonic()) * 1000))
                if got is not None and isinstance(got[1], Refuse) and got[1].kind == "delta":  # it cannot take our delta
                    resent = self._post(dst_rank, version, progress, canary, full=True)
                    got = None if resent is not None else channel.recv(timeout_ms=int(max(0.0, deadline - time.monotonic()) * 1000))
            except TransportError as exc:  # an answer that is not one (BadFrame): this reader failed, the others go on
                failed[dst_rank] = str(exc)
                self._drop(dst_rank)
                continue
            if got is None:
                failed[dst_rank] = f"did not confirm version {version} within {self.timeout} s (it may have died)"
                self._drop(dst_rank)
                continue
            msg = got[1]
            if isinstance(msg, Ack) and msg.version == version:
                mine = self.last_digests.get(dst_rank)
                if msg.digest is not None and mine is not None and msg.digest != mine:
                    raise VersionError(f"reader rank {dst_rank} made version {version} live with digest {msg.digest}, but "
                                       f"this writer sent digest {mine}: the engine serves other bytes under that version")
                self._held[dst_rank][self._slots[dst_rank]] = version
                self._slots[dst_rank] = msg.next_slot
                if msg.canary_deviation is not None:
                    deviations.append(msg.canary_deviation)
            elif isinstance(msg, Refuse) and msg.kind == "canary":
                raise CanaryError(f"reader rank {dst_rank}: {msg.reason}")
            elif isinstance(msg, Refuse) and msg.kind in ("version", "restart"):
                raise VersionError(f"reader rank {dst_rank} refused version {version}: {msg.reason}")
            elif isinstance(msg, Refuse) and msg.kind == "checksum":
                raise WeightMismatchError(f"reader rank {dst_rank}: {msg.reason}")
            else:
                failed[dst_rank] = getattr(msg, "reason", f"unexpected answer {msg!r}")
        if failed:
            ok = [r for r in sent if r not in failed]
            detail = "; ".join(f"reader rank {r} ({self._readers[r]}): {why}" for r, why in sorted(failed.items()))
            error = TransferTimeoutError if all("did not confirm" in why for why in failed.values()) else PeerLostError
            raise error(f"version {version} is not live everywhere: {detail}. Live on reader ranks {ok}.")
        self.last_bytes = sum(self._sent.values())
        self.last_canary_deviation = max(deviations) if deviations else None
        stats: dict[str, Any] = {"bytes": self.last_bytes, "seconds": time.perf_counter() - started}
        if self.last_canary_deviation is not None:
            stats["canary_deviation"] = self.last_canary_deviation
        self._plugins.hook.rlsync_after_export(version=version, stats=stats)

    def _delta_for(self, dst_rank: int, slot: int) -> tuple[int, torch.Tensor] | None:
        """``(base version, encoded delta)`` of this rank's part of ``dst_rank``, if one fits. The base is the newest
        version the reader holds of this part, in whichever slot: when it is not ``slot`` (two slots, the live one
        the other), the reader first copies it into ``slot``, locally, so a delta carries one step, not two."""
        held = self._held[dst_rank]
        if self._changes is None or not held or dst_rank not in self._inboxes:
            return None
        base = max(held.values())
        groups = self._runs[dst_rank]
        changed = {name: self._changes.since(base, name) for name, _ in groups}
        flips = {name: self._changes.flips(base, name) for name, _ in groups}
        capacity = min(self._inboxes[dst_rank][2], self._part_bytes[dst_rank] - 1)  # smaller than a full send, or none
        started = time.perf_counter()
        payload = encode_delta(groups, changed, self._sources | self._delta_sources, self._itemsizes, capacity, flips,
                               self._transport.compress_deltas)
        self.last_delta_seconds += time.perf_counter() - started  # summed over readers (pool threads: an upper bound)
        return None if payload is None else (base, payload)

    def _post(self, dst_rank: int, version: int, progress: Callable[[int], None] | None, canary: Canary | None,
              full: bool = False, notify: bool = True) -> str | None:
        """Write this rank's part of ``version`` to one reader and notify it; the error, if any."""
        try:
            self._connect(dst_rank)
            link, slot = self._links[dst_rank], self._slots[dst_rank]
            delta = None if full else self._delta_for(dst_rank, slot)
            self._held[dst_rank].pop(slot, None)  # overwritten from here on
            placed = self._in_place.get(dst_rank)
            # in place the engine pauses; off to the side the reader learns the version is under way, so that this
            # rank dying before its Done gives the version up at once instead of at the engine's timeout
            refused = self._ask_to_begin(dst_rank, version)
            if refused is not None:
                return refused
            checksums = Checksums(self._algorithms[dst_rank]) if self._checksum else None
            wait_ready(self._ready)  # this thread's stream after the trainer's, on which the device sources were made
            into = placed if placed is not None else self._slotted(dst_rank, slot)  # each group's runs, as written
            if delta is None and checksums is None and not self._staging.staged:
                # what the loop below writes, prepared at the first version (in place too: its runs are placed once
                # per connection, and a new connection is a new link)
                link.write_prepared(self._prepared_for(dst_rank, slot, link, into))
                if progress is not None:
                    progress(self._part_bytes[dst_rank])
            else:
                self._write_groups(dst_rank, link, into, delta is None, checksums, progress)
            nbytes = 0 if delta is None else delta[1].numel()
            if delta is not None and nbytes:
                inbox, offset, _ = self._inboxes[dst_rank]
                staging = self._inbox_source(dst_rank, delta[1])
                inbox.write(self._link_source(staging), [(0, 0, offset, nbytes)])
                inbox.flush()
            link.flush()
            self._sent[dst_rank] = nbytes if delta is not None else self._part_bytes[dst_rank]
            if checksums is not None:
                self.last_digests[dst_rank] = digest({self.rank: checksums.values})
            done = Done(self.rank, version, slot, None if checksums is None else checksums.values,
                        delta_base=None if delta is None else delta[0], delta_nbytes=nbytes, canary=canary)
            if notify:
                self._channels[dst_rank].send(done)
            else:
                self._unsent[dst_rank] = done
        except TransportError as exc:
            self._drop(dst_rank)
            return str(exc)
        return None

    def _write_groups(self, dst_rank: int, link: Link, into: list[list[Any]], write: bool, checksums: Checksums | None,
                      progress: Callable[[int], None] | None) -> None:
        """Group by group (a source buffer's runs to this reader): written unless a delta goes instead, checksummed,
        counted; each after its own device-to-host copy, where ``put`` issued one."""
        for group, (name, runs) in enumerate(self._runs[dst_rank]):
            self._staging.wait(name)
            source = self._sources[name]
            if write:
                link.write(self._link_source(source), into[group])
            if checksums is not None:  # over the whole part: what the slot must hold, however it got there
                checksums.add(name, (source[s : s + n] for s, _, n in runs))
            if progress is not None:
                progress(sum(n for _, _, n in runs))

    def _prepared_for(self, dst_rank: int, slot: int, link: Link, into: list[list[Run]]) -> Any:
        """The link's prepared version of this rank's part for ``slot`` of ``dst_rank``: made at the first version,
        again only when a source was bound anew (``put``) or the link is another."""
        cached = self._prepared.get((dst_rank, slot))
        if cached is None or cached[0] != self._epoch or cached[1] is not link:
            parts = [(self._link_source(self._sources[name]), into[group]) for group, (name, _) in enumerate(self._runs[dst_rank])]
            cached = self._prepared[(dst_rank, slot)] = (self._epoch, link, link.prepare(parts))
        return cached[2]

    def _slotted(self, dst_rank: int, slot: int) -> list[list[Run]]:
        """``dst_rank``'s runs, group by group, as written into ``slot``: built once per slot, not per version (a
        model's 1600 tensors cost a millisecond a version to rebuild them)."""
        key = (dst_rank, slot)
        if key not in self._slot_runs:
            self._slot_runs[key] = [[(s, slot, d, n) for s, d, n in runs] for _, runs in self._runs[dst_rank]]
        return self._slot_runs[key]

    def _link_source(self, source: torch.Tensor) -> Any:
        """What a link's ``write`` takes: host bytes as a numpy array, device bytes as the tensor."""
        return source.numpy() if source.device.type == "cpu" else source

    def _inbox_source(self, dst_rank: int, payload: torch.Tensor) -> torch.Tensor:
        """``payload`` copied into ``dst_rank``'s inbox staging buffer (allocated once, at the inbox's capacity, on
        the payload's device where the transport reads device memory, else on the host), so that transports that
        register memory register it once."""
        device = payload.device if self._transport.device_sources else torch.device("cpu")
        staging = self._inbox_staging.get(dst_rank)
        if staging is None or staging.device != device:
            staging = self._inbox_staging[dst_rank] = torch.empty(self._inboxes[dst_rank][2], dtype=torch.uint8, device=device)
        staging[: payload.numel()].copy_(payload)
        return staging
