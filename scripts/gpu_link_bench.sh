#!/usr/bin/env bash
# Issue #40's measurement on a GPU machine, in one bounded command: a CUDA trainer's full and delta versions over a
# link limited to 1 Gbit/s (two network namespaces joined by a veth under tc's tbf, over tcp), every version checked
# bit-exact on every reader, and a host of engine ranks behind one relay:
#   bash scripts/gpu_link_bench.sh
# Needs root, iproute2's ip and tc (a machine without them: `bash scripts/carry_iproute2.sh` here, then carry .ipr/),
# torch and transformers, and pyzmq, msgspec and backports.zstd: from .whl/ as scripts/gpu_check.sh takes them
# (docs/gpu.md lists the wheels; this needs only those three).
# Writes $OUT/gpu-link.json (else gpu-link.json) and prints each version and the medians. Knobs: RLSYNC_LINK_SIZE
# (1GiB), RLSYNC_LINK_STEPS (7), RLSYNC_LINK_GBPS (1), RLSYNC_LINK_DEVICE (cuda), RLSYNC_LINK_FANOUT (4),
# RLSYNC_LINK_SECONDS (540: a 10-minute device call with room; 7 steps at 1 GiB took about 175 s on an H100).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD}/gpu-link.json
if [ -d .ipr ]; then  # carried iproute2, and the libraries it loads (the python it starts inherits them: harmless)
  export PATH="$PWD/.ipr:$PATH" LD_LIBRARY_PATH="$PWD/.ipr${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
site=${RLSYNC_GPU_SITE:-/tmp/rlsync-gpu-site}
wheels=()
for name in pyzmq msgspec backports_zstd; do
  for w in .whl/"$name"-*.whl; do [ -f "$w" ] && wheels+=("$w"); done
done
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" || exit 2
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout -k 10 "${RLSYNC_LINK_SECONDS:-540}" python3 -m rlsync.cli bench --wire delta --size "${RLSYNC_LINK_SIZE:-1GiB}" \
  --steps "${RLSYNC_LINK_STEPS:-7}" --link-gbps "${RLSYNC_LINK_GBPS:-1}" --device "${RLSYNC_LINK_DEVICE:-cuda}" \
  --fanout-ranks "${RLSYNC_LINK_FANOUT:-4}" --json > "$out"
code=$?
echo "bench exit $code"
python3 - "$out" <<'PY' || exit 1
import json, sys

report = json.load(open(sys.argv[1]))
print(f"{report['model_bytes'] / 1e9:.2f} GB over a {report['link_gbps']:g} Gbit/s link, trainer on {report['device']}, "
      f"memcpy {report['memcpy_gbps']:.1f} GB/s")
for s in report["steps"]:
    f, d = s["full"], s["delta"]
    print(f"  v{s['version']}: {s['changed_fraction']:.2%} changed, full {f['seconds']:.2f} s, delta {d['seconds']:.3f} s "
          f"({d['link_bytes'] / 1e6:.2f} MB on the link; encode {d['encode_seconds']:.3f} s, apply {d['apply_seconds']:.3f} s), "
          f"{f['seconds'] / d['seconds']:.1f}x, bit-exact {f['bit_exact'] and d['bit_exact']}")
m = report["summary"]
print(f"median of versions {m['versions'][0]}-{m['versions'][-1]}: full {m['full_seconds_median']:.2f} s, delta "
      f"{m['delta_seconds_median']:.3f} s: {m['speedup']:.1f}x; encode {m['encode_seconds_median']:.3f} s, apply "
      f"{m['apply_seconds_median']:.3f} s")
if m.get("fanout_ranks"):
    print(f"relay host of {m['fanout_ranks']} ranks: {m['fanout_seconds_median']:.3f} s a version, bit-exact {m['fanout_bit_exact']}")
sys.exit(0 if m["delta_bit_exact"] and m["full_bit_exact"] and m.get("fanout_bit_exact", True) else 1)
PY
exit $code
