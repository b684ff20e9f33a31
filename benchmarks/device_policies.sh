#!/usr/bin/env bash
# The device benchmark one policy per process (`memory_stats()["peak_bytes_in_use"]` never
# resets inside a process, so a later, smaller policy would read as no growth), without the
# largest-batch search: a short run for a lent GPU.
#
#   bash benchmarks/device_policies.sh OUT_DIR [SIZE]
set -u -o pipefail
out=${1:?usage: device_policies.sh OUT_DIR [SIZE]}
size=${2:-small}
mkdir -p "$out"
. "$(dirname "$0")/device_env.sh"
for policy in "no remat" "nothing_saveable per layer" "dots_saveable per layer" "auto 0.5" \
  "auto 0.25"; do
  limit=${POLICY_S:-60}
  [[ $policy == auto* ]] && limit=${AUTO_S:-120}
  timeout "$limit" python3 benchmarks/gpu.py --size "$size" --runs 10 --no-largest-batch \
    --policies "$policy" --out "/tmp/gpu_one" 2>&1 | grep -E "^\{|Error|error" |
    tee -a "$out/gpu_policies.log"
done
exit 0
