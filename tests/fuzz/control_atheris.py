"""Coverage-guided fuzzing of a live reader's control plane with atheris (libFuzzer for Python): every control
message type, its fields chosen and filled by the fuzzer (wrong types, huge numbers, unknown fields, nesting), sent
as one to four frames from a peer that is not an rlsync writer but holds the reader's key (mostly signed, so that the
input reaches the decoder and the handlers; sometimes unsigned or in a made-up session). After every input the peer asks the reader for its
layout and must get the answer within 5 s: the reader neither crashed nor hung on what came before. rlsync's own
modules are instrumented, so inputs that reach new branches of the reader are kept and mutated further.

    python tests/fuzz/control_atheris.py -runs=20000        # counts per message type go to $RLSYNC_FUZZ_COUNTS
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import sys
from typing import Any

import atheris

with atheris.instrument_imports(include=["rlsync"]):
    from rlsync import StagedReceiver, SyncOptions

import msgspec  # noqa: E402
import zmq  # noqa: E402

TENSORS = [["model.embed_tokens.weight", "float32", [16, 8]], ["model.norm.weight", "float32", [8]]]
TYPES = ["Hello", "AskLayout", "LayoutIs", "Welcome", "Refuse", "Done", "Ack", "Begin", "Go", "Nonsense"]
FIELDS = ["writer_rank", "src_fingerprint", "dst_fingerprint", "dst_tensors", "session", "src", "delta", "checksums",
          "layout", "live_version", "reader_rank", "transport", "description", "next_slot", "inbox", "inbox_offset",
          "inbox_capacity", "reason", "kind", "version", "slot", "delta_base", "delta_nbytes", "canary", "digest",
          "tensors", "shards", "tokens", "logprobs", "tolerance"]
HUGE = [2**31, 2**40, 2**63 - 1, -(2**63), -1, 0, 2**64 - 1]
# each type's required fields and their types (rlsync/core/_control.py), so that most inputs decode and reach the
# reader's handlers, where a wrong value is worse than a wrong type
REQUIRED = {"Hello": {"writer_rank": int, "src_fingerprint": str, "dst_fingerprint": str, "dst_tensors": dict},
            "AskLayout": {}, "LayoutIs": {"layout": dict}, "Refuse": {"reason": str},
            "Welcome": {"reader_rank": int, "transport": str, "description": dict, "live_version": int, "next_slot": int},
            "Done": {"writer_rank": int, "version": int, "slot": int}, "Ack": {"version": int, "next_slot": int},
            "Begin": {"writer_rank": int, "version": int}, "Go": {"version": int}, "Nonsense": {}}

receiver = StagedReceiver(TENSORS, options=SyncOptions(timeout=30))
peer = zmq.Context.instance().socket(zmq.DEALER)
peer.setsockopt(zmq.LINGER, 0)
peer.connect(receiver.address.split("#")[0])
KEY = receiver.address.partition("#")[2].encode()
ENVELOPE = struct.Struct("!QQ")


def signed(payload: bytes, session: int = 0, counter: int = 0) -> list[bytes]:
    envelope = ENVELOPE.pack(session, counter)
    return [envelope, payload, hmac.new(KEY, envelope + payload, hashlib.sha256).digest()]


counts = dict.fromkeys(TYPES, 0)
handled = dict.fromkeys(TYPES, 0)  # inputs that decoded: the reader's handler for the type ran
NOT_A_MESSAGE = ("a malformed control message", "a control message of", "a control message with a bad signature",
                 "a control message of an unknown session")
ASK_LAYOUT = msgspec.msgpack.encode({"type": "AskLayout"})


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
    shape = data.ConsumeIntInRange(0, 7)
    frames = [signed(payload), signed(payload), signed(payload), signed(data.ConsumeBytes(256)),
              signed(payload, data.ConsumeIntInRange(1, 2**63), 1), [ENVELOPE.pack(0, 0), payload, data.ConsumeBytes(32)],
              [payload], [payload, b"", b"", b""]][shape]
    peer.send_multipart(frames)
    peer.send_multipart(signed(ASK_LAYOUT))
    # the answers: to the hostile frames (a refusal, a layout for an AskLayout, or none for a type the reader
    # ignores), then the probe's layout
    answers: list[dict[str, Any]] = []
    while len(answers) < 2 if kind == "AskLayout" else not answers or answers[-1].get("type") != "LayoutIs":
        if not peer.poll(5000):
            raise RuntimeError(f"the reader did not answer within 5 s after a {kind} input: {frames!r}"[:2000])
        answers.append(msgspec.msgpack.decode(peer.recv_multipart()[1]))
    decoded = not any(a.get("type") == "Refuse" and a["reason"].startswith(NOT_A_MESSAGE) for a in answers)
    counts[kind] += 1
    handled[kind] += decoded
    if sum(counts.values()) % 100 == 0 and os.environ.get("RLSYNC_FUZZ_COUNTS"):
        with open(os.environ["RLSYNC_FUZZ_COUNTS"], "w") as out:
            json.dump({"inputs": counts, "handled": handled}, out)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
