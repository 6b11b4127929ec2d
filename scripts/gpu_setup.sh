# Sourced by the GPU scripts (scripts/gpu_check.sh, scripts/gpu_tensor_cost.sh) from the checkout's root, with
# `budget` (seconds) set: the clock (`left`), where results go ($OUT, else here), a work folder, the CUDA check, and
# what such a machine lacks installed from .whl/ (exactly these: two versions of one would stop pip) onto PYTHONPATH.
started=$SECONDS
left() { echo $(( budget - (SECONDS - started) )); }
results=${OUT:-$PWD}
work=$(mktemp -d)
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this check needs a GPU')" || exit 2

site=${RLSYNC_GPU_SITE:-/tmp/rlsync-gpu-site}
wheels=(.whl/pyzmq-*.whl .whl/msgspec-*.whl .whl/backports_zstd-*.whl .whl/nixl_cu13-*.whl .whl/nixl-*-py3-none-any.whl)
for w in "${wheels[@]}"; do
  [ -f "$w" ] || { echo "missing wheel $w: download the wheels docs/gpu.md lists into .whl/ first"; exit 2; }
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" || exit 2
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
