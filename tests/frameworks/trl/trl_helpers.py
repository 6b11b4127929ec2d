"""Helpers of the TRL adapter tests: the example's tiny model, tokenizer and vLLM server (examples/trl_grpo.py),
and a fresh in-process vLLM engine to compare the server's greedy output with."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

# the example itself, as a user runs it (a script in examples/, not a helper: examples/ is no package and must
# not go on sys.path, where its verl/ folder would pass for the verl package)
_spec = importlib.util.spec_from_file_location("rlsync_example_trl_grpo", Path(__file__).parents[3] / "examples" / "trl_grpo.py")
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

PROMPTS = [[3, 9, 4, 12], [20, 7], [5, 5, 16, 8, 11]]
NEW_TOKENS = 8


def live_version(server: Any) -> int:
    """The version a (shared) server serves now, by its label: a new client's versions go on from it."""
    from rlsync.adapters.vllm import label_version

    return label_version(server.call_json("/weight_info")["weight_version"])


def checkpoint(model_dir: Path, named: dict[str, Any], where: Path) -> Path:
    """``model_dir``'s config and tokenizer with ``named`` as its weights: what a fresh engine loads."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(model_dir, where)
    save_file({n: t.detach().to("cpu").contiguous().clone() for n, t in named.items()}, str(where / "model.safetensors"))
    return where


def fresh_greedy(model: Path) -> list[list[int]]:
    """Greedy completions of PROMPTS from a new vLLM engine that loaded ``model`` from disk."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              distributed_executor_backend="uni", max_model_len=128, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    llm.llm_engine.engine_core.shutdown()
    del llm
    return got


def grpo_trainer(model_dir: Path, server: Any, tmp_path: Path, steps: int, lr: float = 3e-3, peft_config: Any = None,
                 **config: Any) -> Any:
    """A real ``GRPOTrainer`` on CPU against ``server``: the example's toy task, 8 rows of 4 generations a step."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import rlsync.adapters.trl  # noqa: F401  (the patches: GRPOTrainer's constructor joins no NCCL group)

    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=steps, learning_rate=lr, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=8, beta=0.0, logging_steps=1, save_strategy="no",
                      report_to="none", use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, bf16=False,
                      use_cpu=True, seed=0, **config)
    prompts = [f"w{i} w{(3 * i) % 24}" for i in range(64)]
    return GRPOTrainer(model=str(model_dir), reward_funcs=example.reward_target, args=args,
                       train_dataset=Dataset.from_dict({"prompt": prompts}), peft_config=peft_config,
                       processing_class=AutoTokenizer.from_pretrained(model_dir.parent / "tokenizer"))
