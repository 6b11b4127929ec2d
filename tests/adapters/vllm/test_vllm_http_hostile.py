"""Hostile HTTP clients of a vLLM server started as the docs say (``VLLM_SERVER_DEV_MODE=1``, rlsync's backend): anyone
who reaches the server's port, with no key (issue #66, items 1-5). Each attack is judged by what the engine serves
afterwards (vLLM's own ``/weight_checker`` checksums of its parameters, and greedy output), what it cost the engine,
and whether the trainer's next version lands; the honest trainer is ``VllmServer``, which signs its requests."""

from __future__ import annotations

import json
import os
import urllib.error
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

from _support import vllm_engines as common  # noqa: E402
from _support import vllm_server  # noqa: E402

from rlsync.adapters.vllm import VllmServer  # noqa: E402


def _refused(base: str, route: str, body: dict[str, Any]) -> str:
    """The route's error answer: rlsync refused the request."""
    with pytest.raises(urllib.error.HTTPError) as caught:
        vllm_server.post(base, route, body)
    return caught.value.read().decode(errors="replace")


def _checksums(base: str) -> dict[str, str]:
    return dict(vllm_server.post(base, "/weight_checker", {"action": "checksum"})["checksums"])


def _state(seed: int) -> dict[str, Any]:
    return common.trainer.checkpoint_state(common.trainer.build("qwen2", seed))


def _engine_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("rlsync-")}


def _descriptors(pid: int) -> int:
    """Open file descriptors of ``pid`` and its descendants (the API server, the engine core, the worker)."""
    count, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            count += len(os.listdir(f"/proc/{current}/fd"))
            todo += [int(c) for c in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except OSError:
            continue
    return count


def test_an_http_client_without_the_key_gets_no_effect_on_rlsyncs_engine(tmp_path: Path) -> None:
    model = common.save("qwen2", 100, tmp_path / "v0")
    with vllm_server.running(model, tmp_path / "server.log") as base:
        trainer = VllmServer(base)
        first = trainer.publish(_state(201).items())
        served = _checksums(base)
        greedy = vllm_server.greedy(base, str(model), common.PROMPTS, common.NEW_TOKENS)
        tensors = common.trainer.tensors(common.trainer.build("qwen2", 100))
        attacker = f"tcp://127.0.0.1:{common.free_port()}#{'k' * 8}Zq3vN8rT1xW5yB7cK2mP9sL4hD6fG0jA"

        # 1. a re-init with a key of its own, unsigned, then with a forged signature: refused, nothing replaced
        assert "unsigned /init_weight_transfer_engine was refused" in _refused(
            base, "/init_weight_transfer_engine", {"init_info": {"address": attacker, "tensors": tensors}})
        forged = {"address": attacker, "tensors": tensors, "auth": {"nonce": "n" * 32, "issued": 0, "mac": "0" * 64}}
        assert "does not verify" in _refused(base, "/init_weight_transfer_engine", {"init_info": forged})
        # ... and its updates (a version to wait for, an undo, a commit) are refused before the engine waits
        for update in ({"version": 99, "timeout": 600}, {"version": 99, "refused": "x"}, {"version": 99, "commit": True}):
            vllm_server.post(base, "/start_weight_update", {})  # vLLM's own: a refused update ends its session
            assert "unsigned /update_weights was refused" in _refused(base, "/update_weights", {"update_info": update})
        # 2. a request naming a file: refused, the file untouched
        config = model / "config.json"
        before = config.read_text()
        _refused(base, "/init_weight_transfer_engine", {"init_info": {"address": attacker, "tensors": tensors,
                                                                      "boxes_file": str(config)}})
        assert config.read_text() == before
        # 4. a declared tensor of 2^27 elements: refused before anything is allocated for it (and unsigned anyway)
        _refused(base, "/init_weight_transfer_engine",
                 {"init_info": {"address": attacker, "tensors": [["model.embed_tokens.weight", "bfloat16", [1 << 27]]]}})
        # 5. vLLM's unsigned routes: shutdown leaves rlsync's readers, a label set by anyone is not rlsync's count
        vllm_server.post(base, "/start_weight_update", {})
        vllm_server.post(base, "/finish_weight_update", {})
        vllm_server.post(base, "/shutdown_weight_transfer_engine", {})
        vllm_server.post(base, "/start_weight_update", {})  # left open: the trainer's next version closes it first
        assert _checksums(base) == served  # nothing of the above changed a byte the engine serves
        assert vllm_server.greedy(base, str(model), common.PROMPTS, common.NEW_TOKENS) == greedy
        second = trainer.publish(_state(202).items())  # the trainer's next version lands on the same readers
        assert second.version == first.version + 1 and _checksums(base) != served

        vllm_server.post(base, "/update_weight_version", {"new_version": "1"})
        resumed = VllmServer(base)  # a trainer that restarted: it goes on from what the engine serves, not from "1"
        assert resumed.publish(_state(201).items()).version == second.version + 1
        vllm_server.post(base, "/update_weight_version", {"new_version": str(2**53)})
        again = VllmServer(base)
        assert again.publish(_state(201).items()).version == second.version + 2
        assert _checksums(base) == served  # seed 201's bytes again, exactly
        assert vllm_server.greedy(base, str(model), common.PROMPTS, common.NEW_TOKENS) == greedy

        # 3. re-inits close what the last one opened: no landing file, descriptor or reader left behind per init
        files, fds = _engine_files(), _descriptors(vllm_server.pids[base])
        for seed in range(5):
            VllmServer(base).publish(_state(300 + seed).items())
        assert len(_engine_files()) <= len(files)
        assert _descriptors(vllm_server.pids[base]) <= fds + 8
        trainer.close()
        again.close()
