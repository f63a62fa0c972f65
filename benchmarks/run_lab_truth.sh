#!/usr/bin/env bash
# Re-run, on one GPU, the benchmark rows whose floors, baselines and rules were corrected (issue 15):
# gemv first (it rewrites graphserve/kernels/gemv_rule.json, which the decode rows then route by),
# then the read-bandwidth probes, decode, cliff, prefill, host overhead, offline against HF on a
# declared subset, and the kernels against the new floor. Sizes are cut to fit ~6-8 minutes on an H200.
#
# Each benchmark writes its JSON into benchmarks/results/. When $OUT is set, the JSON files, the
# regenerated rule and every step's printed table are packed into one file, $OUT/labtruth.tgz.
#
# Run from the repository root:   bash benchmarks/run_lab_truth.sh [STEP ...]
# (no STEP: all of them; e.g. `gemv roofline decode cliff` then `prefill overhead offline kernels` to
# split the run over two calls; each call packs the steps it ran)
# Set GRAPHSERVE_COMMIT when the tree travels without .git, so the results name the commit measured.
set -uo pipefail

PY=${PYTHON:-python3}
PACK_TO=${OUT:-}
unset OUT  # write_result would copy every JSON to $OUT one by one; they travel as one archive instead
export GRAPHSERVE_COMMIT=${GRAPHSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
LOGS=$(mktemp -d)
failed=()

ALL=(gemv roofline decode cliff prefill overhead offline kernels)
WANTED=("${@:-${ALL[@]}}")
for w in "${WANTED[@]}"; do
  [[ " ${ALL[*]} " == *" $w "* ]] || { echo "unknown step $w: choose from ${ALL[*]}"; exit 2; }
done
ran=()

step() {  # step NAME TIMEOUT_S ARGS...: one benchmark, its output kept, a failure recorded and passed over
  local name=$1 limit=$2
  shift 2
  [[ " ${WANTED[*]} " == *" $name "* ]] || return 0
  ran+=("$name")
  local t0=$SECONDS
  echo "=== $name: $PY -m $*"
  timeout "$limit" "$PY" -m "$@" 2>&1 | tee "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

step gemv 180 benchmarks.gemv
step roofline 60 benchmarks.roofline
step decode 180 benchmarks.decode --bs 1 8 64 256 --ctx 512 2048
step cliff 150 benchmarks.cliff --ctx 1024
step prefill 90 benchmarks.prefill --shapes 1x8192 8x2048
step overhead 150 benchmarks.overhead --num-requests 128 --output-len 128
step offline 300 benchmarks.offline --num-requests 256 --hf-requests 32 --hf-max-output-len 256
step kernels 120 benchmarks.kernels --quick

if [ -n "$PACK_TO" ]; then
  for name in "${ran[@]}"; do cp "benchmarks/results/$name.json" "$LOGS"/ 2>/dev/null; done
  [[ " ${ran[*]} " == *" gemv "* ]] && cp graphserve/kernels/gemv_rule.json "$LOGS"/
  tar -czf "$PACK_TO/labtruth.tgz" -C "$LOGS" .
  echo "packed $(ls "$LOGS" | wc -l) files into $PACK_TO/labtruth.tgz"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed or timed out: ${failed[*]}"
  exit 1
fi
