#!/usr/bin/env bash
# The GPU check, in one command, on a machine with a CUDA GPU and torch (and transformers) installed:
#   bash scripts/gpu_check.sh
# It installs only what such a machine tends to lack (pyzmq, msgspec, pluggy, rich, typer, safetensors, nixl-cu13),
# from wheels in .whl/ when they are there (a machine without a package index: download them beside the checkout
# first, see docs/gpu.md), else from the package index; then runs the GPU tests (tests/gpu, marker `gpu`) and the
# device-agnostic core and wire tests on that machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this check needs a GPU')"
missing=$(python3 - <<'PY'
import importlib.util
need = {"zmq": "pyzmq", "msgspec": "msgspec", "pluggy": "pluggy", "rich": "rich", "typer": "typer",
        "safetensors": "safetensors", "nixl": "nixl-cu13", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
        "hypothesis": "hypothesis"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
PY
)
site=${RLSYNC_GPU_SITE:-/tmp/rlsync-gpu-site}
if [ -n "$missing" ]; then
  echo "installing: $missing"
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
  else
    python3 -m pip install -q --target "$site" $missing
  fi
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
python3 -m pytest tests/gpu tests/core tests/wire tests/test_public_api.py -p no:cacheprovider -q -rs "$@"
if [ "${RLSYNC_GPU_BENCH:-0}" = 1 ]; then  # the figures of docs/benchmarks.md's GPU section
  python3 -m rlsync.cli bench --device cuda --json | tee gpu-bench.json
fi
