"""On a CUDA machine: a ``NodeRelay`` forwarding to a GPU node's engines over ``cuda_ipc``.

The trainer's writer sends the host's distinct bytes once, over tcp (the slow link), to the relay, which lands them
in host memory and forwards each CUDA engine its copy through ``cuda_ipc``; full and delta versions, every engine
bit-exact at every version with its parameters at the same addresses. Skipped without CUDA (CI has none; the
shared-memory relay is tested on CPU in tests/plugins/test_node_relay.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

pytest.importorskip("transformers")

from _support import hf_writer  # noqa: E402
from _support.cuda_engines import greedy  # noqa: E402

from rlsync import NodeRelay, SyncOptions, WeightsWriter  # noqa: E402
from rlsync.adapters.hf import ModuleReceiver  # noqa: E402
from rlsync.layouts import from_state_dict  # noqa: E402


def relay_round(device: str, local: SyncOptions, wire: str) -> None:
    """Three versions from a trainer on ``device`` through a relay into two engines on ``device`` (``local``: the
    host's transport), each checked bit for bit; a CPU run of this with shared memory is what it is on a GPU."""
    engines = [hf_writer.tiny_qwen2(seed=0).to(device) for _ in range(2)]
    addresses = [{n: p.data_ptr() for n, p in e.named_parameters()} for e in engines]
    receivers = [ModuleReceiver(e, options=local) for e in engines]
    link = SyncOptions(transport="tcp", verify=True, timeout=120, wire=wire)
    relay = NodeRelay([[r.address] for r in receivers], options=link, local=local)
    trainer = hf_writer.tiny_qwen2(seed=1).to(device)
    params = dict(trainer.named_parameters())
    distinct = sum(p.numel() * p.element_size() for p in params.values())
    writer = WeightsWriter(from_state_dict({n: p.detach() for n, p in params.items()}), None, 0, [relay.address],
                           options=link)
    try:
        for version in (1, 2, 3):
            with torch.no_grad():
                if version == 1:
                    trainer.load_state_dict(hf_writer.tiny_qwen2(seed=11).state_dict())
                else:  # an RL step's change: a few values move
                    for p in params.values():
                        p.view(-1)[version::97] += 0.5
            writer.multi_put({n: p.detach() for n, p in params.items()})
            writer.complete(version)
            assert relay.version == version
            if version == 1 or wire == "full":
                assert writer.last_bytes == distinct  # the host's bytes crossed its link once, not once per engine
            else:
                assert 0 < writer.last_bytes < distinct / 4  # a delta
            for engine, receiver, where in zip(engines, receivers, addresses):
                assert receiver.version == version
                with receiver.serving(), torch.no_grad():
                    for name, p in engine.named_parameters():
                        assert torch.equal(p, params[name]), (version, name)
                    if device != "cpu":
                        assert greedy(engine) == greedy(trainer)
                assert {n: p.data_ptr() for n, p in engine.named_parameters()} == where
    finally:
        writer.close()
        relay.close()
        for receiver in receivers:
            receiver.close()


@pytest.mark.parametrize("wire", ["full", "delta"])
def test_a_node_relay_forwards_to_cuda_engines_over_cuda_ipc(wire: str) -> None:
    relay_round("cuda", SyncOptions(transport="cuda_ipc", verify=True, timeout=120), wire)
