"""The Ray backend: the buffer runs in an actor of a local Ray instance started by the test."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from rlsync import (
    Sample,  # noqa: E402
    make_buffer,  # noqa: E402
)

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def sample(i: int, version: int) -> Sample:
    return Sample(f"p{i}", np.arange(24, dtype=np.int32), 8, np.full(16, -0.5, np.float32), np.full(16, version, np.int32))


def test_generators_and_trainer_through_the_actor(local_ray: None) -> None:
    buf = make_buffer("ray", name="rlsync-test-buffer", batch_size=4, max_staleness=1)
    try:
        def generate(version: int) -> None:
            for i in range(4):
                ticket = buf.admit(timeout=30)
                assert ticket is not None
                buf.put(sample(i, ticket.version), ticket)

        for version in range(3):
            t = threading.Thread(target=generate, args=(version,))
            t.start()
            batch = buf.get(timeout=30)
            t.join()
            assert batch is not None and len(batch) == 4
            assert all(int(lag.max()) <= 1 for lag in batch.version_lags())
            np.testing.assert_array_equal(batch.samples[0].tokens, np.arange(24))
            buf.publish(version + 1)
        other = type(buf).attach("rlsync-test-buffer")  # another process would attach the same way
        stats = other.stats()
        assert stats["consumed"] == 12 and stats["version"] == 3 and stats["in_flight"] == 0
    finally:
        buf.close()


def test_the_actors_episodes_keep_the_contract(local_ray: None) -> None:
    """``RayRolloutBuffer.episodes``: the ``EpisodeLog`` contract through the actor (its finish goes into the actor's
    buffer; the check's ``delivered`` takes batches of one from it), ``LeaseLostError`` reaching the caller as itself."""
    from rlsync.testing import check_episode_log

    names = iter(range(10))

    def make() -> tuple[object, object]:
        buf = make_buffer("ray", name=f"rlsync-episodes-{next(names)}", batch_size=1, max_staleness=100)

        def delivered() -> list[Sample]:
            out = []
            while (batch := buf.get(timeout=0.5)) is not None:
                out += batch.samples
            return out

        return buf.episodes, delivered

    check_episode_log(make)  # type: ignore[arg-type]
