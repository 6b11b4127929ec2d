"""A writer refused at connect is refused on both sides at once: the writer raises the reason, and an engine waiting
for a version (``StagedReceiver.next``) fails within a moment with the same reason instead of waiting out its timeout.
A wrong secret or a frame that is not a control message is refused (the writer hears why, the engine's ``refusal``
names it) without failing the engine's wait, and the reader goes on serving."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from rlsync import ConfigError, StagedReceiver, SyncOptions, TransportError, WeightMismatchError, WeightsWriter
from rlsync.layouts import engine_layout, from_state_dict

TENSORS = [["model.embed_tokens.weight", "float32", [16, 8]], ["model.norm.weight", "float32", [8]]]
STATE = {"model.embed_tokens.weight": torch.randn(16, 8), "model.norm.weight": torch.randn(8)}


class WaitingEngine:
    """The engine's thread, waiting for the next version as vLLM's ``update_weights`` does."""

    def __init__(self, receiver: StagedReceiver, timeout: float = 60.0) -> None:
        self.error: BaseException | None = None
        self.version: int | None = None
        self.waited = 0.0
        self._thread = threading.Thread(target=self._wait, args=(receiver, timeout), daemon=True)
        self._thread.start()

    def _wait(self, receiver: StagedReceiver, timeout: float) -> None:
        started = time.monotonic()
        try:
            version, views, finish = receiver.next(timeout)
            dict(views)
            finish(None)
            self.version = version
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc
        self.waited = time.monotonic() - started

    def join(self) -> None:
        self._thread.join(30)


def test_a_writer_built_for_another_layout_fails_the_waiting_engine_at_once_with_the_same_reason() -> None:
    with StagedReceiver(TENSORS) as receiver:
        engine = WaitingEngine(receiver)
        tied = [*TENSORS, ["lm_head.weight", "float32", [16, 8]]]  # the trainer's own idea of the engine's layout
        wrong = WeightsWriter(from_state_dict({**STATE, "lm_head.weight": STATE["model.embed_tokens.weight"]}), engine_layout(tied),
                              0, [receiver.address], options=SyncOptions(timeout=60))
        wrong.multi_put({**STATE, "lm_head.weight": STATE["model.embed_tokens.weight"]})
        with pytest.raises(WeightMismatchError, match=r"'lm_head.weight' is in the writer's and not in the engine's.*dst=None") as raised:
            wrong.complete(1)
        engine.join()
        assert isinstance(engine.error, ConfigError) and engine.waited < 2.0
        assert "'lm_head.weight' is in the writer's and not in the engine's" in str(engine.error)
        assert receiver.reader.refusal is not None and receiver.reader.refusal in str(raised.value)
        wrong.close()

        engine = WaitingEngine(receiver)  # the fix the error names: the writer learns the engine's layout
        right = WeightsWriter(from_state_dict(STATE), None, 0, [receiver.address])
        right.multi_put(STATE)
        right.complete(1)
        engine.join()
        assert engine.error is None and engine.version == 1 and receiver.reader.refusal is None
        right.close()


def test_without_a_refusal_the_engine_waits_its_timeout() -> None:
    with StagedReceiver(TENSORS) as receiver:
        engine = WaitingEngine(receiver, timeout=0.5)
        engine.join()
        assert "no weight version arrived within 0.5 s" in str(engine.error)


def test_a_wrong_secret_and_a_foreign_frame_are_refused_and_the_reader_goes_on() -> None:
    """The writer with the wrong secret hears why at once; the engine's ``last_rejection`` says it too, but nothing
    an unauthenticated frame (which is all a wrong secret sends) does touches what a waiting engine reads
    (``refusal``): any stranger that reaches the port could otherwise stop rollouts. The honest writer's version then
    lands in that wait."""
    options = SyncOptions(secret="Right-secret-of-enough-strength-0123")
    with StagedReceiver(TENSORS, options=options) as receiver:
        engine = WaitingEngine(receiver)
        with pytest.raises(TransportError, match="keys differ"):  # it asks the engine's layout: the answer is not signed its way
            WeightsWriter(from_state_dict(STATE), None, 0, [receiver.address],
                          options=SyncOptions(secret="Wrong-secret-of-enough-strength-0123", timeout=5))
        assert "keys differ" in str(receiver.reader.last_rejection) and receiver.reader.refusal is None
        time.sleep(0.2)  # the engine's wait looks at the refusal every 50 ms
        assert engine.error is None and engine.version is None

        rejected = receiver.reader.rejected
        probe = zmq.Context.instance().socket(zmq.DEALER)  # not an rlsync peer: one frame of garbage
        probe.setsockopt(zmq.LINGER, 0)
        probe.setsockopt(zmq.SNDTIMEO, 1000)
        probe.connect(receiver.address.split("#")[0])
        probe.send(b"\x00garbage")
        deadline = time.monotonic() + 5
        while receiver.reader.rejected == rejected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "failed the control socket's handshake" in str(receiver.reader.last_rejection)  # dropped there
        probe.close()

        writer = WeightsWriter(from_state_dict(STATE), None, 0, [receiver.address], options=options)
        writer.multi_put(STATE)
        writer.complete(1)
        engine.join()
        assert engine.error is None and engine.version == 1
        writer.close()


def test_a_verified_version_is_bound_to_the_digest_of_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlsync import VersionError, version_label

    options = SyncOptions(verify=True)
    with StagedReceiver(TENSORS, options=options) as receiver:
        writer = WeightsWriter(from_state_dict(STATE), None, 0, [receiver.address], options=options)
        labels = []
        for version, scale in ((1, 1.0), (2, 2.0)):
            engine = WaitingEngine(receiver)
            writer.multi_put({n: t * scale for n, t in STATE.items()})
            writer.complete(version)
            engine.join()
            assert receiver.reader.digest == writer.last_digests[0]  # what the engine checked is what was sent
            labels.append(version_label(version, [receiver.reader.digest]))
        assert labels[0].startswith("1+") and labels[1].startswith("2+") and labels[0][2:] != labels[1][2:]

        # a reader that reports another digest than the bytes this writer sent: the writer names both
        monkeypatch.setattr("rlsync.core.sync._reader_versions.digest", lambda sums: "0" * 16)
        engine = WaitingEngine(receiver)
        writer.multi_put(STATE)
        with pytest.raises(VersionError, match=r"version 3 live with digest 0{16}, but this writer sent digest [0-9a-f]{16}"):
            writer.complete(3)
        engine.join()
        writer.close()


def test_a_writer_without_checksums_is_refused_by_a_verifying_engine_naming_the_option() -> None:
    with StagedReceiver(TENSORS, options=SyncOptions(verify=True)) as receiver:
        engine = WaitingEngine(receiver)
        writer = WeightsWriter(from_state_dict(STATE), None, 0, [receiver.address])  # verify off
        writer.multi_put(STATE)
        with pytest.raises(WeightMismatchError, match=r"sends no checksums: build the trainer's writer with SyncOptions\(verify=True\)"):
            writer.complete(1)
        engine.join()
        assert isinstance(engine.error, ConfigError) and "SyncOptions(verify=True)" in str(engine.error)
        writer.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_reader_whose_landing_cannot_fit_in_memory_refuses_before_it_allocates(transport: str) -> None:
    """A landing larger than the host's available memory would get the engine killed by the kernel mid-version (no
    traceback): the reader refuses when it is built, saying what it needs and that one slot would do with less."""
    import glob
    import os

    from rlsync import TensorMeta, WeightsReader

    huge = from_state_dict([TensorMeta("w", "float32", (2**38,))])  # 1 TiB, two slots: no test machine has that
    before = set(glob.glob(f"/dev/shm/rlsync-{os.getpid()}-*"))
    with pytest.raises(ConfigError, match=r"reader rank 0: its landing needs 2048\.0 GiB of landing memory \(host; 2 "
                                          r"slot\(s\), landing='direct'\), and .* GiB are free here: refused \(landing="
                                          r"'staged' keeps one slot\)"):
        WeightsReader(huge, huge, 0, options=SyncOptions(transport=transport))
    assert set(glob.glob(f"/dev/shm/rlsync-{os.getpid()}-*")) == before  # nothing allocated
