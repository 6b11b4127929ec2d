"""#58: every process of `rlsync bench --transports torchdist` ended printing gloo's C++ abort message ("terminate
called without an active exception"): their gloo groups were destroyed at interpreter exit, with threads running."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiproc

COMMON = """
import sys, time, torch
from rlsync import SyncOptions, WeightsReader, WeightsWriter
from rlsync.layouts import from_state_dict
weights = {"w": torch.arange(4096, dtype=torch.float32)}
layout, options = from_state_dict(weights), SyncOptions(transport="torchdist")
"""
WRITER = COMMON + """
writer = WeightsWriter(layout, None, 0, [sys.argv[1]], options=options)
for version in (1, 2):
    writer.multi_put({"w": weights["w"] * version})
    writer.complete(version)  # returns once the version is live in the reader
time.sleep(0.3)  # as the bench's writer: the reader is done and closes first
writer.close()
"""
READER = COMMON + """
reader = WeightsReader(layout, layout, 0, options=options)
print(reader.address, flush=True)
while reader.version < 2:
    time.sleep(0.01)
landed = torch.empty(4096)
reader.get("w", landed.numpy())
assert torch.equal(landed, weights["w"] * 2)
reader.close()  # and exits, while the writer is still connected (as the bench's reader does)
print("synced")
"""


def test_a_reader_and_a_writer_that_synced_over_torchdist_exit_without_a_cpp_abort() -> None:
    reader = subprocess.Popen([sys.executable, "-c", READER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert reader.stdout is not None
    address = reader.stdout.readline().strip()
    writer = subprocess.run([sys.executable, "-c", WRITER, address], capture_output=True, text=True, timeout=120)
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0 and out.strip() == "synced", err
    assert writer.returncode == 0, writer.stderr
    assert "terminate called" not in err + writer.stderr, err + writer.stderr
