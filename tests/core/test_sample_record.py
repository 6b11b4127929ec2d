"""The per-token record a sample carries besides versions and log-probs: the sampling mask's kept-set size and, for
MoE models, the routed experts of every MoE layer; compact on the wire (msgpack, the smallest unsigned dtype for
expert ids) and refused when its shape does not match the generated tokens."""

from __future__ import annotations

import numpy as np
import pytest

from rlsync import RolloutBufferError, Sample, decode_sample, encode_sample


def _sample(generated: int = 6, *, experts: int = 128, layers: int = 48, top_k: int = 8, **record: object) -> Sample:
    return Sample("p", np.arange(4 + generated, dtype=np.int32), 4, np.zeros(generated, np.float32),
                  np.ones(generated, np.int32), **record)  # type: ignore[arg-type]


def test_kept_sizes_and_routes_survive_the_wire_compactly() -> None:
    rng = np.random.default_rng(0)
    routes = rng.integers(0, 128, (6, 48, 8))
    kept = rng.integers(1, 50, 6)
    wire = encode_sample(_sample(kept=kept, routes=routes))
    back = decode_sample(wire)
    assert np.array_equal(back.routes, routes) and back.routes.dtype == np.uint8  # 128 experts: one byte per id
    assert np.array_equal(back.kept, kept)
    assert len(wire) < 6 * 48 * 8 + 400  # the routes dominate: a byte per expert id, a little framing
    wide = decode_sample(encode_sample(_sample(routes=np.full((6, 2, 2), 300))))
    assert wide.routes.dtype == np.uint16 and int(wide.routes.max()) == 300
    plain = decode_sample(encode_sample(_sample()))
    assert plain.kept is None and plain.routes is None


def test_a_record_that_does_not_match_the_tokens_is_refused() -> None:
    with pytest.raises(RolloutBufferError, match="kept-set sizes"):
        _sample(kept=np.ones(5))
    with pytest.raises(RolloutBufferError, match="routes of shape"):
        _sample(routes=np.zeros((6, 8)))
    with pytest.raises(RolloutBufferError, match="negative expert id"):
        encode_sample(_sample(routes=np.full((6, 1, 1), -1)))
