"""The SGLang adapter against a FAKE SGLang engine that follows SGLang's weight-update contract
(``fake_sglang.py`` cites the sources): a trainer process pushes versions through rlsync, the engine
loads each with its own loader, and greedy output equals a model built with the new weights."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _support import fake_sglang as fake  # noqa: E402
from _support import model_trainer as trainer  # noqa: E402  the same trainer process as the vLLM tests (no vLLM import)

from rlsync import ConfigError, RlsyncError  # noqa: E402
from rlsync.adapters.sglang import LOADER, SglangWeights  # noqa: E402

TRAINER = Path(trainer.__file__)
PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 77]]


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def engine(seed: int, allowed: list[str] | None = None):  # type: ignore[no-untyped-def]
    return fake.FakeSglangEngine(fake.FakeModel(trainer.build("qwen2", seed)), custom_weight_loader=allowed)


def greedy(e) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o["output_ids"] for o in e.generate(PROMPTS, {"temperature": 0.0, "max_new_tokens": 6})]


def test_versions_from_a_trainer_process_generate_like_a_fresh_model() -> None:
    e = engine(100, [LOADER])
    sync = SglangWeights(e, trainer.tensors(trainer.build("qwen2", 100)), address=free_address())
    addresses = sync.start()
    seeds = [201, 202, 203]
    child = subprocess.Popen([sys.executable, str(TRAINER), "--arch", "qwen2", "--address", *addresses,
                              "--seeds", *map(str, seeds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outputs = {}
    try:
        for version in (1, 2, 3):
            e.calls.clear()
            sync.apply(version, timeout=120)
            assert e.calls == ["pause_generation", "update_weights_from_tensor", "flush_cache", "update_weight_version",
                               "continue_generation"]
            outputs[version] = greedy(e)
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert [json.loads(line)["completed"] for line in out.splitlines()] == [1, 2, 3]
    finally:
        if child.poll() is None:
            child.kill()
    assert e.get_weight_version() == "3"
    for version, seed in zip((1, 3), (201, 203)):
        assert greedy(engine(seed)) == outputs[version]
    # the bytes themselves: every parameter equals the trainer's last version
    expected = trainer.build("qwen2", 203)
    for name, p in expected.named_parameters():
        assert torch.equal(e.model.params[name], p), name


def test_a_trainer_killed_midway_leaves_the_old_weights_and_generation_running() -> None:
    e = engine(100, [LOADER])
    before = greedy(e)
    sync = SglangWeights(e, trainer.tensors(trainer.build("qwen2", 100)), address=free_address())
    addresses = sync.start()
    dying = subprocess.run([sys.executable, str(TRAINER.with_name("dying_trainer.py")), "--arch", "qwen2",
                            "--address", *addresses, "--seeds", "7"], capture_output=True, text=True, timeout=120,
                           check=False)
    assert dying.returncode == -9, dying.stderr
    # its Begin said version 1 was under way: its connection closing gives the version up, naming why
    with pytest.raises(RlsyncError, match="writer rank 0's connection closed before it finished version 1"):
        sync.apply(1, timeout=1.0)
    assert not e.paused and e.get_weight_version() == "default"
    assert greedy(e) == before


def test_an_engine_without_the_loader_allowed_names_the_flag() -> None:
    e = engine(100, allowed=[])
    sync = SglangWeights(e, trainer.tensors(trainer.build("qwen2", 100)), address=free_address())
    with pytest.raises(ConfigError, match=f"--custom-weight-loader {LOADER}"):
        sync.start()


def test_the_loader_refuses_plain_weights() -> None:
    e = engine(100, [LOADER])
    ok, message = e.update_weights_from_tensor([("model.norm.weight", torch.ones(128))], load_format=LOADER)
    assert not ok and "SglangWeights" in message


def test_names_are_checked_at_start_with_the_engines_own_loader() -> None:
    e = engine(100, [LOADER])
    before = greedy(e)
    tensors = trainer.tensors(trainer.build("qwen2", 100))
    bogus = SglangWeights(e, [*tensors, ["model.layers.1.mlp.not_a_weight.weight", "bfloat16", [4, 4]]], address=free_address())
    with pytest.raises(RlsyncError, match=r"refused checkpoint tensor 'model\.layers\.1\.mlp\.not_a_weight\.weight'"):
        bogus.start()
    missing = SglangWeights(e, [t for t in tensors if t[0] != "model.norm.weight"], address=free_address())
    with pytest.raises(RlsyncError, match=r"fills the engine's parameter\(s\) \['model\.norm\.weight'\]"):
        missing.start()
    assert greedy(e) == before  # the check ran the loader, then put every weight back


def test_a_load_that_fails_midway_is_rolled_back_and_the_next_version_loads() -> None:
    e = engine(100, [LOADER])
    before = greedy(e)
    sync = SglangWeights(e, trainer.tensors(trainer.build("qwen2", 100)), address=free_address())
    addresses = sync.start()
    real = e.model.load_weights

    def half_then_fail(weights):  # type: ignore[no-untyped-def]
        weights = list(weights)
        real(weights[: len(weights) // 2])  # the first half lands in the parameters
        raise RuntimeError("injected: the loader failed halfway")

    e.model.load_weights = half_then_fail
    child = subprocess.Popen([sys.executable, str(TRAINER), "--arch", "qwen2", "--address", *addresses, "--seeds", "7"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with pytest.raises(RlsyncError, match="injected: the loader failed halfway"):
        sync.apply(1, timeout=120)
    _, err = child.communicate(timeout=120)
    assert child.returncode != 0 and "injected" in err
    assert greedy(e) == before and e.get_weight_version() == "default"

    e.model.load_weights = real
    child = subprocess.Popen([sys.executable, str(TRAINER), "--arch", "qwen2", "--address", *addresses, "--seeds", "8",
                              "--first-version", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sync.apply(1, timeout=120)
    assert child.communicate(timeout=120) and child.returncode == 0
    assert greedy(e) == greedy(engine(8))
