"""A transformers model receives weights in place from a trainer process and then generates
exactly what a model loaded with the new state dict generates."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from _support import hf_writer  # noqa: E402

from rlsync import SyncOptions  # noqa: E402
from rlsync.adapters.hf import ModuleReceiver  # noqa: E402

WRITER = Path(hf_writer.__file__)  # also run as the trainer's process

PROMPT = torch.tensor([[3, 17, 42, 99, 5, 64]])


def greedy(model: torch.nn.Module) -> list[int]:
    out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=12, do_sample=False, pad_token_id=0)
    return out[0, PROMPT.shape[1] :].tolist()


@pytest.mark.multiproc
@pytest.mark.parametrize("tied", [False, True])
def test_generation_after_each_update_equals_a_model_loaded_with_the_new_weights(tied: bool) -> None:
    model = hf_writer.tiny_qwen2(seed=0, tied=tied)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    addresses = {n: p.data_ptr() for n, p in model.named_parameters()}
    with ModuleReceiver(model) as receiver:
        for version, seed in ((1, 11), (2, 22), (3, 33)):
            fresh = hf_writer.tiny_qwen2(seed=seed, tied=tied)
            done = subprocess.run([sys.executable, str(WRITER), "--address", receiver.address, "--seed", str(seed),
                                   "--version", str(version), *(["--tied"] if tied else [])], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            assert receiver.version == version
            with torch.no_grad():
                for name, p in model.named_parameters():  # bytes landed in the module's own parameters
                    assert torch.equal(p, dict(fresh.named_parameters())[name]), name
            with receiver.serving(), torch.no_grad():
                assert greedy(model) == greedy(fresh)
            # copied in place: a CUDA graph that captured these addresses would still read the live weights
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == addresses
    assert not all(torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.multiproc
def test_an_in_place_version_whose_writer_is_killed_is_undone_when_its_connection_closes() -> None:
    """In place, the module is paused from the writer's Begin; the writer killed after 3 writes: its connection closing
    undoes the version and resumes the module at once, not at the receiver's 60 s timeout."""
    from rlsync.core import transports

    if not transports().get("nixl").available():  # a transport that lands in memory another process allocated
        pytest.skip("nixl is not installed")
    model = hf_writer.tiny_qwen2(seed=0)
    before = greedy(model)
    with ModuleReceiver(model, options=SyncOptions(transport="nixl", timeout=60), landing="in_place") as receiver:
        dying = subprocess.run([sys.executable, str(WRITER), "--address", receiver.address, "--seed", "11", "--version",
                                "1", "--die-after-writes", "3", "--transport", "nixl"], capture_output=True, text=True,
                               timeout=120)
        assert dying.returncode == -9, dying.stderr
        killed = time.monotonic()
        while not receiver.reader.discarded and time.monotonic() - killed < 30:
            time.sleep(0.05)
        assert receiver.reader.discarded == [1] and receiver.version == -1
        with receiver.serving(), torch.no_grad():
            assert greedy(model) == before


@pytest.mark.multiproc
def test_a_writer_killed_midway_leaves_the_module_on_its_weights() -> None:
    model = hf_writer.tiny_qwen2(seed=0)
    before = greedy(model)
    with ModuleReceiver(model) as receiver:
        dying = subprocess.run([sys.executable, str(WRITER), "--address", receiver.address, "--seed", "11",
                                "--version", "1", "--die-after-writes", "3"], capture_output=True, text=True, timeout=120)
        assert dying.returncode == -9, dying.stderr
        assert receiver.version == -1
        with receiver.serving(), torch.no_grad():
            assert greedy(model) == before
        done = subprocess.run([sys.executable, str(WRITER), "--address", receiver.address, "--seed", "11", "--version", "1"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        with receiver.serving(), torch.no_grad():
            assert greedy(model) == greedy(hf_writer.tiny_qwen2(seed=11))
