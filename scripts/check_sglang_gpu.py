"""Check rlsync's SGLang adapter against the real SGLang engine (needs a GPU and `pip install sglang`).

    python scripts/check_sglang_gpu.py            # prints PASS or FAIL and exits 0 or 1

Builds a tiny Qwen2 locally (no model hub), starts `sglang.Engine` with rlsync's custom weight loader
allowed, starts rlsync in its worker, pushes three versions from a trainer process (the vLLM tests'
trainer, which has no vLLM import) and compares greedy output after the last one with a fresh engine
loaded from the same weights. The tests in tests/adapters/sglang run the same flow against a fake.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "tests" / "_support" / "model_trainer.py"  # also run as the trainer's process
PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 77]]
SEEDS = [201, 202, 203]


def _trainer_module():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "tests"))  # the tests' shared helpers (a script run from anywhere)
    from _support import model_trainer

    return model_trainer


def _engine(model_dir: Path, allow: bool):  # type: ignore[no-untyped-def]
    import sglang

    from rlsync.adapters.sglang import LOADER

    return sglang.Engine(model_path=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", random_seed=0,
                         mem_fraction_static=0.3, custom_weight_loader=[LOADER] if allow else None)


def _greedy(engine) -> list[list[int]]:  # type: ignore[no-untyped-def]
    outs = engine.generate(input_ids=PROMPTS, sampling_params={"temperature": 0.0, "max_new_tokens": 8})
    return [list(o["output_ids"]) for o in outs]


def main() -> int:
    from rlsync.adapters.sglang import SglangWeights

    trainer = _trainer_module()
    with tempfile.TemporaryDirectory() as tmp:
        trainer.build("qwen2", 100).save_pretrained(Path(tmp) / "v0")
        engine = _engine(Path(tmp) / "v0", allow=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        sync = SglangWeights(engine, trainer.tensors(trainer.build("qwen2", 100)), address=address)
        addresses = sync.start()
        child = subprocess.Popen([sys.executable, str(TRAINER), "--arch", "qwen2", "--address", *addresses,
                                  "--seeds", *map(str, SEEDS)])
        for version in range(1, len(SEEDS) + 1):
            sync.apply(version, timeout=300)
        got = _greedy(engine)
        child.wait(timeout=300)
        engine.shutdown()
        trainer.build("qwen2", SEEDS[-1]).save_pretrained(Path(tmp) / "last")
        fresh = _engine(Path(tmp) / "last", allow=False)
        want = _greedy(fresh)
        fresh.shutdown()
    ok = got == want and child.returncode == 0
    print("PASS" if ok else f"FAIL: after the update {got}, a fresh engine {want}, trainer exit {child.returncode}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
