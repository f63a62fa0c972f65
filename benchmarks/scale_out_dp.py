"""`--dp 2` against one replica, through the one HTTP front-end: output tok/s at a fixed concurrency.

``dummy:qwen3-0.6b`` served by `graphserve serve --dp 1` (GPU 0) and then `--dp 2` (GPUs 0 and 1), each under the
same closed loop: ``--concurrency`` streams (128) of random token prompts (``--input-len`` tokens, all distinct,
so no request finds another's prefix cached and routing falls to load), ``--output-len`` tokens each with EOS
ignored, every SSE event parsed as it arrives (benchmarks/http_server.py's client, in processes of its own). The
tok/s is output tokens over the wall time from the first stream's start to the last one's end; ``vs_one_replica``
is dp 2 over dp 1 (target >= 1.85: two engines at half the batch each, minus what the one front-end costs). The
rows also carry how many requests each replica took (``graphserve:replica_requests_total``).

Run on >= 2 GPUs: python3 -m benchmarks.scale_out_dp [--concurrency 128] [--quick]
(writes the ``dp`` rows into benchmarks/results/scale_out.json, keeping the file's other parts)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import RESULTS_DIR, print_table, write_result
from benchmarks.http_overhead import http_throughput, workload
from benchmarks.http_server import server

MODEL = "dummy:qwen3-0.6b"
COLS = ["variant", "gpus", "concurrency", "requests", "output_tokens", "output_tok_s", "per_replica",
        "vs_one_replica"]
TARGET = 1.85


def routed(base_url: str) -> dict[str, float]:
    """Requests each replica took, by /metrics (empty for one replica: no replica label)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "graphserve:replica_requests_total":
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


def run_one(dp: int, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    engine = (f"--dp {dp} --dtype bfloat16 --max-model-len {args.input_len + args.output_len + 64} "
              f"--max-running-requests {args.concurrency} --cuda-graph-max-bs {args.concurrency}")
    with server(args.model, engine) as base_url:
        before = routed(base_url)
        tok_s, tokens, _, _, _, _ = http_throughput(base_url, prompts, args.output_len, args.concurrency, True)
        after = routed(base_url)
    per_replica = {r: after[r] - before.get(r, 0.0) for r in after}
    return {"variant": f"dp{dp}", "gpus": dp, "concurrency": args.concurrency, "requests": len(prompts),
            "output_tokens": tokens, "output_tok_s": tok_s,
            "per_replica": " ".join(f"{r}:{int(v)}" for r, v in sorted(per_replica.items())) or "-"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--requests", type=int, default=0, help="prompts sent (default: 4 x --concurrency)")
    parser.add_argument("--quick", action="store_true", help="2 x --concurrency prompts of 128 output tokens")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    if args.quick:
        args.output_len = min(args.output_len, 128)
    n = args.requests or (2 if args.quick else 4) * args.concurrency
    t0 = time.perf_counter()
    # the server's vocabulary is the preset's; 10 .. 30000 is inside every Qwen3 vocabulary
    prompts = workload(n, args.input_len, 30_000, seed=56)
    rows = [run_one(1, args, prompts), run_one(2, args, prompts)]
    for row in rows:
        row["vs_one_replica"] = row["output_tok_s"] / rows[0]["output_tok_s"]
    print_table(rows, COLS)
    path = RESULTS_DIR / "scale_out.json"
    payload = json.loads(path.read_text()) if path.exists() else {}
    others_env = payload.pop("environment", None)
    if others_env is not None and set(payload) - {"dp", "dp_target", "dp_seconds", "environment_of_other_parts"}:
        payload["environment_of_other_parts"] = others_env  # the allreduce/nodes rows ran elsewhere or earlier
    payload.update({"dp": rows, "dp_target": f"vs_one_replica >= {TARGET}",
                    "dp_seconds": time.perf_counter() - t0})
    print(f"dp 2 / dp 1 output tok/s: {rows[1]['vs_one_replica']:.3f} (target >= {TARGET})")
    print(f"wrote {write_result('scale_out', payload)}")


if __name__ == "__main__":
    main()
