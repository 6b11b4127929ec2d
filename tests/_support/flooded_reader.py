"""An engine's reader (tcp transport) in a process of its own, for the flood tests of ``tests/core/test_hostile_load.py``:
the attacker is the test process, so what the reader costs is this process's alone (its memory, its time).

    python tests/_support/flooded_reader.py [--nofile N [--hard]]

Prints one JSON line ``{"address", "landing_port"}``, then answers one JSON line per command read on stdin:
``land V SCALE`` (a writer of this process lands version V, the weights times SCALE, and the bytes are checked;
``fresh`` after it: a new writer, with new connections), ``stats`` (RSS and its peak since the last ``reset``, the
messages rejected, its open descriptors, whether it can still open files, its CPU seconds), ``reset`` (the peak RSS starts again from now), ``quit``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--nofile", type=int, default=0, help="lower RLIMIT_NOFILE to this (0: leave it)")
parser.add_argument("--hard", action="store_true", help="--nofile is the hard limit too (nothing can raise it)")
parser.add_argument("--mib", type=int, default=32, help="MiB of weights a version carries")
args = parser.parse_args()
if args.nofile:
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (args.nofile, args.nofile if args.hard else resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

import torch  # noqa: E402

from rlsync import SyncOptions, WeightsReader, WeightsWriter  # noqa: E402
from rlsync.layouts import from_state_dict  # noqa: E402

STATE = {"w": torch.arange(args.mib << 18, dtype=torch.float32), "b": torch.ones(1024, dtype=torch.float32)}
LAYOUT = from_state_dict(STATE)
OPTIONS = SyncOptions(transport="tcp", timeout=30)


def status(field: str) -> int:
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field))


reader = WeightsReader(LAYOUT, LAYOUT, 0, options=OPTIONS)
print(json.dumps({"address": reader.address, "landing_port": reader._landing.describe()["port"]}), flush=True)  # type: ignore[union-attr]
writer: WeightsWriter | None = None
for line in sys.stdin:
    command, *rest = line.split()
    if command == "land":
        version, scale = int(rest[0]), float(rest[1])
        try:
            if writer is None or "fresh" in rest:
                if writer is not None:
                    writer.close()
                writer = WeightsWriter(LAYOUT, LAYOUT, 0, [reader.address], options=OPTIONS)
            state = {name: tensor * scale for name, tensor in STATE.items()}
            started = time.perf_counter()
            writer.multi_put(state)
            writer.complete(version)
            seconds = time.perf_counter() - started
            exact = all(bytes(reader.buffers()[n]) == t.numpy().tobytes() for n, t in state.items())
            print(json.dumps({"version": reader.version, "seconds": seconds, "exact": exact}), flush=True)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            writer = None
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
    elif command == "stats":
        import os

        usage = resource.getrusage(resource.RUSAGE_SELF)
        try:  # the engine's own files: can it still open some?
            opened = [open(__file__) for _ in range(8)]
            for f in opened:
                f.close()
            opens = True
        except OSError:
            opens = False
        print(json.dumps({"rss": status("VmRSS"), "peak": status("VmHWM"), "rejected": reader.rejected,
                          "fds": len(os.listdir("/proc/self/fd")), "opens": opens,
                          "cpu": usage.ru_utime + usage.ru_stime,
                          "control_turned_away": reader._channel.strangers.turned_away,  # type: ignore[union-attr]
                          "landing": {"turned_away": getattr(reader._landing, "turned_away", None),
                                      "accept_failures": getattr(reader._landing, "accept_failures", None)}}), flush=True)
    elif command == "reset":
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the kernel's peak RSS (VmHWM) starts again from the current RSS
        print(json.dumps({"rss": status("VmRSS")}), flush=True)
    elif command == "quit":
        break
reader.close()
