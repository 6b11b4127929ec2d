"""One conformance suite for every registered transport: a writer process, a reader here, bytes verified."""

from __future__ import annotations

from typing import Any

import pytest

from rlsync import SyncOptions, WeightsReader

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("landing", ["direct", "staged"])
def test_versions_land_bytes_exactly(sync: Any, transport: str, landing: str) -> None:
    src, dst = sync.layouts("plain")
    seen: list[int] = []
    with WeightsReader(src, dst, 0, landing=landing, on_version=lambda v, bufs: seen.append(v), options=SyncOptions(transport=transport)) as reader:
        child = sync.writer("plain", transport, {0: reader.address}, [1, 2, 3], extra=("--checksum",))
        assert child.returncode == 0, child.stderr_text  # type: ignore[attr-defined]
        assert reader.version == 3
        assert seen == [1, 2, 3]
        sync.assert_landed("plain", reader, 3)


def test_caller_owned_get(sync: Any, transport: str) -> None:
    import numpy as np

    src, dst = sync.layouts("plain")
    with WeightsReader(src, dst, 0, options=SyncOptions(transport=transport)) as reader:
        sync.writer("plain", transport, {0: reader.address}, [7])
        out = np.empty((96, 64), np.uint16)
        reader.get("layer3.weight", out)
        np.testing.assert_array_equal(out, sync.values(src, 7)["layer3.weight"])
