"""Delta versions (``WeightsWriter(options=SyncOptions(wire="delta"))``): only changed values cross, the reader ends bit-exact."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from rlsync import SyncOptions, TensorMeta, WeightsReader, WeightsWriter
from rlsync.core import ChangeLog
from rlsync.core import apply_delta as apply
from rlsync.core import encode_delta as encode
from rlsync.layouts import from_state_dict

pytestmark = pytest.mark.multiproc


def _sent(child: Any) -> list[int]:
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    return [json.loads(line)["bytes"] for line in out.splitlines()]


@pytest.mark.parametrize("landing", ["direct", "staged"])
def test_two_trainer_ranks_send_deltas_into_two_tp_ranks_bit_exact(sync: Any, transport: str, landing: str) -> None:
    """FSDP over 2 ranks -> TP=2 with fused buffers (many runs per buffer), checksums on: every version lands
    exactly; after the first full send into each slot, each writer moves a fraction of its bytes."""
    src, dst = sync.layouts("fsdp2_tp2")
    readers = [WeightsReader(src, dst, r, landing=landing, options=SyncOptions(transport=transport, verify=True)) for r in (0, 1)]
    try:
        addresses = {r.rank: r.address for r in readers}
        writers = [sync.writer("fsdp2_tp2", transport, addresses, [1, 2, 3, 4, 5], rank=w, wait=False,
                               extra=("--delta", "--checksum")) for w in (0, 1)]
        sent = [_sent(w) for w in writers]
        for reader in readers:
            assert reader.version == 5
            sync.assert_landed("fsdp2_tp2", reader, 5, delta=True)
        full = [s[0] for s in sent]
        for mine, whole in zip(sent, full):
            # from version 2 on, deltas of one step (direct: the reader first copies its live slot into the other):
            # 2 % of the values change per version, random bits here (compressed: positions, and the XOR of the bits)
            assert mine[0] == whole and all(0 < n < whole * 0.1 for n in mine[1:]), (mine, whole)
    finally:
        for reader in readers:
            reader.close()


PLAIN = [TensorMeta("w", "bfloat16", (64, 128)), TensorMeta("b", "float32", (128,))]


def _tensors(version: int, share: float) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(7)
    w, b = torch.randn(64, 128, generator=gen).to(torch.bfloat16), torch.randn(128, generator=gen)
    for k in range(1, version + 1):
        g = torch.Generator().manual_seed(100 + k)
        mask = torch.rand(w.shape, generator=g) < share
        w = torch.where(mask, w + 1, w)
        b = b + (torch.rand(b.shape, generator=g) < share) * 1.0
    return {"w": w.contiguous(), "b": b.contiguous()}


def test_a_delta_larger_than_the_inbox_is_sent_in_full() -> None:
    layout = from_state_dict(PLAIN)
    with WeightsReader(layout, layout, 0, landing="staged") as reader, WeightsWriter(layout, layout, 0, [reader.address], options=SyncOptions(wire="delta")) as writer:
        sizes = []
        for version, share in ((1, 0.0), (2, 0.01), (3, 0.5)):
            tensors = _tensors(version, share)
            writer.multi_put(tensors)
            writer.complete(version)
            sizes.append(writer.last_bytes)
            live = reader.buffers()
            for name, t in tensors.items():
                assert live[name].tobytes() == _raw(t), f"{name} v{version}"
        assert sizes[0] == writer.bytes_per_version
        assert 0 < sizes[1] < writer.bytes_per_version * 0.1
        assert sizes[2] == writer.bytes_per_version  # half the values changed: a delta would be larger


def _raw(t: Any) -> bytes:
    import torch

    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_reader_that_lost_track_of_its_slot_gets_the_version_in_full() -> None:
    """The reader refuses a delta against a slot it cannot vouch for; the writer resends in full, no error."""
    layout = from_state_dict(PLAIN)
    with WeightsReader(layout, layout, 0, landing="staged") as reader, WeightsWriter(layout, layout, 0, [reader.address], options=SyncOptions(wire="delta")) as writer:
        for version in (1, 2):
            writer.multi_put(_tensors(version, 0.01))
            writer.complete(version)
        assert writer.last_bytes < writer.bytes_per_version
        reader._held.clear()  # as if its slot had been touched behind the writer's back
        tensors = _tensors(3, 0.01)
        writer.multi_put(tensors)
        writer.complete(3)
        assert reader.version == 3 and writer.last_bytes == writer.bytes_per_version
        assert reader.buffers()["b"].view(np.float32).tolist() == tensors["b"].tolist()


def test_encode_apply_round_trip_over_strided_runs_and_segments() -> None:
    import torch

    rng = np.random.default_rng(0)
    source = torch.from_numpy(rng.integers(0, 2**16, 1000, dtype=np.uint16).view(np.int16))
    region = torch.zeros(4096, dtype=torch.uint8)
    runs = [(0, 2048, 400), (400, 0, 1000), (1400, 1024, 600)]  # bytes: out of order in the region
    changed = torch.from_numpy(np.sort(rng.choice(1000, 50, replace=False)))
    sources = {"x": source.view(torch.uint8)}
    payload = encode([("x", runs)], {"x": changed}, sources, {"x": 2}, capacity=10_000)
    assert payload is not None and int(payload[:8].view(torch.int64)) == 1  # one segment: the region is small
    assert payload.numel() < 8 + 40 + 50 * 6  # positions as gaps and values, compressed: below the raw 6 bytes each
    assert apply(payload, region) == 50
    for s, d, n in runs:
        got = region[d : d + n].view(torch.int16)
        want = source[s // 2 : (s + n) // 2]
        mask = torch.isin(torch.arange(s // 2, (s + n) // 2), changed)
        assert torch.equal(got[mask], want[mask])
        assert not got[~mask].any()
    assert encode([("x", runs)], {"x": changed}, sources, {"x": 2}, capacity=100) is None
    assert encode([("x", runs)], {"x": None}, sources, {"x": 2}, capacity=10_000) is None


@pytest.mark.parametrize("compress", [True, False], ids=["zstd", "planes"])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_encode_apply_round_trip_for_every_item_size_in_both_modes(itemsize: int, compress: bool) -> None:
    """New bits (mode 0) and old-XOR-new bits (mode 1) of 1-, 2-, 4- and 8-byte values, every bit pattern
    (negative, all ones), land bit-exact, compressed (a slow link) or not (a fast one: mode bit 2)."""
    import torch

    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    gen = torch.Generator().manual_seed(itemsize)
    old = torch.randint(0, 256, (4096 * itemsize,), dtype=torch.uint8, generator=gen)
    new = old.clone()
    changed = torch.sort(torch.randperm(4096, generator=gen)[:300]).values
    new.view(word)[changed] = torch.randint(0, 256, (300 * itemsize,), dtype=torch.uint8, generator=gen).view(word)
    new.view(word)[changed[:2]] = torch.tensor([-1, 0], dtype=torch.int64).to(word) if itemsize > 1 else torch.tensor([255, 0], dtype=torch.uint8)
    changed = changed[new.view(word)[changed] != old.view(word)[changed]]
    runs = [(0, 0, new.numel())]
    flips = old.view(word)[changed] ^ new.view(word)[changed]
    for mode_flips in (None, {"w": flips}):
        payload = encode([("w", runs)], {"w": changed}, {"w": new}, {"w": itemsize}, 1 << 20, mode_flips, compress)
        assert payload is not None
        mode = int(payload[8:48].view(torch.int64)[3])
        assert mode == (0 if mode_flips is None else 1) | (0 if compress else 2)
        region = old.clone() if mode_flips else torch.zeros_like(old)
        assert apply(payload, region) == changed.numel()
        assert torch.equal(region.view(word)[changed], new.view(word)[changed])
        assert torch.equal(region, new) or not mode_flips


def test_a_bad_delta_is_refused_before_a_byte_is_written() -> None:
    """A segment whose positions reach past the region, or headers that do not fit the payload: ValueError, and
    the region is unchanged (a delta is checked whole before any of it is applied)."""
    import torch

    source = torch.arange(64, dtype=torch.int16)
    sources = {"x": source.view(torch.uint8)}
    changed = torch.tensor([1, 2, 60])
    payload = encode([("x", [(0, 0, 128)])], {"x": changed}, sources, {"x": 2}, capacity=10_000)
    assert payload is not None
    region = torch.zeros(128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="reaches past"):
        apply(payload, region[:100])
    assert not region.any()
    with pytest.raises(ValueError, match="cannot hold"):
        apply(payload[:20], region)
    forged = payload.clone()
    forged[8:16].view(torch.int64)[0] = 10_000  # the first segment's base
    with pytest.raises(ValueError, match="reaches past"):
        apply(forged, region)
    assert not region.any()
    assert apply(payload, region) == 3 and region.view(torch.int16)[[1, 2, 60]].tolist() == [1, 2, 60]


@pytest.mark.parametrize("together", [False, True], ids=["one_by_one", "together"])
def test_change_log_unions_versions_since_a_base_and_forgets_old_ones(together: bool) -> None:
    import torch

    a = torch.zeros(8, dtype=torch.int16)
    log = ChangeLog({"a": 2}, depth=3, together=together)
    log.record(1, {"a": a.view(torch.uint8)})
    assert log.since(1, "a").tolist() == [] and log.since(0, "a") is None
    a[2] = 1
    log.record(2, {"a": a.view(torch.uint8)})
    a[5] = 1
    log.record(3, {"a": a.view(torch.uint8)})
    assert log.since(2, "a").tolist() == [5] and log.since(1, "a").tolist() == [2, 5]
    a[2] = 0  # a value that changes back still counts as changed since version 1
    log.record(4, {"a": a.view(torch.uint8)})
    assert log.since(1, "a") is None  # forgotten (depth 3)
    assert log.since(2, "a").tolist() == [2, 5]


@pytest.mark.parametrize("together", [False, True], ids=["one_by_one", "together"])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("shift", [0, 1])
def test_change_log_finds_every_changed_element_across_words_chunks_and_the_tail(itemsize: int, shift: int,
                                                                                 together: bool) -> None:
    """``record`` compares 64-bit words first, in chunks of 2**20 words, then the elements of changed words: the
    changes and flips it finds equal an element-by-element compare, across a chunk boundary, in the elements past
    the last whole word, and in buffers that do not start on a word (``shift``: the element-by-element path).
    ``together`` (what a GPU's sources get): the same through one flat copy and one mask."""
    import torch

    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    count = (2**20 * 8 + 8) // itemsize + 3  # past the first chunk, and 3 elements past the last whole word
    storage = torch.zeros((count + shift) * itemsize, dtype=torch.uint8)
    raw = storage[shift * itemsize :]  # the buffer as a writer's source: uint8, maybe starting inside a word
    gen = torch.Generator().manual_seed(itemsize)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen))
    log = ChangeLog({"w": itemsize}, depth=3, together=together)
    log.record(1, {"w": raw})
    before = raw.view(word).clone()
    picks = torch.randint(0, count, (5000,), generator=gen)
    edges = torch.tensor([0, 2**20 * 8 // itemsize - 1, 2**20 * 8 // itemsize, count - 3, count - 1])
    chosen = torch.cat([picks, edges])
    raw.view(word)[chosen] ^= torch.randint(1, 127, (chosen.numel(),), generator=gen).to(word)
    raw.view(word)[picks[:100]] = before[picks[:100]]  # changed and changed back: no change
    log.record(2, {"w": raw})
    expected = torch.nonzero(raw.view(word) != before).flatten()
    assert expected.numel() > 4000 and {int(e) for e in edges} <= set(expected.tolist())
    assert torch.equal(log.since(1, "w"), expected)
    assert torch.equal(log.flips(1, "w"), before[expected] ^ raw.view(word)[expected])
    log.record(3, {"w": raw})  # the log's copy took the new bits: nothing changed since
    assert log.since(2, "w").numel() == 0


def test_a_refused_delta_version_leaves_the_old_one_and_the_next_lands_exact() -> None:
    """The engine refuses version 3 (its loader fails) after the delta was written into its slot: version 2 stays
    live in the engine, and version 4 is sent in full (the slot's content is no longer known) and lands exact."""
    from rlsync import RlsyncError

    layout = from_state_dict(PLAIN)
    loaded: dict[int, bytes] = {}

    def load(version: int, buffers: dict[str, np.ndarray]) -> None:
        if version == 3:
            raise RuntimeError("the engine ran out of memory")
        loaded[version] = buffers["w"].tobytes()

    with WeightsReader(layout, layout, 0, landing="staged", on_version=load) as reader, \
            WeightsWriter(layout, layout, 0, [reader.address], options=SyncOptions(wire="delta")) as writer:
        for version in (1, 2):
            writer.multi_put(_tensors(version, 0.01))
            writer.complete(version)
        writer.multi_put(_tensors(3, 0.01))
        with pytest.raises(RlsyncError, match="failed to load version 3"):
            writer.complete(3)
        assert reader.version == 2 and loaded[2] == _raw(_tensors(2, 0.01)["w"])
        tensors = _tensors(4, 0.01)
        writer.multi_put(tensors)
        writer.complete(4)
        assert writer.last_bytes == writer.bytes_per_version
        assert reader.version == 4 and loaded[4] == _raw(tensors["w"])
        assert reader.buffers()["b"].tobytes() == _raw(tensors["b"])


def test_one_step_deltas_carry_the_xor_of_old_and_new_bits() -> None:
    """``ChangeLog.flips`` is there for one step only; with it the delta carries old XOR new (mode 1), which turns a
    region holding the base into the new version, bit for bit, and is smaller than the new bits themselves."""
    import torch

    gen = torch.Generator().manual_seed(3)
    base = torch.randn(4096, generator=gen).to(torch.bfloat16)
    new = base.clone()
    moved = torch.rand(4096, generator=gen) < 0.05
    new[moved] = (new[moved].float() * (1 + 2**-8)).to(torch.bfloat16)  # a small step: a low mantissa bit or two
    log = ChangeLog({"w": 2}, depth=3)
    log.record(1, {"w": base.view(torch.uint8)})
    assert log.flips(0, "w") is None and log.flips(1, "w") is None  # one version recorded: no step yet
    log.record(2, {"w": new.view(torch.uint8)})
    changed, flips = log.since(1, "w"), log.flips(1, "w")
    assert flips is not None and torch.equal(flips, base.view(torch.int16)[changed] ^ new.view(torch.int16)[changed])
    log.record(3, {"w": new.view(torch.uint8)})
    assert log.flips(1, "w") is None  # two steps back: the new bits are sent instead
    runs, sources = [(0, 0, 8192)], {"w": new.view(torch.uint8)}
    xor = encode([("w", runs)], {"w": changed}, sources, {"w": 2}, 1 << 20, {"w": flips})
    plain = encode([("w", runs)], {"w": changed}, sources, {"w": 2}, 1 << 20)
    assert xor is not None and plain is not None and xor[8:48].view(torch.int64)[3] == 1 and xor.numel() < plain.numel()
    region = base.clone().view(torch.uint8)
    assert apply(xor, region) == changed.numel() and torch.equal(region, new.view(torch.uint8))


def _payload(base: int, count: int, planes: bytes, *, itemsize: int = 2, mode: int = 0, size: int | None = None) -> Any:
    """A delta of one segment whose frame holds ``planes``: zstd-compressed (saying it holds ``size`` bytes, when
    given), or as they are where ``mode`` has bit 2 (an uncompressed segment)."""
    import torch

    try:
        from compression import zstd  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        from backports import zstd  # type: ignore[no-redef, unused-ignore]
    if mode & 2:
        frame = planes
    elif size is None:
        frame = zstd.compress(planes)
    else:  # a frame that does not say its decompressed size
        frame = zstd.ZstdCompressor(options={zstd.CompressionParameter.content_size_flag: 0}).compress(planes, zstd.ZstdCompressor.FLUSH_FRAME)
    padded = bytes(frame) + bytes(-len(frame) % 8)
    head = torch.tensor([1, base, itemsize, count, mode, len(frame)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([head, torch.frombuffer(bytearray(padded), dtype=torch.uint8)])


def test_a_delta_that_lies_is_refused_and_writes_nothing() -> None:
    """Frames that do not hold what their header says, positions that repeat, more values than the region holds:
    ``ValueError`` before a byte of the region changes."""
    import torch

    region = torch.zeros(64, dtype=torch.uint8)
    gaps = np.array([1, 2], np.uint32).view(np.uint8).reshape(2, 4).T.tobytes()
    values = np.array([7, 8], np.int16).view(np.uint8).reshape(2, 2).T.tobytes()
    assert apply(_payload(0, 2, gaps + values), region) == 2 and region.view(torch.int16)[[1, 3]].tolist() == [7, 8]
    region.zero_()
    with pytest.raises(ValueError, match="not a zstd frame of 12 bytes"):
        apply(_payload(0, 2, gaps + values, size=0), region)  # no content size in the frame
    with pytest.raises(ValueError, match="not a zstd frame of 18 bytes"):
        apply(_payload(0, 3, gaps + values), region)  # says 3 values, holds 2
    repeated = np.array([1, 0], np.uint32).view(np.uint8).reshape(2, 4).T.tobytes()
    with pytest.raises(ValueError, match="not increasing"):
        apply(_payload(0, 2, repeated + values), region)
    with pytest.raises(ValueError, match="claims 80 bytes of values, more than the 64-byte region"):
        apply(_payload(0, 40, bytes(40 * 6)), region)  # 40 values of 2 bytes: more than 64 bytes hold (checked first)
    with pytest.raises(ValueError, match="is not a segment"):
        apply(_payload(0, 2, gaps + values, mode=4), region)
    assert not region.any()


def test_an_uncompressed_delta_that_lies_is_refused_and_writes_nothing() -> None:
    """The planes of a fast link's delta go as they are: a frame of another size than its values need, positions
    that repeat, a position past the region: ``ValueError``, and the region is unchanged."""
    import torch

    region = torch.zeros(64, dtype=torch.uint8)
    gaps = np.array([1, 2], np.uint32).view(np.uint8).reshape(2, 4).T.tobytes()
    values = np.array([7, 8], np.int16).view(np.uint8).reshape(2, 2).T.tobytes()
    assert apply(_payload(0, 2, gaps + values, mode=2), region) == 2 and region.view(torch.int16)[[1, 3]].tolist() == [7, 8]
    region.zero_()
    with pytest.raises(ValueError, match="13 bytes of planes, 12 for 2 values"):
        apply(_payload(0, 2, gaps + values + b"x", mode=2), region)
    repeated = np.array([1, 0], np.uint32).view(np.uint8).reshape(2, 4).T.tobytes()
    with pytest.raises(ValueError, match="not increasing"):
        apply(_payload(0, 2, repeated + values, mode=2), region)
    far = np.array([1, 40], np.uint32).view(np.uint8).reshape(2, 4).T.tobytes()
    with pytest.raises(ValueError, match="reaches past"):
        apply(_payload(0, 2, far + values, mode=2), region)
    assert not region.any()


def test_many_buffers_of_one_item_size_go_as_one_segment_and_land_exact() -> None:
    """A model's tensors, listed in another order than they sit in the reader's region, one of them fp32 and one
    sent as new bits rather than XOR: one segment per (item size, mode), every value where it belongs. Buffers whose
    runs interleave in the region (one's runs around another's) land exact too."""
    import torch

    gen = torch.Generator().manual_seed(5)
    word = {2: torch.int16, 4: torch.int32}
    sizes = {"a": 300, "b": 500, "c": 200, "f": 100}  # elements; "f" is fp32
    itemsizes = {n: 4 if n == "f" else 2 for n in sizes}
    old = {n: torch.randint(0, 256, (k * itemsizes[n],), dtype=torch.uint8, generator=gen) for n, k in sizes.items()}
    new = {n: t.clone() for n, t in old.items()}
    changed = {}
    for n, t in new.items():
        idx = torch.sort(torch.randperm(sizes[n], generator=gen)[: sizes[n] // 10]).values
        t.view(word[itemsizes[n]])[idx] ^= 1 << 3  # a flipped mantissa bit: the bits differ
        changed[n] = idx
    flips: dict[str, Any] = {n: old[n].view(word[itemsizes[n]])[changed[n]] ^ new[n].view(word[itemsizes[n]])[changed[n]]
                             for n in sizes}
    flips["c"] = None  # "c" goes as new bits (mode 0), the others as XOR
    # region: c, then a, then f, then b (bytes); groups listed a, b, c, f
    at = {"c": 0, "a": 400, "f": 1000, "b": 1400}
    groups = [(n, [(0, at[n], sizes[n] * itemsizes[n])]) for n in ("a", "b", "c", "f")]
    region_old = torch.zeros(2400, dtype=torch.uint8)
    for n in sizes:
        region_old[at[n] : at[n] + old[n].numel()] = old[n]
    for compress in (True, False):
        payload = encode(groups, changed, new, itemsizes, 1 << 20, flips, compress)
        assert payload is not None
        headers = payload[8:].view(torch.int64)[: 5 * int(payload[:8].view(torch.int64))].reshape(-1, 5).tolist()
        assert sorted((h[1], h[3] & 1) for h in headers) == [(2, 0), (2, 1), (4, 1)]  # (item size, XOR): 3 segments
        region = region_old.clone()
        assert apply(payload, region) == sum(len(i) for i in changed.values())
        for n in sizes:
            assert torch.equal(region[at[n] : at[n] + new[n].numel()], new[n]), (compress, n)
    # interleaved: "a" runs at [0, 200) and [600, 1000) bytes, "b" fills [200, 600): sorted on the way
    runs_a, runs_b = [(0, 0, 200), (200, 600, 400)], [(0, 200, 400), (400, 1000, 600)]
    payload = encode([("a", runs_a), ("b", runs_b)], changed, new, itemsizes, 1 << 20, None, False)
    assert payload is not None
    region = torch.zeros(1600, dtype=torch.uint8)
    apply(payload, region)
    for name, runs in (("a", runs_a), ("b", runs_b)):
        for s, d, n in runs:
            got, want = region[d : d + n].view(torch.int16), new[name][s : s + n].view(torch.int16)
            mask = torch.isin(torch.arange(s // 2, (s + n) // 2), changed[name])
            assert torch.equal(got[mask], want[mask]), (name, s)


def test_positions_spanning_more_than_2_to_the_32_elements_are_split_into_segments() -> None:
    """Gaps are uint32: two buffers 2**32 elements apart in the reader's region go as two segments, each from its
    first change (the region itself is not needed to encode: the runs say where the buffers land)."""
    import torch

    source = torch.arange(64, dtype=torch.int16).view(torch.uint8)
    changed = {"a": torch.tensor([3, 9]), "b": torch.tensor([1, 60])}
    far = 2**33 + 64  # bytes: element 2**32 + 32 of a 2-byte region
    groups = [("a", [(0, 0, 128)]), ("b", [(0, far, 128)])]
    payload = encode(groups, changed, {"a": source, "b": source}, {"a": 2, "b": 2}, 1 << 20, None, False)
    assert payload is not None
    headers = payload[8:88].view(torch.int64).reshape(2, 5).tolist()
    assert [(base, count) for base, _, count, _, _ in headers] == [(3, 2), (far // 2 + 1, 2)]


def test_buffers_compared_together_find_what_one_by_one_finds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU's sources are compared together, in flat copies (here of at most 1000 elements, so that 30 buffers of
    2- and 4-byte values need several, and a buffer larger than that gets one alone): per buffer, the same changes
    and flips as buffer by buffer, version after version; buffers that change size are laid out again (unknown once)."""
    import torch

    monkeypatch.setattr("rlsync.core.sync._delta._FLAT_ELEMENTS", 1000)
    gen = torch.Generator().manual_seed(11)
    sizes = {f"t{i}": int(torch.randint(1, 300, (1,), generator=gen)) for i in range(30)}
    sizes["big"] = 2500
    itemsizes = {n: 4 if i % 3 == 0 else 2 for i, n in enumerate(sizes)}
    raw = {n: torch.randint(0, 256, (k * itemsizes[n],), dtype=torch.uint8, generator=gen) for n, k in sizes.items()}
    together, one_by_one = ChangeLog(itemsizes, together=True), ChangeLog(itemsizes, together=False)
    for version in range(1, 5):
        for n, t in raw.items():
            picks = torch.randint(0, t.numel(), (max(1, t.numel() // 20),), generator=gen)
            t[picks] ^= torch.randint(1, 256, (picks.numel(),), dtype=torch.uint8, generator=gen)
        together.record(version, raw)
        one_by_one.record(version, raw)
        for n in sizes:
            a, b = together.since(version - 1, n), one_by_one.since(version - 1, n)
            assert (a is None) == (b is None) == (version == 1), (version, n)
            if a is not None:
                assert torch.equal(a, b) and torch.equal(together.flips(version - 1, n), one_by_one.flips(version - 1, n))
    raw["t0"] = torch.zeros(8, dtype=torch.uint8)  # another size: laid out again
    together.record(5, raw)
    assert together.since(4, "t0") is None and together.since(4, "t1") is None
    together.record(6, raw)
    assert together.since(5, "t1").numel() == 0


def test_a_segment_holds_at_most_so_many_values_and_the_pieces_land_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the host a segment holds at most ``_HOST_SEGMENT`` values (cache-sized pieces; here 7): 50 changes go as
    8 segments, each counting from the buffer's start, and land exact, compressed or not."""
    import torch

    monkeypatch.setattr("rlsync.core.sync._delta._HOST_SEGMENT", 7)
    new = torch.arange(300, dtype=torch.int16)
    changed = torch.sort(torch.randperm(300, generator=torch.Generator().manual_seed(2))[:50]).values
    for compress in (True, False):
        payload = encode([("w", [(0, 0, 600)])], {"w": changed}, {"w": new.view(torch.uint8)}, {"w": 2}, 1 << 20,
                         None, compress)
        assert payload is not None and int(payload[:8].view(torch.int64)) == 8
        region = torch.zeros(600, dtype=torch.uint8)
        assert apply(payload, region) == 50
        assert torch.equal(region.view(torch.int16)[changed], new[changed])
        assert int(region.view(torch.int16).count_nonzero()) == int(new[changed].count_nonzero())


def test_segments_cut_across_many_buffers_land_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers that follow each other in the region are read as one sequence without being joined: segments of 7
    values start and end inside buffers, cover several, and pass over buffers without a change; every value lands."""
    import torch

    monkeypatch.setattr("rlsync.core.sync._delta._HOST_SEGMENT", 7)
    gen = torch.Generator().manual_seed(5)
    sizes = [int(torch.randint(1, 40, (1,), generator=gen)) for _ in range(12)]
    new = {f"b{i}": torch.randint(-2**15, 2**15, (n,), dtype=torch.int16, generator=gen) for i, n in enumerate(sizes)}
    changed = {name: torch.sort(torch.randperm(t.numel(), generator=gen)[: t.numel() // 3]).values for name, t in new.items()}
    changed["b4"] = changed["b4"][:0]  # a buffer with no change between others
    groups, at = [], 0
    for name, t in new.items():
        groups.append((name, [(0, at, 2 * t.numel())]))
        at += 2 * t.numel()
    total = sum(len(c) for c in changed.values())
    for compress in (True, False):
        payload = encode(groups, changed, {n: t.view(torch.uint8) for n, t in new.items()}, dict.fromkeys(new, 2),
                         1 << 20, None, compress)
        assert payload is not None and int(payload[:8].view(torch.int64)) == -(-total // 7)
        region = torch.zeros(at, dtype=torch.uint8)
        assert apply(payload, region) == total
        for (name, [(_, start, nbytes)]) in groups:
            got = region[start : start + nbytes].view(torch.int16)
            assert torch.equal(got[changed[name]], new[name][changed[name]]), name
            assert int(got.count_nonzero()) == int(new[name][changed[name]].count_nonzero()), name


def test_buffers_of_alternating_types_are_compared_in_one_flat_per_type() -> None:
    """A model's bf16 weights between fp32 norms: one flat copy (one wait for the device) per element type, not one
    per change of type along the model."""
    import torch

    raw = {f"l{i}.{kind}": torch.zeros(64 if kind == "w" else 16, dtype=torch.uint8) for i in range(10) for kind in ("w", "norm")}
    itemsizes = {n: 2 if n.endswith(".w") else 4 for n in raw}
    log = ChangeLog(itemsizes, together=True)
    log.record(1, raw)
    assert sorted(str(flat.values.dtype) for flat in log._flat) == ["torch.int16", "torch.int32"]
    raw["l7.norm"][4] = 1
    log.record(2, raw)
    assert log.since(1, "l7.norm").tolist() == [1] and all(log.since(1, n).numel() == 0 for n in raw if n != "l7.norm")


@pytest.mark.parametrize("together", [False, True], ids=["one_by_one", "together"])
@pytest.mark.parametrize("moved", ["one_buffer", "most_of_the_model"])
def test_a_version_that_moved_most_of_the_model_is_recorded_as_all_of_it(together: bool, moved: str) -> None:
    """A step that moves most of the model keeps no positions (8 bytes each: four times a bf16 model, per version):
    ``since`` says unknown (sent in full) for every buffer, the copy still takes the new bits, and the next small
    step is a delta again. A buffer that moves alone (a norm, all of whose values a first Adam step moves) keeps
    its positions: the version's delta still fits."""
    import torch

    sizes = {"big": 4000, "small": 1000, "other": 5000}
    raw = {n: torch.zeros(k * 2, dtype=torch.uint8) for n, k in sizes.items()}
    words = {n: t.view(torch.int16) for n, t in raw.items()}
    log = ChangeLog(dict.fromkeys(sizes, 2), depth=4, together=together)
    log.record(1, raw)
    words["small"][:] = 1  # all of it
    words["big"][7] = 1
    if moved == "most_of_the_model":
        words["big"][2000:] = 1
        words["other"][:] = 1
    log.record(2, raw)
    if moved == "most_of_the_model":
        assert all(log.since(1, n) is None and log.flips(1, n) is None for n in sizes)
    else:
        assert log.since(1, "small").tolist() == list(range(1000)) and log.since(1, "other").numel() == 0
        assert log.since(1, "big").tolist() == [7] and log.flips(1, "big").tolist() == [1]
    words["big"][3] = 2
    log.record(3, raw)
    assert log.since(2, "big").tolist() == [3] and log.flips(2, "big").tolist() == [2]
    assert log.since(2, "other").numel() == 0 and (log.since(1, "big") is None) == (moved == "most_of_the_model")


@pytest.mark.parametrize("together", [False, True], ids=["one_by_one", "together"])
def test_the_positions_a_change_log_keeps_stay_below_the_size_of_its_copy(together: bool) -> None:
    """Versions that each move a third of the elements: the log forgets old bases before their positions (8 bytes
    each, 2 bytes of copy) outgrow the copy, keeping the one step a delta always needs."""
    import torch

    from rlsync.core.sync._delta import _held

    raw = torch.zeros(3000 * 2, dtype=torch.uint8)
    log = ChangeLog({"w": 2}, depth=8, together=together)
    log.record(1, {"w": raw})
    for version in range(2, 8):
        raw.view(torch.int16)[version % 3 :: 3] += 1
        log.record(version, {"w": raw})
        assert _held(log._history) <= raw.numel() or len(log._history) == 2
        assert log.since(version - 1, "w").numel() == 1000
    assert log.since(1, "w") is None and log.since(5, "w") is None  # forgotten: a reader that far behind gets it all


@pytest.mark.parametrize("over,said", [("shm", True), ("tcp", False)])
def test_a_delta_over_a_transport_where_full_versions_land_sooner_is_named(caplog: pytest.LogCaptureFixture,
                                                                          over: str, said: bool) -> None:
    """Delta over shared memory (or cuda_ipc) is slower than sending everything: the writer says so and names
    ``wire='full'``; over tcp, where it pays below a few Gbit/s, it says nothing."""
    layout = from_state_dict([TensorMeta("w", "bfloat16", (64, 64))])
    with caplog.at_level("WARNING", logger="rlsync"):
        WeightsWriter(layout, layout, 0, {0: "tcp://127.0.0.1:9"}, options=SyncOptions(transport=over, wire="delta")).close()
    named = [r.getMessage() for r in caplog.records if "wire='delta'" in r.getMessage()]
    assert bool(named) == said and all("wire='full' here" in m for m in named)
