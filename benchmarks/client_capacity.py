"""How much load one `graphserve bench` process can generate: requests/s and streamed chunks/s
against a trivial endpoint (another process) that streams K chunks at once, so the client is the
only thing that can be slow. Below these rates the load generator measures the server; near them
it measures itself (its client-health warnings say so).

Run: python3 -m benchmarks.client_capacity [--requests 4000] [--concurrency 64]
Targets on a 2-core machine: >= 2,000 req/s (K=1) and >= 50,000 chunks/s (K=100).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from benchmarks.common import print_table, write_result
from graphserve.bench.datasets import BenchRequest
from graphserve.bench.runner import BenchSettings, run_benchmark

TARGET_REQ_S = 2000.0
TARGET_CHUNKS_S = 50000.0


def serve(port: int) -> None:
    """The trivial endpoint: POST /v1/completions streams ``max_tokens`` one-token chunks at once."""
    from aiohttp import web

    chunk = b'data: {"choices":[{"index":0,"text":" x","finish_reason":null}]}\n\n'

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        k = int(body.get("max_tokens", 1))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": k}}).encode()
        await resp.write(chunk * k + b"data: " + usage + b"\n\ndata: [DONE]\n\n")
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _start_endpoint() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.client_capacity", "--serve", str(port)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("endpoint did not start")


def measure(url: str, requests: int, chunks: int, concurrency: int) -> dict:
    s = BenchSettings(base_url=url, backend="openai", model="m", max_concurrency=concurrency, warmup_requests=0,
                      metrics_url=None)
    reqs = [BenchRequest("hello", 1, chunks) for _ in range(requests)]
    out = run_benchmark(s, reqs)
    summ, health = out["summary"], out["client_health"]
    duration = summ["duration_s"]
    return {"chunks_per_req": chunks, "concurrency": concurrency, "requests": requests,
            "failed": summ["failed"], "req_per_s": summ["completed"] / duration,
            "chunks_per_s": summ["total_output_tokens"] / duration,
            "loop_lag_p99_ms": (health["loop_lag_ms"] or {}).get("p99"), "client_cpu_pct": health["cpu_percent_mean"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    proc, url = _start_endpoint()
    try:
        rows = [measure(url, args.requests, 1, args.concurrency),
                measure(url, max(args.requests // 10, 100), 100, args.concurrency)]
    finally:
        proc.terminate()
        proc.wait(10)
    rows[0]["target"], rows[0]["vs_target"] = f"{TARGET_REQ_S:.0f} req/s", rows[0]["req_per_s"] / TARGET_REQ_S
    rows[1]["target"], rows[1]["vs_target"] = f"{TARGET_CHUNKS_S:.0f} chunks/s", rows[1]["chunks_per_s"] / TARGET_CHUNKS_S
    print_table(rows, ["chunks_per_req", "concurrency", "requests", "failed", "req_per_s", "chunks_per_s",
                       "loop_lag_p99_ms", "client_cpu_pct", "target", "vs_target"])
    path = write_result("client_capacity", {"rows": rows, "cpu_count": os.cpu_count()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
