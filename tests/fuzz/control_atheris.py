"""Coverage-guided fuzzing of a live reader's control plane with atheris (libFuzzer for Python): every control
message type, its fields chosen and filled by the fuzzer (wrong types, huge numbers, unknown fields, nesting), sent
as one to four frames from a peer that is not an rlsync writer but holds the reader's key (mostly in a session it
opened with a Knock, so that the input reaches the decoder and the handlers; sometimes outside a session, unsigned or
in a made-up session). After every input the peer opens a session and asks the reader for its layout and must get the
answer within 5 s: the reader neither crashed nor hung on what came before. rlsync's own
modules are instrumented, so inputs that reach new branches of the reader are kept and mutated further.

    python tests/fuzz/control_atheris.py -runs=20000        # counts per message type go to $RLSYNC_FUZZ_COUNTS
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import atheris

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/, for _support
with atheris.instrument_imports(include=["rlsync"]):
    from rlsync import StagedReceiver, SyncOptions

from _support.insider import ENVELOPE, Insider  # noqa: E402

import msgspec  # noqa: E402
import zmq  # noqa: E402

TENSORS = [["model.embed_tokens.weight", "float32", [16, 8]], ["model.norm.weight", "float32", [8]]]
TYPES = ["Knock", "Challenge", "Hello", "AskLayout", "LayoutIs", "Welcome", "Refuse", "Done", "Ack", "Begin", "Go", "Nonsense"]
FIELDS = ["writer_rank", "src_fingerprint", "dst_fingerprint", "dst_tensors", "session", "src", "delta", "checksums",
          "layout", "live_version", "reader_rank", "transport", "description", "next_slot", "inbox", "inbox_offset",
          "inbox_capacity", "reason", "kind", "version", "slot", "delta_base", "delta_nbytes", "canary", "digest",
          "tensors", "shards", "tokens", "logprobs", "tolerance", "nonce", "needs_src", "max_bytes"]
HUGE = [2**31, 2**40, 2**63 - 1, -(2**63), -1, 0, 2**64 - 1]
# each type's required fields and their types (rlsync/core/sync/_control.py), so that most inputs decode and reach the
# reader's handlers, where a wrong value is worse than a wrong type
REQUIRED = {"Knock": {"nonce": bytes}, "Challenge": {"session": int, "nonce": bytes}, "Hello": {"writer_rank": int, "src_fingerprint": str, "dst_fingerprint": str, "dst_tensors": dict},
            "AskLayout": {}, "LayoutIs": {"layout": dict}, "Refuse": {"reason": str},
            "Welcome": {"reader_rank": int, "transport": str, "description": dict, "live_version": int, "next_slot": int},
            "Done": {"writer_rank": int, "version": int, "slot": int}, "Ack": {"version": int, "next_slot": int},
            "Begin": {"writer_rank": int, "version": int}, "Go": {"version": int}, "Nonsense": {}}

receiver = StagedReceiver(TENSORS, options=SyncOptions(timeout=30))
peer = Insider(receiver.address)


counts = dict.fromkeys(TYPES, 0)
handled = dict.fromkeys(TYPES, 0)  # inputs that decoded: the reader's handler for the type ran
NOT_A_MESSAGE = ("a malformed control message", "a control message of", "a control message with a bad signature",
                 "a control message of an unknown session")


def value(data: atheris.FuzzedDataProvider, depth: int = 0) -> Any:
    pick = data.ConsumeIntInRange(0, 9 if depth < 3 else 6)
    if pick == 0:
        return None
    if pick == 1:
        return data.ConsumeBool()
    if pick == 2:
        return data.ConsumeIntInRange(-(2**63), 2**63 - 1)
    if pick == 3:
        return data.PickValueInList(HUGE)
    if pick == 4:
        return data.ConsumeRegularFloat()
    if pick == 5:
        return data.ConsumeUnicodeNoSurrogates(data.ConsumeIntInRange(0, 24))
    if pick == 6:
        return data.ConsumeBytes(data.ConsumeIntInRange(0, 64))
    if pick in (7, 8):
        return [value(data, depth + 1) for _ in range(data.ConsumeIntInRange(0, 4))]
    return {data.ConsumeUnicodeNoSurrogates(8): value(data, depth + 1) for _ in range(data.ConsumeIntInRange(0, 4))}


def typed(data: atheris.FuzzedDataProvider, kind: type) -> Any:
    if kind is int:
        return data.PickValueInList(HUGE) if data.ConsumeBool() else data.ConsumeIntInRange(-4, 2**20)
    if kind is str:
        return data.ConsumeUnicodeNoSurrogates(data.ConsumeIntInRange(0, 24))
    if kind is bytes:
        return data.ConsumeBytes(data.ConsumeIntInRange(0, 32))
    return {data.ConsumeUnicodeNoSurrogates(8): value(data, 1) for _ in range(data.ConsumeIntInRange(0, 4))}


def one_input(raw: bytes) -> None:
    data = atheris.FuzzedDataProvider(raw)
    kind = data.PickValueInList(TYPES)
    # mostly the right type per required field, sometimes anything
    fields = {name: typed(data, t) if data.ConsumeIntInRange(0, 7) else value(data) for name, t in REQUIRED[kind].items()}
    for _ in range(data.ConsumeIntInRange(0, 4)):
        name = data.PickValueInList(FIELDS) if data.ConsumeBool() else data.ConsumeUnicodeNoSurrogates(8)
        fields[name] = value(data)
    payload = msgspec.msgpack.encode({"type": kind, **fields})
    shape = data.ConsumeIntInRange(0, 8)
    in_session = shape < 4
    if in_session:  # a fresh session: a Hello or an AskLayout is taken only as its first message
        peer.knock(5000)
    frames = [lambda: peer.in_session(payload), lambda: peer.in_session(payload), lambda: peer.in_session(payload),
              lambda: peer.in_session(data.ConsumeBytes(256)), lambda: peer.pre_session(payload),
              lambda: [ENVELOPE.pack(data.ConsumeIntInRange(1, 2**63), 1), payload, data.ConsumeBytes(32)],
              lambda: [ENVELOPE.pack(0, 0), payload, data.ConsumeBytes(32)], lambda: [payload],
              lambda: [payload, b"", b"", b""]][shape]()
    peer.sock.send_multipart(frames)
    hostile_session = peer.session
    # the answers to the hostile frames in their session (a refusal, a layout for an AskLayout, or none for a type the
    # reader ignores), then the probe's layout in a session of its own
    try:
        peer.knock(5000)
    except TimeoutError:
        raise RuntimeError(f"the reader did not answer a Knock within 5 s after a {kind} input: {frames!r}"[:2000]) from None
    peer.send({"type": "AskLayout"})
    answers: list[dict[str, Any]] = []
    while True:
        if not peer.sock.poll(5000):
            raise RuntimeError(f"the reader did not answer within 5 s after a {kind} input: {frames!r}"[:2000])
        envelope, body, _ = peer.sock.recv_multipart()
        session = ENVELOPE.unpack(envelope)[0]
        if session == peer.session:
            break
        if in_session and session == hostile_session:
            answers.append(msgspec.msgpack.decode(body))
    decoded = in_session and not any(a.get("type") == "Refuse" and a["reason"].startswith(NOT_A_MESSAGE) for a in answers)
    counts[kind] += 1
    handled[kind] += decoded
    if sum(counts.values()) % 100 == 0 and os.environ.get("RLSYNC_FUZZ_COUNTS"):
        with open(os.environ["RLSYNC_FUZZ_COUNTS"], "w") as out:
            json.dump({"inputs": counts, "handled": handled}, out)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
