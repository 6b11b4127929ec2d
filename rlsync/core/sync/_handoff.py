"""Complete versions, handed from a ``WeightsReader`` (staged landing) to the thread that loads them.

The reader's service thread calls ``on_version`` once every byte of a version has landed; it blocks
there until the engine thread has taken the version (``next``) and loaded it (``finish``), so the
writers' ``complete(v)`` returns only when the engine serves ``v``, and a loader error reaches the
writers instead of a silent half-update.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from rlsync.core._errors import ConfigError, PeerLostError, TransferTimeoutError, WeightMismatchError
from rlsync.core.sync._options import DEFAULT_TIMEOUT
from rlsync.core.sync._transport import Region

Finish = Callable[[BaseException | None], None]
_REFUSAL_POLL = 0.05  # seconds between looks at the reader's standing refusal while waiting


class LandedVersions:
    """Pass ``on_version`` (and ``on_refused``, ``on_lost``) to a staged ``WeightsReader``; the engine thread calls
    ``next``.

    ``load_timeout``: how long a landed version may wait to be loaded before the writers hear it failed.
    ``refusal``: the reader's standing refusal of a writer (``WeightsReader.refusal``): while there is one, ``next``
    raises it at once, so that an engine waiting for a version that will not come hears why within a moment.
    """

    def __init__(self, load_timeout: float = DEFAULT_TIMEOUT, refusal: Callable[[], str | None] | None = None) -> None:
        self._pending: queue.Queue[tuple[int, dict[str, Region], threading.Event, list[BaseException]] | BaseException]
        self._pending = queue.Queue()
        self.load_timeout = load_timeout
        self.refusal = refusal or (lambda: None)

    def on_version(self, version: int, buffers: dict[str, Region]) -> None:
        """Reader thread: wait until the engine loaded ``version`` (raises what the engine raised)."""
        done, errors = threading.Event(), []  # type: ignore[var-annotated]
        self._pending.put((version, buffers, done, errors))
        if not done.wait(self.load_timeout):
            raise TransferTimeoutError(f"the engine did not load version {version} within {self.load_timeout} s")
        if errors:
            raise errors[0]

    def on_refused(self, version: int | None, reason: str) -> None:
        """Reader thread: a complete version was refused (checksums): the waiting ``next`` raises at once. A writer
        refused at connect (``version`` None) stands in ``refusal`` until another is welcomed."""
        if version is not None:
            self._pending.put(WeightMismatchError(reason))

    def on_lost(self, version: int, reason: str) -> None:
        """Reader thread: a writer's connection closed before it finished ``version``: the waiting ``next`` raises at
        once instead of waiting out its timeout."""
        self._pending.put(PeerLostError(reason))

    def next(self, timeout: float) -> tuple[int, dict[str, Region], Finish]:
        """Engine thread: the next landed version, its buffers (``uint8``, by buffer name) and ``finish(error or
        None)``, to call once it is loaded (None) or failed to load (the error): the version goes live only then."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self._pending.get(timeout=min(_REFUSAL_POLL, max(0.0, deadline - time.monotonic())))
                break
            except queue.Empty:
                refused = self.refusal()
                if refused is not None:
                    raise ConfigError(f"the engine's reader refused the trainer's writer: {refused}") from None
                if time.monotonic() >= deadline:
                    raise TransferTimeoutError(f"no weight version arrived within {timeout} s (did the trainer die?)") from None
        if isinstance(got, BaseException):
            raise got
        version, buffers, done, errors = got

        def finish(error: BaseException | None) -> None:
            if error is not None:
                errors.append(error)
            done.set()

        return version, buffers, finish
