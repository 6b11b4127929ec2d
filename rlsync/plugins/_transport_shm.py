"""``shm``: same-host shared memory. The reader's regions are files in /dev/shm, mapped by both
processes; the writer copies straight into them (one copy in all, at memcpy speed because the
reader touched every page when it allocated them)."""

from __future__ import annotations

import math
import mmap
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from rlsync import ConfigError, Landing, Link, PeerLostError, Run, Transport

SHM_DIR = "/dev/shm"


def remove_stale_regions() -> list[str]:
    """Unlink the regions of readers that died without closing (SIGKILL, OOM): files named
    ``rlsync-<pid>-*`` that this user owns and whose process is gone. Returns the paths removed."""
    removed = []
    for entry in os.scandir(SHM_DIR):
        parts = entry.name.split("-")
        if len(parts) < 3 or parts[0] != "rlsync" or not parts[1].isdigit():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            try:
                os.unlink(entry.path)
                removed.append(entry.path)
            except FileNotFoundError:  # another reader cleaned it up first
                pass
        except (PermissionError, FileNotFoundError):  # alive under another user, or already gone
            continue
    return removed


def _map(path: str, nbytes: int, create: bool) -> tuple[mmap.mmap, np.ndarray]:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
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
        for path in self._paths:
            mapping, region = _map(path, max(nbytes, 1), create=True)
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


class ShmLink(Link):
    def __init__(self, description: dict[str, Any]) -> None:
        if description.get("host") != os.uname().nodename:
            raise PeerLostError(
                f"the shm transport needs reader and writer on one host; the reader is on {description.get('host')!r}. "
                f"Use transport='nixl' or 'tcp' across hosts."
            )
        self._maps = []
        self._regions = []
        for path in description["paths"]:
            try:
                mapping, region = _map(path, max(int(description["nbytes"]), 1), create=False)
            except FileNotFoundError as exc:
                raise PeerLostError(f"the reader's shared memory {path} is gone: the reader exited") from exc
            self._maps.append(mapping)
            self._regions.append(region)

    def write(self, source: np.ndarray, runs: Sequence[Run]) -> None:
        regions = self._regions
        for s, slot, d, n in runs:
            np.copyto(regions[slot][d : d + n], source[s : s + n])

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
        return ShmLink(description)
