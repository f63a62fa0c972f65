#!/usr/bin/env bash
# MoE decode at small batch on one GPU (issue 9): the MoE GPU tests, the gemv rule for the MoE
# presets' dense projections (rewrites graphserve/kernels/gemv_rule.json and
# benchmarks/results/gemv.json, which the decode rows then route by), the MoE decode/prefill
# benchmark, the per-kernel breakdown of one qwen3-30b-a3b bs 1 step, and a sweep of the streaming
# kernels' tiles around their defaults at one token. About 6 minutes on an H200 (every step has a
# time limit; together they stay under 9 minutes).
#
# When $OUT is set, the JSON results, the regenerated rule and every step's printed output are
# packed into one file, $OUT/moe.tgz.
#
# Run from the repository root:   bash benchmarks/run_moe.sh [STEP ...]   (steps: tests gemv moe breakdown sweep)
# Set GRAPHSERVE_COMMIT when the tree travels without .git, so the results name the commit measured.
set -uo pipefail

PY=${PYTHON:-python3}
PACK_TO=${OUT:-}
unset OUT  # write_result would copy every JSON to $OUT one by one; they travel as one archive instead
export GRAPHSERVE_COMMIT=${GRAPHSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
LOGS=$(mktemp -d)
failed=()

ALL=(tests gemv moe breakdown sweep)
WANTED=("${@:-${ALL[@]}}")
for w in "${WANTED[@]}"; do
  [[ " ${ALL[*]} " == *" $w "* ]] || { echo "unknown step $w: choose from ${ALL[*]}"; exit 2; }
done

step() {  # step NAME TIMEOUT_S COMMAND...: output kept, a failure recorded and passed over
  local name=$1 limit=$2
  shift 2
  [[ " ${WANTED[*]} " == *" $name "* ]] || return 0
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

step tests 150 "$PY" -m pytest -q --maxfail=5 tests/gpu/test_moe.py
step gemv 90 "$PY" -m benchmarks.gemv --models dummy:qwen3-30b-a3b dummy:mixtral-8x7b
step moe 200 "$PY" -m benchmarks.moe --models dummy:qwen3-30b-a3b dummy:mixtral-8x7b --bs 1 32 64 256 \
  --loop-bs 64 --prefill dummy:qwen3-30b-a3b
step breakdown 60 "$PY" -m benchmarks.step_breakdown --model dummy:qwen3-30b-a3b --bs 1 --ctx 1024
step sweep 75 "$PY" -m benchmarks.moe_kernels --sweep-gemv

if [ -n "$PACK_TO" ]; then
  cp benchmarks/results/gemv.json benchmarks/results/moe_decode.json graphserve/kernels/gemv_rule.json "$LOGS"/ 2>/dev/null
  cp benchmarks/results/step_breakdown_qwen3-30b-a3b_bs1_ctx1024.json benchmarks/results/moe_gemv_sweep.json \
    "$LOGS"/ 2>/dev/null
  tar -czf "$PACK_TO/moe.tgz" -C "$LOGS" .
  echo "packed $(ls "$LOGS" | wc -l) files into $PACK_TO/moe.tgz"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed or timed out: ${failed[*]}"
  exit 1
fi
