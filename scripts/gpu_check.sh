#!/usr/bin/env bash
# The GPU check, in one bounded command, on a machine with a CUDA GPU, torch and transformers:
#   bash scripts/gpu_check.sh
# 1. installs pyzmq, msgspec, backports.zstd, nixl-cu13 and the nixl meta wheel (`import nixl`) from .whl/ beside
#    the checkout (docs/gpu.md lists the exact wheels; a machine without a package index gets them that way);
# 2. runs every GPU test (tests/gpu) with a per-test timeout, going on past failures;
# 3. runs `rlsync bench --device cuda` at a size that fits beside the tests, each path bounded, failures recorded,
#    then `rlsync bench --sampling-mask --device cuda` where time is left;
# 4. writes one JSON (tests by name, every bench figure and ratio, what is missing) to $OUT/gpu-check.json when
#    OUT is set, else to gpu-check.json, and prints its summary.
# Whatever fails, it ends within RLSYNC_GPU_CHECK_SECONDS (default 540: one 10-minute device call with room to
# spare); it exits non-zero when a test failed, a bench path failed, or cuda_ipc or nixl cannot run.
# Knobs: RLSYNC_GPU_BENCH_SECONDS (kept for the bench, 240), RLSYNC_GPU_BENCH_SIZE (4GiB), RLSYNC_GPU_PATH_TIMEOUT
# (60 s per bench path), RLSYNC_GPU_BENCH_REPEATS (3), RLSYNC_GPU_WORKERS (8 test processes, with pytest-xdist).
# RLSYNC_GPU_CORE=1 also runs the device-agnostic tests/core and tests/wire there with the time that is left.
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${RLSYNC_GPU_CHECK_SECONDS:-540}
source scripts/gpu_setup.sh  # the clock, $results, $work, the CUDA check, the wheels of .whl/ on PYTHONPATH
export RLSYNC_NIXL_TIMEOUT=${RLSYNC_NIXL_TIMEOUT:-30}  # a NIXL write that hangs fails in 30 s, not 120
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 - > "$work/env.json" <<'PY'
import json, torch
from rlsync.core import transports
registry = transports()
avail = {n: bool(registry.get(n).available()) for n in registry.names()}
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
                  "transports": avail, "missing": [n for n in ("cuda_ipc", "nixl") if not avail.get(n)]}))
PY
cat "$work/env.json"

# -- 2. the GPU tests, each bounded, all of them whatever fails ---------------------------------------------------
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n "${RLSYNC_GPU_WORKERS:-8}")
phase=$(( $(left) - ${RLSYNC_GPU_BENCH_SECONDS:-240} ))  # what the bench needs is kept for it
echo "== tests/gpu (at most ${phase} s, ${RLSYNC_GPU_TEST_TIMEOUT:-90} s a test)"
# the names first: a phase cut short still says which tests never reported (the JUnit file is written at the end)
python3 -m pytest tests/gpu -p no:cacheprovider -p no:benchmark --collect-only -q "$@" | grep '::' > "$work/gpu-tests.collected"
timeout -k 10 "$phase" python3 -m pytest tests/gpu -p no:cacheprovider -p no:benchmark -v -rfEs \
  --timeout="${RLSYNC_GPU_TEST_TIMEOUT:-90}" "${parallel[@]}" --junitxml="$work/gpu-tests.xml" "$@" 2>&1 \
  | tee "$work/gpu-tests.log"
echo "tests/gpu exit $?"

# -- 3. the bench, each path bounded -----------------------------------------------------------------------------
phase=$(( $(left) - 30 ))
echo "== rlsync bench --device cuda (at most ${phase} s)"
timeout -k 10 "$phase" python3 -m rlsync.cli bench --device cuda --size "${RLSYNC_GPU_BENCH_SIZE:-4GiB}" \
  --transports cuda_ipc,nixl --repeats "${RLSYNC_GPU_BENCH_REPEATS:-3}" --path-timeout "${RLSYNC_GPU_PATH_TIMEOUT:-60}" \
  --json > "$work/bench.json"
echo "bench exit $?"

# -- the sampling mask's cost on this GPU, with the time that is left ------------------------------------------------
if [ "$(left)" -gt 100 ]; then
  echo "== rlsync bench --sampling-mask --device cuda (at most $(( $(left) - 60 )) s)"
  timeout -k 10 $(( $(left) - 60 )) python3 -m rlsync.cli bench --sampling-mask --device cuda --json > "$work/mask.json"
  echo "mask bench exit $?"
fi

# -- optional: the device-agnostic tests on this machine -----------------------------------------------------------
if [ "${RLSYNC_GPU_CORE:-0}" = 1 ] && [ "$(left)" -gt 60 ]; then
  echo "== tests/core tests/wire (at most $(( $(left) - 20 )) s)"
  timeout -k 10 $(( $(left) - 20 )) python3 -m pytest tests/core tests/wire tests/test_public_api.py -p no:cacheprovider \
    -p no:benchmark -q --timeout=120 "${parallel[@]}" --junitxml="$work/core-tests.xml"
fi

# -- 4. one JSON ---------------------------------------------------------------------------------------------------
python3 - "$work" "$results/gpu-check.json" "$(( SECONDS - started ))" <<'PY'
import json, pathlib, sys
import xml.etree.ElementTree as ET

work, out, seconds = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
report = {"seconds": seconds, "env": json.loads((work / "env.json").read_text())}
for phase in ("gpu-tests", "core-tests"):
    xml = work / f"{phase}.xml"
    if not xml.exists():
        continue
    tests = {"passed": [], "failed": {}, "skipped": {}}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            tests["failed"][name] = (bad.get("message") or "")[:600] + "\n" + (bad.text or "")[-1500:]
        elif case.find("skipped") is not None:
            tests["skipped"][name] = case.find("skipped").get("message", "")
        else:
            tests["passed"].append(name)
    report[phase] = tests
if not (work / "gpu-tests.xml").exists():  # cut short: what the verbose log reported, and what it never did
    import re

    log = (work / "gpu-tests.log").read_text() if (work / "gpu-tests.log").exists() else ""
    outcome = {m[1]: m[0] for m in re.findall(r"(PASSED|FAILED|ERROR|SKIPPED) (tests/gpu/\S+)", log)}
    outcome.update({m[1]: m[0] for m in re.findall(r"(tests/gpu/\S+) (PASSED|FAILED|ERROR|SKIPPED)", log)})
    collected = (work / "gpu-tests.collected").read_text().split() if (work / "gpu-tests.collected").exists() else []
    tests = {"passed": [n for n, o in outcome.items() if o == "PASSED"], "skipped": {}, "failed": {}}
    tests["failed"].update({n: o for n, o in outcome.items() if o in ("FAILED", "ERROR")})
    tests["failed"].update({n: "did not finish before the phase ended (hung, or too slow)" for n in collected if n not in outcome})
    report["gpu-tests"] = tests
try:
    report["bench"] = json.loads((work / "bench.json").read_text())
except Exception as exc:
    report["bench"] = {"error": f"no bench report: {exc}"}
try:
    report["sampling_mask"] = json.loads((work / "mask.json").read_text())
except Exception as exc:  # optional: only with time left
    report["sampling_mask"] = {"error": f"no sampling-mask report: {exc}"}
out.write_text(json.dumps(report, indent=1))
gpu = report["gpu-tests"]
print(f"\n== {report['env']['gpu']}, torch {report['env']['torch']}: {len(gpu['passed'])} GPU tests passed, "
      f"{len(gpu['failed'])} failed, {len(gpu['skipped'])} skipped, in {seconds} s")
for name, why in gpu["failed"].items():
    print(f"FAILED {name}: {why.splitlines()[0] if why else ''}")
bench = report["bench"]
if "limits" in bench:
    lim = bench["limits"]
    print(f"bench {bench['bytes'] / 2**30:.2f} GiB: one copy {lim['one_copy_gbps']:.0f} GB/s, per tensor {lim['per_tensor_gbps']:.0f} GB/s")
    for r in bench["results"]:
        xb = "-" if r.get("x_bucketed") is None else f"{r['x_bucketed']:.2f}"
        print(f"  {r['name']:28s} {r['seconds'] * 1e3:9.2f} ms {r['gbps']:8.1f} GB/s  x per-tensor {r['x_per_tensor_copy']:.2f}"
              f"  x bucketed {xb}  exact {r['exact']}")
    for r in bench.get("failed", []):
        print(f"  {r['name']:28s} FAILED: {r['error'][:300]}")
    if bench.get("delta"):
        d = bench["delta"]
        print(f"  delta find+encode {d['find_encode_gbps']:.1f} GB/s, apply {d['apply_seconds'] * 1e3:.2f} ms, "
              f"{d['delta_bytes'] / d['full_bytes']:.1%} of the bytes")
        if d.get("zstd"):
            z = d["zstd"]
            print(f"  delta zstd (tcp) find+encode {z['find_encode_gbps']:.1f} GB/s, apply {z['apply_seconds'] * 1e3:.2f} ms, "
                  f"{z['delta_bytes'] / z['full_bytes']:.1%} of the bytes")
else:
    print(f"bench: {bench.get('error')}")
for way, row in report["sampling_mask"].get("results", {}).items():
    if "seconds" in row:
        print(f"  mask {way:16s} {row['seconds'] * 1e3:8.1f} ms  peak {row['peak_bytes'] / 2**20:8.1f} MiB")
missing = report["env"]["missing"]
if missing:
    print(f"MISSING transports that this check must cover: {missing}")
bad = bool(gpu["failed"]) or bool(missing) or "limits" not in bench or bool(bench.get("failed")) \
    or not all(r["exact"] for r in bench.get("results", []))
print(f"wrote {out}")
sys.exit(1 if bad else 0)
PY
