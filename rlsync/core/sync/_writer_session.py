"""A writer's sessions with its readers: one per reader, opened (Knock, Challenge, Hello, Welcome) the first time a
version goes there and dropped when the reader is lost.

``WriterSession`` is one part of ``WeightsWriter`` (its other part, ``VersionPosting``, sends each version): the link of
the data plane, the slot, the checksum and, in place, the run placement each reader's Welcome decides."""

from __future__ import annotations

import bisect

from rlsync.core.sync._control import Begin, Go, Hello, Refuse, Welcome, open_channel
from rlsync.core._errors import ConfigError, TransferTimeoutError, TransportError, VersionError, WeightMismatchError
from rlsync.core.sync._delta import INBOX_SHARE
from rlsync.core.sync._regions import ALIGN, region_offsets
from rlsync.core.sync._writer_state import WriterState


MAX_SLOTS = 2  # a direct landing's two; staged and in place have one


class WriterSession(WriterState):
    def _connect(self, dst_rank: int) -> None:
        if dst_rank in self._links:
            return
        channel, challenge = open_channel(self._readers[dst_rank], self._secret, self.timeout)
        src_fp, dst_fp, dst_tensors = self._fingerprints
        try:
            channel.send(Hello(self.rank, src_fp, dst_fp, dst_tensors, self._session, self.src if challenge.needs_src else None,
                               delta=self._changes is not None, checksums=self._checksum))
            got = channel.recv(timeout_ms=int(self.timeout * 1000))
        except (TransportError, ConfigError):
            channel.close()
            raise
        if got is None:
            channel.close()
            raise TransferTimeoutError(f"reader rank {dst_rank} at {self._readers[dst_rank]} did not answer within {self.timeout} s")
        msg = got[1]
        if isinstance(msg, Refuse):
            channel.close()
            raise WeightMismatchError(f"reader rank {dst_rank} refused: {msg.reason}")
        if not isinstance(msg, Welcome):
            channel.close()
            raise TransportError(f"reader rank {dst_rank} answered {type(msg).__name__} to a Hello: "
                                 f"is {self._readers[dst_rank]} a reader of this rlsync version?")
        if msg.transport != self._transport.name:
            channel.close()
            raise TransportError(f"reader rank {dst_rank} uses transport {msg.transport!r}, this writer {self._transport.name!r}")
        _, region_bytes = region_offsets(self.dst, dst_rank)
        if not 0 <= msg.next_slot < MAX_SLOTS:
            channel.close()
            raise TransportError(f"reader rank {dst_rank} named landing slot {msg.next_slot}: a reader has {MAX_SLOTS} at most")
        # the data plane proves a key derived from the same one at connect (the tcp landing's challenge); a link takes
        # nothing of the reader's for a size: the plan says how many bytes its landing holds (region_bytes)
        options = {**self._options, "secret": channel.data_key, "region_bytes": region_bytes, "token": msg.data_token}
        self._links[dst_rank] = self._transport.open(msg.description, options)
        self._channels[dst_rank] = channel
        self._slots[dst_rank] = msg.next_slot
        self._algorithms[dst_rank] = msg.checksum
        if msg.in_place:  # its regions are its buffers, one each, in layout order: runs placed once per connection
            offsets, _ = region_offsets(self.dst, dst_rank)
            starts = sorted(offsets.values())
            self._in_place[dst_rank] = [[(s, i, d - starts[i], n) for s, d, n in runs for i in [bisect.bisect_right(starts, d) - 1]]
                                        for _, runs in self._runs[dst_rank]]
        else:
            self._in_place.pop(dst_rank, None)
        self._held[dst_rank] = {}  # what its slots hold is unknown until a version of ours goes live there
        if self._changes is not None and msg.inbox is not None:
            # the part the plan gives this writer at most (the reader's own sizing: INBOX_SHARE of its bytes, aligned),
            # whatever the reader claims: the writer allocates a staging buffer of that size
            most = -(-int(self._part_bytes[dst_rank] * INBOX_SHARE) // ALIGN) * ALIGN
            if not 0 <= msg.inbox_offset or not 0 <= msg.inbox_capacity <= most:
                self._drop(dst_rank)
                raise TransportError(f"reader rank {dst_rank} gave this writer an inbox part of {msg.inbox_capacity} bytes at "
                                     f"{msg.inbox_offset}; the plan gives it {most} at most: refused")
            inbox_options = {**options, "region_bytes": None}  # its size is every writer's parts': the link checks the file's
            self._inboxes[dst_rank] = (self._transport.open(msg.inbox, inbox_options), msg.inbox_offset, msg.inbox_capacity)

    def _drop(self, dst_rank: int) -> None:
        self._prepared = {key: value for key, value in self._prepared.items() if key[0] != dst_rank}
        link, channel = self._links.pop(dst_rank, None), self._channels.pop(dst_rank, None)
        inbox = self._inboxes.pop(dst_rank, None)
        for one in (link, None if inbox is None else inbox[0]):
            try:
                if one is not None:
                    one.close()
            except Exception:  # noqa: BLE001 - the peer is gone; nothing to release cleanly
                pass
        if channel is not None:
            channel.close()

    def _ask_to_begin(self, dst_rank: int, version: int) -> str | None:
        """An in-place reader pauses its engine before a byte lands (a node relay asks its readers too): ask, and
        wait for its go."""
        channel = self._channels[dst_rank]
        channel.send(Begin(self.rank, version))
        got = channel.recv(timeout_ms=int(self.timeout * 1000))
        if got is None:
            self._drop(dst_rank)
            return f"did not let version {version} begin within {self.timeout} s (gone, or an in-place engine that did not pause)"
        if isinstance(got[1], Go) and got[1].version == version:
            return None
        if isinstance(got[1], Refuse) and got[1].kind == "version":
            raise VersionError(f"reader rank {dst_rank} refused version {version}: {got[1].reason}")
        return getattr(got[1], "reason", f"unexpected answer {got[1]!r}")
