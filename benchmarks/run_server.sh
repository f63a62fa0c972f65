#!/usr/bin/env bash
# The server benchmark on the GPU machine, in one command (about 6-7 minutes on an H200):
# HTTP vs offline throughput with the every-event client for dummy:qwen3-0.6b and dummy:llama3-8b at
# concurrency 64 and 256, streamed and not; idle TTFT; TTFT right after ready vs steady.
# Wheels: run /work/shared/gpu/fetch-wheels.sh orjson uvloop httptools beforehand and carry .whl; without
# orjson/uvloop/httptools the server runs on its fallbacks (json, asyncio, h11), and says so here.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
python3 -c "import orjson, uvloop, httptools" 2>/dev/null || echo "note: orjson/uvloop/httptools missing: fallbacks in use"
log=benchmarks/results/http_overhead.log
timeout 470 python3 -m benchmarks.http_overhead --num-prompts 256 --input-len 256 --output-len 256 "$@" 2>&1 | tee "$log"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/server.tgz" benchmarks/results/http_overhead.json "$log"
fi
