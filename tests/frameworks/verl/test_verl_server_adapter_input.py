"""What the verl backend's rollout side yields fits verl's vLLM server adapter for every tensor size: a tensor larger
than the adapter's bucket goes to the rollout's device (verl shares it by CUDA IPC, which needs device memory); the
rest stays in host staging. The device here is ``meta``, a stand-in for the GPU that runs the same lines on CPU."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl")

from rlsync.adapters.verl._engine import for_server_adapter  # noqa: E402


def test_only_tensors_larger_than_the_bucket_go_to_the_device() -> None:
    small, large = torch.zeros(256, dtype=torch.bfloat16), torch.zeros(1024, dtype=torch.bfloat16)  # 512 B and 2 KiB
    assert for_server_adapter(small, 1024, torch.device("meta")) is small
    moved = for_server_adapter(large, 1024, torch.device("meta"))
    assert moved.device.type == "meta" and moved.shape == large.shape and moved.dtype == large.dtype
    assert for_server_adapter(large, 1024, None) is large  # no GPU: verl's shared-memory adapter, host tensors


def _bucketed_weight_transfer() -> Any:
    """verl's ``vllm_rollout/bucketed_weight_transfer.py``. Its package's ``__init__`` requires vLLM at import (it
    checks the version), and vLLM cannot share verl's environment here (their transformers pins conflict); this
    module needs neither (torch, zmq, ``verl.utils.device``), so it is loaded from its file."""
    import importlib.util

    import verl

    path = Path(verl.__file__).parent / "workers" / "rollout" / "vllm_rollout" / "bucketed_weight_transfer.py"
    spec = importlib.util.spec_from_file_location("verl_bucketed_weight_transfer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # verl's device module answers "cuda" on a machine without a GPU; the sender and receiver only synchronize and
    # free the device's caches through it, which on the CPU has nothing to do
    cpu = types.SimpleNamespace(synchronize=lambda: None, ipc_collect=lambda: None, empty_cache=lambda: None)
    module.get_torch_device = lambda: cpu
    return module


def test_verls_own_bucketed_sender_takes_what_the_backend_yields(tmp_path: object) -> None:
    """The host tensors the backend yields on a machine without a GPU go through verl's real ``BucketedWeightSender``
    (shared-memory mode, as verl's vLLM adapter runs there) and arrive whole, in order, bit for bit."""
    import asyncio
    import threading
    import uuid

    transfer = _bucketed_weight_transfer()
    BucketedWeightReceiver, BucketedWeightSender = transfer.BucketedWeightReceiver, transfer.BucketedWeightSender

    bucket = 1 << 20
    tensors = [(f"t{i}", torch.randn(n, dtype=torch.bfloat16)) for i, n in enumerate((1000, 300_000, 7, 200_000))]
    yielded = [(name, for_server_adapter(t, bucket, None)) for name, t in tensors]
    handle = f"ipc:///tmp/rlsync-verl-test-{uuid.uuid4().hex}.sock"
    got: list[tuple[str, torch.Tensor]] = []
    receiver = BucketedWeightReceiver(handle, device=torch.device("cpu"), use_shm=True)
    thread = threading.Thread(target=receiver.receive_weights,
                              args=(lambda weights, is_last: got.extend((n, t.clone()) for n, t in weights),))
    thread.start()
    asyncio.run(BucketedWeightSender(handle, bucket_size_mb=1, use_shm=True).async_send_weights(iter(yielded)))
    thread.join(timeout=60)
    assert [n for n, _ in got] == [n for n, _ in tensors]
    for (_, sent), (_, arrived) in zip(tensors, got):
        assert torch.equal(sent, arrived)
