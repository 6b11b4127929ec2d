#!/usr/bin/env bash
# Issue #56's GPU part, in one bounded command on a machine with a CUDA GPU, torch and the wheels of .whl/
# (scripts/gpu_check.sh's: pyzmq, msgspec, backports.zstd, nixl-cu13, nixl):
#   bash scripts/gpu_tensor_cost.sh
# 1. `rlsync bench --device cuda --transports cuda_ipc,nixl` at the bench's own tensor count (a Qwen2-shaped model of
#    RLSYNC_COST_SIZE, 2GiB), then the same bytes as 20,000 tensors (RLSYNC_COST_TENSORS): cuda_ipc direct and in place
#    against the batched per-tensor copy (the issue asks >= 0.8x and >= 0.6x), every path bit-exact;
# 2. NIXL VRAM to VRAM again under UCX settings, one bench of `--transports nixl` each, with the time that is left:
#    UCX's defaults, then UCX_TLS without tcp, UCX_RNDV_SCHEME=get_zcopy, UCX_RNDV_THRESH=8192 (what docs/gpu.md says
#    was tried comes from this file's figures);
# 3. writes one JSON ($OUT/gpu-tensor-cost.json when OUT is set) and prints each path's ratio.
# Ends within RLSYNC_COST_SECONDS (540: one 10-minute device call with room); each bench bounded, each path 60 s.
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${RLSYNC_COST_SECONDS:-540}
source scripts/gpu_setup.sh  # the clock, $results, $work, the CUDA check, the wheels of .whl/ on PYTHONPATH
export RLSYNC_NIXL_TIMEOUT=${RLSYNC_NIXL_TIMEOUT:-30} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

size=${RLSYNC_COST_SIZE:-2GiB}
bench() {  # NAME SECONDS [ENV=VALUE ...] -- BENCH ARGS...: one bench, bounded, its JSON in $work/NAME.json
  local name=$1 seconds=$2; shift 2
  local env=()
  while [ "$1" != "--" ]; do env+=("$1"); shift; done; shift
  [ "$seconds" -gt 30 ] || { echo "== $name: no time left"; return; }
  echo "== $name (at most $seconds s)"
  timeout -k 10 "$seconds" env "${env[@]}" python3 -m rlsync.cli bench --device cuda --size "$size" --repeats 3 \
    --path-timeout 60 --json "$@" > "$work/$name.json"
  echo "$name exit $?"
}
bench bench-count $(( $(left) * 30 / 100 )) -- --transports cuda_ipc,nixl
bench tensors-20000 $(( $(left) * 45 / 100 )) -- --transports cuda_ipc,nixl --tensors "${RLSYNC_COST_TENSORS:-20000}"
variants=("UCX_TLS=cuda_ipc,cuda_copy,sm,self" "UCX_RNDV_SCHEME=get_zcopy" "UCX_RNDV_THRESH=8192")
for i in "${!variants[@]}"; do
  bench "nixl-ucx-$i" $(( ($(left) - 20) / (${#variants[@]} - i) )) "UCX_LOG_LEVEL=warn" "${variants[$i]}" -- --transports nixl
done

python3 - "$work" "$results/gpu-tensor-cost.json" "$(( SECONDS - started ))" "${variants[@]}" <<'PY'
import json, pathlib, sys

work, out, seconds, variants = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
names = ["bench-count", "tensors-20000"] + [f"nixl-ucx-{i}" for i in range(len(variants))]
report = {"seconds": seconds, "ucx_variants": dict(zip(names[2:], variants)), "runs": {}}
for name in names:
    try:
        report["runs"][name] = json.loads((work / f"{name}.json").read_text())
    except Exception as exc:  # cut short or failed: said, and the rest is still reported
        report["runs"][name] = {"error": f"no report: {exc}"}
out.write_text(json.dumps(report, indent=1))
bad = 0
for name, run in report["runs"].items():
    if "limits" not in run:
        print(f"{name}: {run.get('error')}")
        bad += 1
        continue
    lim = run["limits"]
    print(f"{name} {report['ucx_variants'].get(name, '')}: {run['bytes'] / 2**30:.2f} GiB in {run['tensors']} tensors, "
          f"one copy {lim['one_copy_gbps']:.0f} GB/s, per-tensor copy {lim['per_tensor_seconds'] * 1e3:.2f} ms")
    for r in run["results"]:
        print(f"  {r['name']:28s} {r['seconds'] * 1e3:9.2f} ms  x per-tensor copy {r['x_per_tensor_copy']:.2f}  exact {r['exact']}")
        bad += not r["exact"]
    for r in run.get("failed", []):
        print(f"  {r['name']:28s} FAILED: ...{r['error'][-300:]}")  # the reason is at the end, after the worker's argv
        bad += 1
print(f"{seconds} s; {bad} problem(s); {out}")
sys.exit(1 if bad else 0)
PY
