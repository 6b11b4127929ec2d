"""A slow link on this machine, for ``rlsync bench --wire delta --link-gbps G``: two network namespaces (the trainer's
host and the engine's) joined by one veth pair whose both ends are rate-limited by a ``tbf`` qdisc (this kernel has
no ``netem``). Nothing of the machine's own network is touched; the namespaces are deleted on the way out.

The benchmark then runs itself again inside the trainer's namespace (``ip netns exec``), its readers inside the
engine's, over tcp (shared memory would cross no link: the namespaces share /dev/shm), and counts the bytes each
version put on the trainer's end of the link (its ``tx_bytes``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rlsync import ConfigError

#: set in the re-run benchmark: "ENGINE_NAMESPACE,ENGINE_ADDRESS,TRAINER_DEVICE,GBPS"
LINK_ENV = "RLSYNC_BENCH_LINK"
_DEVICE = "rlsbench0"


@dataclass(frozen=True)
class Link:
    engine_namespace: str
    engine_address: str
    trainer_device: str
    gbps: float

    @classmethod
    def from_env(cls) -> Link | None:
        """The link this process runs across, when it is the benchmark re-run inside the trainer's namespace."""
        value = os.environ.get(LINK_ENV)
        if not value:
            return None
        namespace, address, device, gbps = value.split(",")
        return cls(namespace, address, device, float(gbps))

    def tx_bytes(self) -> int:
        """Bytes the trainer's end of the link has sent so far (this process runs in the trainer's namespace)."""
        with open(f"/sys/class/net/{self.trainer_device}/statistics/tx_bytes") as f:
            return int(f.read())


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"--link-gbps: `ip {' '.join(args)}` failed: {done.stderr.strip()}")


def unavailable() -> str | None:
    """Why a rate-limited link cannot be made here, or None."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "--link-gbps needs iproute2's `ip` and `tc` (Debian package 'iproute2')"
    if os.geteuid() != 0:
        return "--link-gbps makes network namespaces: run it as root"
    return None


@contextmanager
def slow_link(gbps: float) -> Iterator[tuple[str, dict[str, str]]]:
    """Yields ``(the trainer's namespace, the environment of the benchmark re-run inside it)``."""
    why = unavailable()
    if why is not None:
        raise ConfigError(why)
    if not gbps > 0:
        raise ConfigError(f"--link-gbps {gbps}: a rate in Gbit/s above 0, e.g. 1 or 10")
    tag = f"rlsbench{os.getpid() % 100000}"
    trainer, engine = f"{tag}t", f"{tag}e"
    subnet = f"10.214.{os.getpid() % 250}"
    rate = f"{gbps * 1000:.0f}mbit"
    burst = f"{max(32, int(gbps * 1e9 / 8 / 250 / 1024))}kb"  # 4 ms of traffic: below that tbf itself is the limit
    made: list[str] = []
    try:
        for name in (trainer, engine):
            _ip("netns", "add", name)
            made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", trainer, "link", "add", _DEVICE, "type", "veth", "peer", "name", _DEVICE, "netns", engine)
        for name, host in ((trainer, 1), (engine, 2)):
            _ip("-n", name, "addr", "add", f"{subnet}.{host}/24", "dev", _DEVICE)
            _ip("-n", name, "link", "set", _DEVICE, "up")
            done = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", _DEVICE, "root", "tbf",
                                   "rate", rate, "burst", burst, "latency", "100ms"], capture_output=True, text=True)
            if done.returncode != 0:
                raise ConfigError(f"--link-gbps: tc could not limit the link to {rate}: {done.stderr.strip()}")
        env = {LINK_ENV: f"{engine},{subnet}.2,{_DEVICE},{gbps}",
               "RLSYNC_SECRET": os.environ.get("RLSYNC_SECRET") or secrets.token_hex(16)}  # a reader off loopback
        yield trainer, env
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
