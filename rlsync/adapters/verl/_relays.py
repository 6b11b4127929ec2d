"""Where the verl backend puts a ``NodeRelay``: one per host of several rollout workers, so that the trainer's bytes
cross to that host once, not once per worker (issue #40's node fan-out, ``docs/wire.md``).

Every rollout worker holds a whole copy of the model (a replica reader). Without relays each actor rank sends its
chunk to each of them: a host of 8 rollout workers takes 8 copies over its link. With a relay the actor ranks send
to the host's relay (run by its lowest rollout worker), which forwards each worker its copy over shared memory, and
the version goes live on all of them or on none (``rlsync.NodeRelay``).

``relay``, the option ``+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rlsync.relay``: ``auto`` (the
default) relays a host of several rollout workers and no actor rank (an actor rank beside them writes to their
shared memory itself, which a relay would only delay); ``true`` relays every host of several rollout workers;
``false`` none.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlsync import ConfigError

OPTION = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rlsync.relay"


def relay_mode(value: Any) -> bool | str:
    """The option's value, checked: ``auto``, true or false (verl's config gives a bool or a string)."""
    if isinstance(value, bool):
        return value
    if value == "auto":
        return "auto"
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{OPTION}={value!r}: use auto (the default), true or false")


def host_id() -> str:
    """This machine as far as shared memory reaches: its host name and boot id (processes that share both share
    /dev/shm, unless a container gives them their own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class Placement:
    """The trainer's readers (``entries``: a relay's or a worker's address each) and, per rollout worker, the replica
    it is among them (``reader``: ``(rank, replicas)``; ``(0, 1)`` behind a relay, to which each worker is an engine
    of one rank), whether it is behind one (``behind``), and the relay it runs (``relay``: None, or its address, its
    ``rank``/``replicas`` among the entries and the addresses of the host's workers it forwards to, its own first)."""

    entries: list[str]
    reader: list[tuple[int, int]]
    behind: list[bool]
    relay: list[dict[str, Any] | None]


def place(actor_hosts: Sequence[str | None], rollout: Sequence[dict[str, Any]]) -> Placement:
    """Group the rollout workers (their ``prepare`` metadata: ``address``, ``host``, ``relay_address``, ``relay``) by
    host and relay where the option says so; hosts in the order of their first worker."""
    hosts: dict[str, list[int]] = {}
    for rank, meta in enumerate(rollout):
        hosts.setdefault(meta.get("host") or f"worker {rank}", []).append(rank)
    trainer_hosts = set(actor_hosts)
    entries: list[str] = []
    direct: dict[int, int] = {}  # rollout rank -> its index in entries
    relays: dict[int, dict[str, Any]] = {}
    for host, ranks in hosts.items():
        lead = rollout[ranks[0]]
        mode = lead.get("relay", "auto")
        if len(ranks) > 1 and lead.get("relay_address") and (mode is True or (mode == "auto" and host not in trainer_hosts)):
            relays[ranks[0]] = {"address": lead["relay_address"], "rank": len(entries),
                                "local": [rollout[r]["address"] for r in ranks]}
            entries.append(lead["relay_address"])
        else:
            for rank in ranks:
                direct[rank] = len(entries)
                entries.append(rollout[rank]["address"])
    replicas = len(entries)
    for spec in relays.values():
        spec["replicas"] = replicas
    workers = range(len(rollout))
    return Placement(entries, [(direct[r], replicas) if r in direct else (0, 1) for r in workers],
                     [r not in direct for r in workers], [relays.get(r) for r in workers])
