"""Failures: a writer killed mid-version, a reader killed before the notice, mismatched input."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rlsync import (
    PeerLostError,
    SyncOptions,
    TensorMeta,
    TransferTimeoutError,
    VersionError,
    WeightMismatchError,
    WeightsReader,
    WeightsWriter,
)
from rlsync.core import LandedVersions
from rlsync.layouts import from_state_dict

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("landing", ["direct", "staged"])
def test_writer_killed_midway_leaves_the_previous_version_and_the_next_sync_works(sync: Any, transport: str, landing: str) -> None:
    src, dst = sync.layouts("plain")
    loaded: list[int] = []
    with WeightsReader(src, dst, 0, landing=landing, on_version=lambda v, b: loaded.append(v), options=SyncOptions(transport=transport)) as reader:
        assert sync.writer("plain", transport, {0: reader.address}, [1]).returncode == 0
        dying = sync.writer("plain", transport, {0: reader.address}, [2], extra=("--die-after-writes", "3"))
        assert dying.returncode == -9  # SIGKILL, after 3 of its 7 writes
        time.sleep(0.2)
        assert reader.version == 1 and loaded == [1]
        if landing == "direct":  # the served slot never saw a byte of version 2
            sync.assert_landed("plain", reader, 1)
        again = sync.writer("plain", transport, {0: reader.address}, [2])
        assert again.returncode == 0, again.stderr_text
        assert reader.version == 2 and loaded == [1, 2]
        sync.assert_landed("plain", reader, 2)


def test_a_writer_killed_mid_version_gives_the_version_up_at_once_not_at_the_timeout(sync: Any, tmp_path: Path) -> None:
    """Two trainer ranks synced version 1 together; in version 2 rank 1 is killed after 2 of its 7 writes, after
    rank 0 finished its part. Its connection closing gives version 2 up at once, not at the 60 s timeout every
    side has: the engine waiting for it hears ``PeerLostError`` naming the rank, rank 0's ``complete(2)`` fails saying
    why, version 1 stays live; both ranks (rank 1 restarted) then land version 2."""
    src, dst = sync.layouts("two_writers")
    handed = LandedVersions(60)
    waits: list[object] = []

    def engine() -> None:  # the engine's thread: loads each version handed to it, records what its waits ended in
        for _ in range(3):
            try:
                version, _, finish = handed.next(60)
            except Exception as exc:  # noqa: BLE001 - what the wait ended in is the assertion
                waits.append((exc, time.monotonic()))
                continue
            finish(None)
            waits.append(version)

    with WeightsReader(src, dst, 0, landing="staged", on_version=handed.on_version, on_refused=handed.on_refused,
                       on_lost=handed.on_lost, options=SyncOptions(transport="shm")) as reader:
        threading.Thread(target=engine, daemon=True).start()
        gates = [tmp_path / "rank0", tmp_path / "rank1"]  # a rank completes version V once its gate's file .V exists
        for gate in gates:
            gate.with_suffix(".1").touch()
        first = sync.writer("two_writers", "shm", {0: reader.address}, [1, 2], rank=0, wait=False,
                            extra=("--timeout", "60", "--wait-for", str(gates[0])))
        dying = sync.writer("two_writers", "shm", {0: reader.address}, [1, 2], rank=1, wait=False,
                            extra=("--timeout", "60", "--die-after-writes", "9", "--wait-for", str(gates[1])))
        deadline = time.monotonic() + 60
        while waits != [1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reader.version == 1 and waits == [1]
        gates[0].with_suffix(".2").touch()
        while not (reader._pending_version == 2 and 0 in reader._done) and time.monotonic() < deadline:
            time.sleep(0.01)
        gates[1].with_suffix(".2").touch()
        assert dying.wait(timeout=60) == -9
        killed = time.monotonic()
        _, err = first.communicate(timeout=60)
        assert first.returncode != 0 and time.monotonic() - killed < 10, err
        assert "writer rank 1's connection closed before it finished version 2 (did the trainer die?)" in err, err
        while len(waits) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        lost, when = waits[1]  # type: ignore[misc]
        assert isinstance(lost, PeerLostError) and "writer rank 1's connection closed" in str(lost), lost
        assert when - killed < 10  # not the 60 s timeout
        assert reader.version == 1 and reader.discarded == [2]  # (staged: the engine holds version 1, its staging is not live)
        both = [sync.writer("two_writers", "shm", {0: reader.address}, [2], rank=r, wait=False) for r in (0, 1)]
        assert [w.wait(timeout=60) for w in both] == [0, 0]
        assert reader.version == 2 and waits[2:] == [2]
        sync.assert_landed("two_writers", reader, 2)


def test_a_lone_writer_killed_mid_version_gives_it_up_at_once(sync: Any) -> None:
    """A trainer of one rank (TRL's, OpenRLHF's rank 0) killed after 3 of its 7 writes of version 2, before any part
    was done: its Begin said the version was under way, so its connection closing gives the version up at once; the
    engine's wait hears ``PeerLostError`` within seconds, not at its 60 s timeout, and version 1 stays."""
    src, dst = sync.layouts("plain")
    handed = LandedVersions(60)
    with WeightsReader(src, dst, 0, landing="staged", on_version=handed.on_version, on_refused=handed.on_refused,
                       on_lost=handed.on_lost, options=SyncOptions(transport="shm")) as reader:
        first = sync.writer("plain", "shm", {0: reader.address}, [1], wait=False)
        version, _, finish = handed.next(60)
        finish(None)
        assert version == 1 and first.wait(timeout=60) == 0
        dying = sync.writer("plain", "shm", {0: reader.address}, [2], extra=("--timeout", "60", "--die-after-writes", "3"))
        assert dying.returncode == -9
        killed = time.monotonic()
        with pytest.raises(PeerLostError, match="writer rank 0's connection closed before it finished version 2"):
            handed.next(60)
        assert time.monotonic() - killed < 10  # not the 60 s timeout
        assert reader.version == 1 and reader.discarded == [2]


def test_reader_killed_makes_complete_fail_in_time_and_the_other_reader_still_gets_it(sync: Any) -> None:
    src, dst = sync.layouts("fanout")
    alive, alive_addr = sync.reader("fanout", "shm", 0)
    doomed, doomed_addr = sync.reader("fanout", "shm", 1)
    doomed.kill()
    doomed.wait()
    writer = WeightsWriter(src, dst, 0, {0: alive_addr, 1: doomed_addr}, options=SyncOptions(transport="shm", timeout=2.0))
    tensors = {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in src.tensors}
    writer.multi_put(tensors)
    started = time.monotonic()
    with pytest.raises((TransferTimeoutError, PeerLostError), match=r"reader rank 1 .*Live on reader ranks \[0\]"):
        writer.complete(1)
    assert time.monotonic() - started < 8
    writer.close()
    assert alive.stdout is not None
    versions = [json.loads(alive.stdout.readline())["version"] for _ in range(2)]
    assert versions == [-1, 1]


def test_layout_mismatch_is_refused_before_a_byte_is_written(sync: Any) -> None:
    src, dst = sync.layouts("plain")
    with WeightsReader(src, dst, 0, options=SyncOptions(transport="shm")) as reader:
        other = [TensorMeta(t.name, t.dtype, (48, 64) if t.name == "layer2.weight" else t.shape) for t in src.tensors]
        writer = WeightsWriter(from_state_dict(other), from_state_dict(other), 0, [reader.address], options=SyncOptions(transport="shm", timeout=5))
        writer.multi_put({t.name: torch.ones(t.shape, dtype=getattr(torch, t.dtype)) for t in other})
        with pytest.raises(WeightMismatchError, match=r"another destination layout .*'layer2.weight' differs"):
            writer.complete(1)
        assert reader.version == -1
        assert all(not buf.any() for buf in reader.buffers(slot=1).values())
        writer.close()


def test_put_checks_name_dtype_and_size() -> None:
    src, dst = from_state_dict([TensorMeta("w", "bfloat16", (4, 4))]), from_state_dict([TensorMeta("w", "bfloat16", (4, 4))])
    with WeightsReader(src, dst, 0) as reader:
        writer = WeightsWriter(src, dst, 0, [reader.address])
        with pytest.raises(WeightMismatchError, match=r"no buffer 'v'"):
            writer.put("v", torch.zeros(4, 4, dtype=torch.bfloat16))
        with pytest.raises(WeightMismatchError, match=r"tensor 'w': dtype float32 but the layout says bfloat16"):
            writer.put("w", torch.zeros(4, 4))
        with pytest.raises(WeightMismatchError, match=r"tensor 'w': 12 elements but the layout says 16"):
            writer.put("w", torch.zeros(3, 4, dtype=torch.bfloat16))
        with pytest.raises(WeightMismatchError, match=r"no tensor was put for \['w'\]"):
            writer.complete(1)
        assert reader.version == -1
        writer.close()


def test_versions_must_increase() -> None:
    meta = [TensorMeta("w", "float32", (8,))]
    src = dst = from_state_dict(meta)
    with WeightsReader(src, dst, 0) as reader:
        writer = WeightsWriter(src, dst, 0, [reader.address], options=SyncOptions(timeout=5))
        writer.put("w", torch.arange(8, dtype=torch.float32))
        writer.complete(5)
        with pytest.raises(VersionError, match="version 5 is not newer than live version 5"):
            writer.complete(5)
        out = np.empty(8, np.float32)
        reader.get("w", out)
        assert out.tolist() == list(range(8))
        writer.close()


def test_a_killed_readers_shared_memory_is_removed_by_the_next_reader(sync: Any) -> None:
    """SIGKILL skips a reader's cleanup; the next shm reader on the host unlinks the dead one's files
    (and only those: a live reader's stay)."""
    import glob

    from rlsync.plugins import remove_stale_regions

    live, _ = sync.reader("plain", "shm", 0)
    doomed, _ = sync.reader("plain", "shm", 0)
    doomed.kill()
    doomed.wait()
    assert glob.glob(f"/dev/shm/rlsync-{doomed.pid}-*"), "the killed reader left no files to clean up"
    removed = remove_stale_regions()
    assert any(f"rlsync-{doomed.pid}-" in path for path in removed)
    assert not any(f"rlsync-{live.pid}-" in path for path in removed)
    assert not glob.glob(f"/dev/shm/rlsync-{doomed.pid}-*")
    assert glob.glob(f"/dev/shm/rlsync-{live.pid}-*")


_SMALL_SHM_CHILD = """
import os, torch
from rlsync import ConfigError, SyncOptions, WeightsReader
from rlsync.layouts import from_state_dict

options = SyncOptions(transport="shm")
fits = from_state_dict({"w": torch.zeros(2**16)})  # 256 KiB, two slots: fits in 1 MiB
with WeightsReader(fits, fits, 0, landing="direct", options=options):
    print("small reader allocated")
big = from_state_dict({"w": torch.zeros(2**20)})  # 4 MiB, two slots
try:
    WeightsReader(big, big, 0, landing="direct", options=options)
except ConfigError as exc:
    print("refused:", exc)
print("left in /dev/shm:", os.listdir("/dev/shm"))
"""


def test_a_reader_whose_shared_memory_is_too_small_names_the_fix_instead_of_dying_of_sigbus() -> None:
    """Docker gives a container 64 MB of /dev/shm, and touching a page past a tmpfs's size kills the process with
    SIGBUS ("Bus error", no traceback). Here /dev/shm is a 1 MiB tmpfs in a mount namespace of the child's own: a
    reader that fits allocates, one of 8 MiB refuses with the fix, the process lives, nothing is left behind."""
    import os
    import shlex
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a tmpfs of its own needs root and util-linux's unshare")
    script = f"mount -t tmpfs -o size=1M tmpfs /dev/shm && exec {shlex.quote(sys.executable)} -c {shlex.quote(_SMALL_SHM_CHILD)}"
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # 135 / -7: killed by SIGBUS
    assert "small reader allocated" in done.stdout
    assert "refused: shared memory is too small for this reader: its landing needs 8 MiB in /dev/shm" in done.stdout
    assert "--shm-size=2g" in done.stdout and "transport='tcp'" in done.stdout
    assert "left in /dev/shm: []" in done.stdout
