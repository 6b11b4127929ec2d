"""Test hosts in network namespaces: each host a namespace with its own address on one virtual switch (a Linux
bridge in a namespace of its own), joined by veth pairs. Nothing of the machine's own network is touched: every
link and address lives in namespaces made here and deleted on ``close``. A partition is the host's switch port set
down (this kernel has no ``netem``); ``heal`` sets it up again. Loss is an nftables rule that drops a share of the
packets a host sends (``lossy``); latency is a relay inside the host that every TCP connection it opens goes
through, delaying each byte both ways (``delay``, ``delay_relay.py``). Needs root and iproute2 (``ip netns``);
``lossy`` and ``delay`` need nftables (``nft``).

Also a script (a developer's view of the same hosts)::

    python tests/_support/netns_hosts.py 3      # makes 3 hosts, prints their names and addresses, waits for Enter
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def unavailable() -> str | None:
    """Why test hosts cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"rlsprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def faults_unavailable() -> str | None:
    """Why ``lossy`` and ``delay`` cannot be used here, or None."""
    return "nftables' `nft` is not installed (Debian package 'nftables')" if shutil.which("nft") is None else None


_RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay_relay.py")
_RELAY_MARK = 0x52  # the relay's own connections, which the redirect lets pass


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class TestHosts:
    """``count`` hosts: ``names[i]`` (the namespace) at ``addresses[i]`` (10.213.S.i+1/24, S from this process)."""

    __test__ = False  # not a test class, whatever pytest thinks of its name

    def __init__(self, count: int) -> None:
        tag = os.getpid() % 10000
        self.switch = f"rls{tag}sw"
        self.names = [f"rls{tag}h{i}" for i in range(count)]
        self.addresses = [f"10.213.{tag % 250}.{i + 1}" for i in range(count)]
        self._ports = [f"rl{tag}p{i}" for i in range(count)]  # the switch side of host i's cable
        self._processes: list[subprocess.Popen[str]] = []
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for name, address, port in zip(self.names, self.addresses, self._ports):
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
        except BaseException:
            self.close()
            raise

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start ``argv`` inside host ``host`` (stopped by ``close`` if still running)."""
        process = subprocess.Popen(["ip", "netns", "exec", self.names[host], *argv], text=True, **kwargs)
        self._processes.append(process)
        return process

    def cut(self, host: int) -> None:
        """Partition host ``host`` from the others: its switch port goes down (packets to and from it are lost)."""
        _ip("-n", self.switch, "link", "set", self._ports[host], "down")

    def heal(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", self._ports[host], "up")

    def _nft(self, host: int, rules: str) -> None:
        done = subprocess.run(["ip", "netns", "exec", self.names[host], "nft", "-f", "-"], input=rules,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nft in {self.names[host]}: {done.stderr.strip()}")

    def lossy(self, host: int, percent: float) -> None:
        """Host ``host`` loses ``percent`` % of the packets it sends on its cable, at random (real drops: TCP
        retransmits them)."""
        self._nft(host, f"""table inet rlsync_loss {{
            chain out {{
                type filter hook output priority 0; policy accept;
                oifname "eth0" numgen random mod 10000 < {round(percent * 100)} counter drop
            }}
        }}""")

    def dropped(self, host: int) -> int:
        """Packets ``lossy`` dropped on host ``host`` so far."""
        done = subprocess.run(["ip", "netns", "exec", self.names[host], "nft", "list", "table", "inet", "rlsync_loss"],
                              capture_output=True, text=True)
        found = re.search(r"counter packets (\d+)", done.stdout)
        return int(found.group(1)) if found else 0

    def delay(self, host: int, seconds: float, port: int = 7999) -> None:
        """Every TCP connection host ``host`` opens to another test host goes through a relay that delivers each
        byte ``seconds`` after it was sent, both ways (a round trip costs twice that)."""
        relay = self.popen(host, [sys.executable, _RELAY, str(port), str(seconds), str(_RELAY_MARK)],
                           stdout=subprocess.PIPE)
        assert relay.stdout is not None and relay.stdout.readline().strip() == "ready", "the delay relay did not start"
        subnet = self.addresses[0].rsplit(".", 1)[0] + ".0/24"
        self._nft(host, f"""table ip rlsync_delay {{
            chain out {{
                type nat hook output priority -100; policy accept;
                meta mark != {_RELAY_MARK} ip daddr {subnet} meta l4proto tcp redirect to :{port}
            }}
        }}""")

    def close(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        for name in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


if __name__ == "__main__":
    why = unavailable()
    if why:
        sys.exit(f"cannot make test hosts: {why}")
    hosts = TestHosts(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    try:
        for name, address in zip(hosts.names, hosts.addresses):
            print(f"{name}\t{address}\t(ip netns exec {name} CMD)")
        input("Enter tears them down: ")
    finally:
        hosts.close()
