#!/usr/bin/env bash
# How much of the fitted b (what each running request adds to a decode step) is attention, the sparse-attention
# indexer and top-k, MoE, GEMMs...: `graphserve sweep --breakdown` on the sparse-attention models, each served in a
# process of its own with the profile endpoint, swept at concurrency 1, 16 and 64 with 256-token prompts and 128
# output tokens. Each model's report folder (results.json with its "breakdown", report.md, report.html, plots and
# the step profiles of each level) goes to benchmarks/results/breakdown_<model>/.
#
#   bash benchmarks/run_breakdown.sh [MODEL...] [-- more `graphserve sweep` flags]
#
# Models default to dummy:glm-5-l5 and dummy:deepseek-v4-flash-l6. BREAKDOWN_LEVELS, BREAKDOWN_INPUT_LEN,
# BREAKDOWN_OUTPUT_LEN and BREAKDOWN_MAX_MODEL_LEN change the defaults (a CPU dry run: BREAKDOWN_LEVELS=1,2
# BREAKDOWN_INPUT_LEN=16 BREAKDOWN_OUTPUT_LEN=8 bash benchmarks/run_breakdown.sh builtin:tiny-llama).
set -euo pipefail
MODELS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do MODELS+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#MODELS[@]} -gt 0 ] || MODELS=(dummy:glm-5-l5 dummy:deepseek-v4-flash-l6)
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:${PYTHONPATH:-}
PY=${PYTHON:-python3}
for MODEL in "${MODELS[@]}"; do
  DIR=benchmarks/results/breakdown_${MODEL#*:}
  SERVER="$PY -m graphserve.cli serve $MODEL --port {port} --max-model-len ${BREAKDOWN_MAX_MODEL_LEN:-2048}"
  SERVER+=" --enable-profile-endpoint"
  t0=$SECONDS
  "$PY" -m graphserve.cli sweep --server-cmd "$SERVER" --breakdown \
    --concurrency "${BREAKDOWN_LEVELS:-1,16,64}" \
    --dataset-name random-ids --tokenizer "$MODEL" \
    --random-input-len "${BREAKDOWN_INPUT_LEN:-256}" --random-output-len "${BREAKDOWN_OUTPUT_LEN:-128}" \
    --random-range-ratio 1 --output-dir "$DIR" "$@"
  echo "$MODEL done in $((SECONDS - t0)) s: $DIR/results.json"
done
