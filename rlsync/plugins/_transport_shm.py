"""``shm``: same-host shared memory. The reader's regions are files in /dev/shm, mapped by both
processes; the writer copies straight into them (one copy in all, at memcpy speed because the
reader touched every page when it allocated them).

A live reader holds a lock (``flock``) on each of its files for as long as it lives; the kernel drops the lock when
the process dies, however it dies. A file nobody holds a lock on is a dead reader's, and the next reader removes it
(``remove_stale_regions``). Locks, not process ids: a container that shares the host's /dev/shm (``--ipc=host``)
sees another container's readers under pids it cannot signal, and took them for dead."""

from __future__ import annotations

import collections
import errno
import fcntl
import math
import mmap
import os
import re
import secrets
import stat
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from rlsync import ConfigError, Landing, Link, PeerLostError, Run, Transport, TransportError

SHM_DIR = "/dev/shm"


def remove_stale_regions() -> list[str]:
    """Unlink the regions of readers that died without closing (SIGKILL, OOM): files named ``rlsync-<pid>-*`` that
    this user owns and that no process holds a lock on (the pid only names the file: across PID namespaces it says
    nothing). Returns the paths removed."""
    removed = []
    for entry in os.scandir(SHM_DIR):
        creating = entry.name.startswith(".rlsync-")  # a reader killed while it made its file, or one making it now
        parts = entry.name.removeprefix(".").split("-")  # rlsync-<pid>-<tag>-<slot>: a landing's, and nothing else
        if len(parts) < 3 or parts[0] != "rlsync" or not parts[1].isdigit() or not entry.is_file(follow_symlinks=False):
            continue
        try:
            if entry.stat().st_uid != os.getuid() or (creating and time.time() - entry.stat().st_mtime < 60):
                continue
            fd = os.open(entry.path, os.O_RDONLY)
        except OSError:  # gone meanwhile, or not ours to open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # granted only where no live reader holds its lock
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        else:
            try:
                os.unlink(entry.path)
                removed.append(entry.path)
            except OSError:  # another reader cleaned it up first
                pass
        finally:
            os.close(fd)
    return removed


def _create_locked(path: str, nbytes: int) -> int:
    """``path``, ``nbytes`` long, created under another name, locked, then renamed: no other reader ever sees it
    unlocked. Returns the descriptor that holds the lock (closed, the lock goes)."""
    creating = os.path.join(SHM_DIR, "." + os.path.basename(path))
    fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, nbytes)
        os.rename(creating, path)
    except BaseException:
        os.close(fd)
        os.unlink(creating)
        raise
    return fd


def _map(fd: int, nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return mapping, np.frombuffer(mapping, dtype=np.uint8)


def _check_room(nbytes: int) -> None:
    """Refuse a landing that /dev/shm cannot hold, before a page is touched: touching a page past a tmpfs's size
    kills the process with SIGBUS ("Bus error", no traceback). Docker gives a container 64 MB of /dev/shm."""
    stat = os.statvfs(SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    if nbytes > free:
        raise ConfigError(
            f"shared memory is too small for this reader: its landing needs {nbytes / 2**20:,.0f} MiB in {SHM_DIR} "
            f"and {free / 2**20:,.0f} MiB are free there. In Docker start the container with "
            f"--shm-size={math.ceil(nbytes / 2**30) + 1}g (its default is 64 MB); on Kubernetes mount an emptyDir "
            f"with medium: Memory at {SHM_DIR}; or choose SyncOptions(transport='tcp'), which needs no shared memory")


class ShmLanding(Landing):
    name: ClassVar[str] = "shm"
    same_host_only: ClassVar[bool] = True

    @classmethod
    def available(cls) -> bool:
        return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)

    def __init__(self, nbytes: int, slots: int, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(nbytes, slots, options)
        remove_stale_regions()  # a killed reader's files would otherwise hold shared memory until reboot
        _check_room(max(nbytes, 1) * slots)
        tag = f"rlsync-{os.getpid()}-{secrets.token_hex(4)}"
        self._paths = [os.path.join(SHM_DIR, f"{tag}-{i}") for i in range(slots)]
        self._maps: list[mmap.mmap] = []
        self._regions: list[np.ndarray] = []
        self._locks: list[int] = []  # held open for the landing's life: the files are a live reader's
        for path in self._paths:
            self._locks.append(_create_locked(path, max(nbytes, 1)))
            mapping, region = _map(self._locks[-1], max(nbytes, 1))
            region.fill(0)  # touch every page now: a first write into fresh shm runs at a tenth of memcpy
            self._maps.append(mapping)
            self._regions.append(region)

    @property
    def regions(self) -> Sequence[np.ndarray]:
        return self._regions

    def describe(self) -> dict[str, Any]:
        return {"paths": self._paths, "nbytes": self.nbytes, "host": os.uname().nodename}

    def close(self) -> None:
        self._regions.clear()
        for mapping in self._maps:
            try:
                mapping.close()
            except BufferError:  # views still exported: the mapping goes when they do
                pass
        for path in self._paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        for fd in self._locks:
            os.close(fd)
        self._locks.clear()


_LANDING_FILE = re.compile(r"rlsync-\d+-[0-9a-f]{8}-\d")  # what ShmLanding names its files


def open_landing_file(path: Any, nbytes: int) -> int:
    """A descriptor of the landing file ``path`` for writing, once it is verified as one: a file ShmLanding named, in
    /dev/shm, not a link, this user's, ``nbytes`` long. A reader names the file; a writer must not write its weights
    into whatever it names (a model's config.json, say)."""
    if not isinstance(path, str) or os.path.dirname(path) != SHM_DIR or not _LANDING_FILE.fullmatch(os.path.basename(path)):
        raise TransportError(f"the reader named {str(path)[:200]!r} as its shared memory: not an rlsync landing file "
                             f"({SHM_DIR}/rlsync-PID-TAG-SLOT): refused")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError as exc:
        raise PeerLostError(f"the reader's shared memory {path} is gone: the reader exited") from exc
    except OSError as exc:
        raise TransportError(f"the reader's shared memory {path} cannot be opened as a landing file: {exc}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size != nbytes:
        os.close(fd)
        raise TransportError(f"the reader's shared memory {path} is not a landing file of this user of {nbytes} bytes "
                             f"(its owner {info.st_uid}, {info.st_size} bytes): refused")
    return fd


class ShmLink(Link):
    def __init__(self, description: dict[str, Any], options: Mapping[str, Any] | None = None) -> None:
        if description.get("host") != os.uname().nodename:
            raise PeerLostError(
                f"the shm transport needs reader and writer on one host; the reader is on {description.get('host')!r}. "
                f"Use transport='nixl' or 'tcp' across hosts."
            )
        nbytes = max(int(description["nbytes"]), 1)
        planned = (options or {}).get("region_bytes")
        if planned is not None and nbytes != max(int(planned), 1):
            raise TransportError(f"the reader describes a landing of {nbytes} bytes; the plan gives it {planned}: refused")
        paths = description["paths"]
        if not isinstance(paths, list) or not 1 <= len(paths) <= 2:
            raise TransportError(f"the reader describes {str(paths)[:200]}: one or two landing files expected")
        self._maps = []
        self._regions = []
        for path in paths:
            fd = open_landing_file(path, nbytes)
            try:
                mapping, region = _map(fd, nbytes)
            finally:
                os.close(fd)
            self._maps.append(mapping)
            self._regions.append(region)

    def write(self, source: np.ndarray, runs: Sequence[Run]) -> None:
        regions = self._regions
        for s, slot, d, n in runs:
            np.copyto(regions[slot][d : d + n], source[s : s + n])

    def prepare(self, parts: Sequence[tuple[Any, Sequence[Run]]]) -> Any:
        """The views of every run, destination and source, made once: a prepared version is one ``np.copyto`` per
        run, called from C (``map``), with no slicing or unpacking in Python."""
        regions = self._regions
        pairs = [(regions[slot][d : d + n], source[s : s + n]) for source, runs in parts for s, slot, d, n in runs]
        return [d for d, _ in pairs], [s for _, s in pairs]

    def write_prepared(self, prepared: Any) -> None:
        destinations, sources = prepared
        collections.deque(map(np.copyto, destinations, sources), maxlen=0)

    def close(self) -> None:
        self._regions.clear()
        for mapping in self._maps:
            try:
                mapping.close()
            except BufferError:
                pass


class ShmTransport(Transport):
    name: ClassVar[str] = "shm"
    landing: ClassVar[type[Landing]] = ShmLanding

    @classmethod
    def open(cls, description: dict[str, Any], options: Mapping[str, Any] | None = None) -> Link:
        return ShmLink(description, options)
