#!/usr/bin/env bash
# Copies this machine's iproute2 (`ip`, `tc`) and the libraries they load, but the C library itself, into .ipr/ of
# this checkout and keeps git from tracking it: for a GPU machine that lacks iproute2 (the H100 machines these checks ran on do), carry
# .ipr with the device tool; scripts/gpu_link_bench.sh puts it on PATH there.
#   bash scripts/carry_iproute2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .ipr
for tool in ip tc; do
  path=$(command -v "$tool") || { echo "$tool is missing here: apt-get install iproute2"; exit 2; }
  cp -L "$path" .ipr/
done
# what ldd resolves, less glibc's own (the other machine has its own, and two of them in one process do not mix)
ldd .ipr/ip .ipr/tc | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u \
  | grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' | xargs -r -I{} cp -L {} .ipr/
grep -qx '/.ipr/' .git/info/exclude 2>/dev/null || echo /.ipr/ >> .git/info/exclude
du -sh .ipr && ls .ipr
