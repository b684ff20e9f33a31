#!/usr/bin/env bash
# One prepared run on a lent GPU machine (no network there): the device benchmark (its results
# rewritten after every row), then the plan-cost benchmark (the default search, then the full
# search alone on GPT-2), each under its own time limit so that one slow part cannot take the
# others' time. On an H200 the default sizes need more than a 15-minute lease: the first row
# alone took 172 s (benchmarks/results/gpu_h200.md); prefer device_policies.sh there.
#
#   bash benchmarks/device_session.sh OUT_DIR
#
# Wheels the machine's image lacks are installed from .whl/ by device_env.sh.
set -u -o pipefail
out=${1:?usage: device_session.sh OUT_DIR}
mkdir -p "$out"
. "$(dirname "$0")/device_env.sh"
{
  nvidia-smi -L
  nproc
  python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$out/machine.txt"
timeout "${GPU_S:-300}" python3 benchmarks/gpu.py --runs 5 --out "$out" 2>&1 | tee "$out/gpu.log"
timeout "${PLAN_COST_S:-170}" python3 benchmarks/plan_cost.py --models gpt2:6,mlp,scan:6 \
  --json "$out/plan_cost_gpu.jsonl" 2>&1 | tee "$out/plan_cost_gpu.log"
timeout "${FULL_SEARCH_S:-60}" python3 benchmarks/plan_cost.py --models gpt2:6 --full-search \
  --no-warm --json "$out/plan_cost_gpu_full_search.jsonl" 2>&1 |
  tee "$out/plan_cost_gpu_full_search.log"
exit 0
