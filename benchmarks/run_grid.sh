#!/usr/bin/env bash
# The issue's two-configuration server grid in one command: dummy:llama3-8b served with
# --max-running-requests 64 and --cuda-graph-max-bs 32, then 64, each swept at concurrency 1, 16 and
# 64 with 256-token prompts and 128 output tokens. The report folder (results.json, report.md,
# report.html, plots, server logs, and with --profile one step profile per level) goes to OUTPUT_DIR,
# with report.png beside report.html where the renderer's packages are installed.
#
#   bash benchmarks/run_grid.sh OUTPUT_DIR [--profile] [more `graphserve sweep` flags]
#
# About 3-4 minutes on an H200 (each server start loads and captures in ~40-60 s; the levels run
# 16, 80 and 320 requests), ~1 minute more with --profile. GRID_MODEL, GRID_LEVELS, GRID_INPUT_LEN,
# GRID_OUTPUT_LEN, GRID_MAX_MODEL_LEN and GRID_VALUES change the defaults (a CPU dry run:
# GRID_MODEL=builtin:tiny-llama GRID_LEVELS=1,4 GRID_INPUT_LEN=32 GRID_OUTPUT_LEN=8).
set -euo pipefail
if [ $# -lt 1 ] || [[ $1 == -* ]]; then
  echo "usage: bash benchmarks/run_grid.sh OUTPUT_DIR [--profile] [graphserve sweep flags]" >&2
  exit 2
fi
DIR=$1
shift
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:${PYTHONPATH:-}
PY=${PYTHON:-python3}
MODEL=${GRID_MODEL:-dummy:llama3-8b}
SERVER="$PY -m graphserve.cli serve $MODEL --port {port} --max-running-requests 64"
SERVER+=" --max-model-len ${GRID_MAX_MODEL_LEN:-2048} --cuda-graph-max-bs {cuda_graph_max_bs} --enable-profile-endpoint"
t0=$SECONDS
"$PY" -m graphserve.cli sweep \
  --server-cmd "$SERVER" --server-grid "cuda_graph_max_bs=${GRID_VALUES:-32,64}" \
  --concurrency "${GRID_LEVELS:-1,16,64}" \
  --dataset-name random-ids --tokenizer "$MODEL" \
  --random-input-len "${GRID_INPUT_LEN:-256}" --random-output-len "${GRID_OUTPUT_LEN:-128}" \
  --output-dir "$DIR" "$@"
echo "grid done in $((SECONDS - t0)) s: $DIR/report.html"
# The page as a PNG where WeasyPrint and pypdfium2 are importable (tools/render_report.py says how to get them).
if "$PY" -c "import weasyprint, pypdfium2" 2>/dev/null; then
  "$PY" tools/render_report.py "$DIR/report.html" -o "$DIR/report.png"
fi
