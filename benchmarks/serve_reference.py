"""gpt-oss-20b through `graphserve serve` on SGLang's published serving workload, beside SGLang's published figure
and beside graphserve's offline engine on the same requests.

Workload (the defaults): 256 requests of 1,024 random token ids in (benchmarks.http_overhead.workload, seed 0), 1,024
greedy tokens out with EOS ignored, 32 at a time, on ``dummy:gpt-oss-20b`` (MXFP4 experts as the checkpoint ships,
random weights). SGLang publishes 2,765 output tok/s for gpt-oss-20b on this workload at C=32 on one H100: a figure
from elsewhere (trained weights, whose router is skewed where random weights route near uniformly; SGLang's own
kernels and client), recorded in the result file with ``measured_here: False`` and never measured here.

Each side is its own invocation (``--side``) and writes its row into benchmarks/results/serve_reference.json, where
rows merge per model, side, concurrency and workload:
- ``server`` (the default): a `graphserve serve` subprocess (benchmarks.http_server.server, with ``--step-log``)
  loaded by `graphserve bench`'s load loop with the every-event client (a connection per request, every SSE event
  parsed as it arrives, as SGLang's bench_serving reads), after two short warm-up requests outside the window:
  output tok/s; TTFT, ITL, TPOT and end-to-end percentiles; the engine's steps over the run's window
  (http_overhead.step_timeline).
- ``offline``: the offline engine on the same requests, its running batch capped at the concurrency
  (http_overhead.run_offline, the baseline http_overhead compares against: warmed up and its heap frozen as the
  server's are): output tok/s and its step timeline.
- ``both``: offline, then the server, in one process, where both fit one command (small models, short workloads).
- ``report``: no run; the verdict and the rows from the file.

The verdict, printed first: the server's output tok/s; its ratio to the published figure where the model and the
workload are the figure's; and server over offline (target >= 0.9, http_overhead's) where the file holds an offline
row of the same requests (the prompts' digest), card and commit; otherwise which row is missing and the command that
makes it.

Time on one H100, estimated from the model's shape (gpt-oss-20b: 24 layers, 32 experts of 2880 top-4, hidden 2880,
vocab 201,088). A decode step of 32 requests reads nearly every expert (each untouched with probability
(28/32)^32 ~ 1.4%): 24 x 32 x 24.9e6 weights at 4.25 bits ~ 10.2 GB, with 1.3 GB of bf16 attention and the 1.2 GB
head ~ 12.6 GB: 4.2 ms at 3 TB/s, 10-13 ms at the ~1 TB/s the MXFP4 expert kernels reach at 16-64 tokens
(fp4_kernels.json). 8 waves of ~1,024 decode steps: 8,192 steps x ~12 ms ~ 100 s; the prefill, 262,144 tokens at
~7 GFLOP each (3.6e9 active weights) ~ 1.8 PFLOP, ~10 s. Start-up (imports, 21e9 random weights drawn and quantized,
graph capture, warm-up with its Triton kernels compiled on a bare machine) 60-120 s: each side ~3-4 minutes, both
~6-8, too close to a 600 s command, so each side runs alone and two commands complete the row (the second on the same
warm machine, its compiled kernels cached, with the first's serve_reference.json back under benchmarks/results/):

    GRAPHSERVE_COMMIT=... python3 -m benchmarks.serve_reference --side offline
    GRAPHSERVE_COMMIT=... python3 -m benchmarks.serve_reference            # the server; its verdict reads the file

Run: python3 -m benchmarks.serve_reference [--side server|offline|both|report] [--model dummy:gpt-oss-20b]
     [--num-prompts 256] [--input-len 1024] [--output-len 1024] [--concurrency 32] [--engine-args '...']
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks import common
from benchmarks.common import merge_rows, print_table

RESULT_NAME = "serve_reference"
SERVER_OVER_OFFLINE_MIN = 0.9  # http_overhead's target: the server costs at most a tenth of the offline rate
# SGLang's published gpt-oss-20b serving figure: a reference from elsewhere, never measured by this benchmark
SGLANG_GPT_OSS_20B = {"model": "dummy:gpt-oss-20b", "output_tok_s": 2765.0, "num_prompts": 256, "input_len": 1024,
                      "output_len": 1024, "concurrency": 32, "gpus": "1 x H100",
                      "source": "SGLang's published gpt-oss-20b serving figure", "measured_here": False}
REFERENCES = {"gpt-oss-20b": SGLANG_GPT_OSS_20B}
CASE_FIELDS = ("mode", "concurrency", "workload")  # what tells two rows of one model apart (merge_rows)
LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", choices=("server", "offline", "both", "report"), default="server",
                   help="server (default) or offline alone, both in one process, or report the file's rows only")
    p.add_argument("--model", default=SGLANG_GPT_OSS_20B["model"])
    p.add_argument("--num-prompts", type=int, default=SGLANG_GPT_OSS_20B["num_prompts"])
    p.add_argument("--input-len", type=int, default=SGLANG_GPT_OSS_20B["input_len"])
    p.add_argument("--output-len", type=int, default=SGLANG_GPT_OSS_20B["output_len"])
    p.add_argument("--concurrency", type=int, default=SGLANG_GPT_OSS_20B["concurrency"])
    p.add_argument("--engine-args", default="",
                   help="engine flags for both sides; --max-running-requests is the concurrency, and --max-model-len "
                        "when not given the next power of two >= max(input + output, 512)")
    p.add_argument("--result-name", default=RESULT_NAME, help="benchmarks/results/NAME.json (rows merge)")
    p.add_argument("--step-log-dir", default=None, help="keep the server's --step-log here (default: a temp dir)")
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: must be >= 1")
    if "--max-running-requests" in args.engine_args:
        p.error(f"--engine-args '{args.engine_args}' is invalid: --max-running-requests is --concurrency's")
    return args


def engine_args(args: argparse.Namespace) -> str:
    """Both sides' engine flags: the running batch capped at the concurrency, as the offline side caps it, and a
    context that holds a request (the offline side's 256-token prefill probe too)."""
    extra = f" --max-running-requests {args.concurrency}"
    if "--max-model-len" not in args.engine_args:
        extra += f" --max-model-len {1 << (max(args.input_len + args.output_len, 512) - 1).bit_length()}"
    return (args.engine_args + extra).strip()


def workload_label(args: argparse.Namespace) -> str:
    return f"{args.num_prompts} x {args.input_len} in / {args.output_len} out"


def digest(prompts: list[list[int]]) -> str:
    """The requests' fingerprint: two rows compare only where they ran the same token ids."""
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def base_row(args: argparse.Namespace, mode: str, prompts: list[list[int]], card: str) -> dict[str, Any]:
    return {"model": args.model, "mode": mode, "concurrency": args.concurrency, "workload": workload_label(args),
            "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
            "card": card, "engine_args": engine_args(args), "prompts_digest": digest(prompts)}


def card_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def run_offline_side(args: argparse.Namespace) -> dict[str, Any]:
    """The offline engine's row: http_overhead's baseline at this one concurrency."""
    from benchmarks.http_overhead import run_offline

    ns = argparse.Namespace(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                            prompts_as="ids", levels=[args.concurrency])
    off = run_offline(args.model, engine_args(args), ns)
    expected = args.num_prompts * args.output_len
    if off["tokens"] != expected:
        raise RuntimeError(f"the offline engine generated {off['tokens']} tokens, the workload asks {expected}")
    c = args.concurrency
    return {**base_row(args, "offline", off["prompts"], card_name()), "output_tok_s": off["tok_s"][c],
            "tokens": off["tokens"], "steps": off["steps"][c], "prefill_256_ms": off["prefill_256_ms"]}


def run_server_side(args: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    """The server's row: `graphserve serve` under the every-event client at the concurrency."""
    from benchmarks.http_overhead import read_step_log, step_timeline, workload
    from benchmarks.http_server import server
    from graphserve.bench.client import discover_model
    from graphserve.bench.datasets import BenchRequest
    from graphserve.bench.runner import BenchSettings, run_benchmark
    from graphserve.models.parallel_check import model_hf_config

    vocab = model_hf_config(args.model)["vocab_size"]  # the offline side's prompts come from the same vocabulary
    prompts = workload(args.num_prompts, args.input_len, vocab)
    warm = [BenchRequest(p, len(p), 4) for p in workload(2, args.input_len, vocab, seed=1)]  # other ids: no cache hit
    measured = [BenchRequest(p, len(p), args.output_len) for p in prompts]
    step_log = os.path.join(log_dir, f"{args.model.replace(':', '_').replace('/', '_')}_steps.jsonl")
    with server(args.model, engine_args(args), ("--step-log", step_log)) as base_url:
        s = BenchSettings(base_url=base_url, model=discover_model(base_url, "openai"), stream=True, ignore_eos=True,
                          temperature=0.0, max_concurrency=args.concurrency, warmup_requests=0,
                          metrics_url=base_url + "/metrics", client="every-event")
        run_benchmark(s, warm)  # the connection path and the first requests' host work, outside the window
        wall0 = time.time()
        out = run_benchmark(s, measured)
        wall1 = time.time()
        records = read_step_log(step_log)  # flushed a line at a time: complete once the last response is read
    summary = out["summary"]
    expected = args.num_prompts * args.output_len
    if summary["failed"] or summary["total_output_tokens"] != expected:
        raise RuntimeError(f"the server completed {summary['completed']} requests, {summary['failed']} failed "
                           f"({summary['failure_reasons']}), {summary['total_output_tokens']} tokens of {expected}")
    return {**base_row(args, "server", prompts, card_name()), "output_tok_s": summary["output_throughput"],
            "tokens": summary["total_output_tokens"], "duration_s": summary["duration_s"],
            "achieved_concurrency": summary["achieved_concurrency"], "client": "every-event",
            **{key: summary[key] for key in LATENCIES}, "client_warnings": summary["warnings"],
            "steps": step_timeline(records, wall0, wall1, args.concurrency)}


def reference_for(row: dict[str, Any]) -> dict[str, Any] | None:
    """The published figure whose model and workload are the row's, or None."""
    return next((ref for ref in REFERENCES.values()
                 if all(row.get(k) == ref[k] for k in ("model", "num_prompts", "input_len", "output_len",
                                                       "concurrency"))), None)


def partner(rows: list[dict[str, Any]], row: dict[str, Any], mode: str) -> dict[str, Any] | None:
    """The newest row of ``mode`` on the same model, concurrency and workload as ``row``."""
    found = [r for r in rows if r.get("mode") == mode and all(r.get(k) == row.get(k) for k in
                                                              ("model", "concurrency", "workload"))]
    return max(found, key=lambda r: r.get("measured_at", {}).get("started", ""), default=None)


def verdict(rows: list[dict[str, Any]], model: str, concurrency: int, workload: str,
            command: str) -> tuple[str, dict[str, Any]]:
    """(the verdict line, its entry) for the file's newest server row of this model, concurrency and workload,
    beside the published figure and the offline row of the same requests, card and commit."""
    key = {"model": model, "concurrency": concurrency, "workload": workload}
    srv, off = partner(rows, key, "server"), partner(rows, key, "offline")
    entry: dict[str, Any] = {**key, "server_tok_s": None, "offline_tok_s": None, "vs_offline": None,
                             "reference_tok_s": None, "vs_reference": None, "target": {"vs_offline_min":
                                                                                       SERVER_OVER_OFFLINE_MIN},
                             "meets_target": None}
    head = f"verdict: {model} at C={concurrency} ({workload}): "
    if srv is None:
        have = f"offline {off['output_tok_s']:,.1f} tok/s on {off['card']}; " if off else ""
        return head + have + f"no server row yet: run {command} --side server", entry
    at = srv.get("measured_at", {})
    entry.update(server_tok_s=srv["output_tok_s"], server_run=at.get("run_id"), card=srv["card"],
                 commit=at.get("commit"))
    line = head + f"server {srv['output_tok_s']:,.1f} output tok/s on {srv['card']} at {at.get('commit', '?')}"
    ref = reference_for(srv)
    if ref is not None:
        entry.update(reference_tok_s=ref["output_tok_s"], vs_reference=srv["output_tok_s"] / ref["output_tok_s"])
        line += (f", {entry['vs_reference']:.2f} x {ref['source']} ({ref['output_tok_s']:,.0f} tok/s on "
                 f"{ref['gpus']}; NOT measured here)")
    else:
        line += "; no published figure for this model and workload"
    same = off is not None and off["prompts_digest"] == srv["prompts_digest"] and off["card"] == srv["card"] and \
        off.get("measured_at", {}).get("commit") == at.get("commit")
    if same:
        entry.update(offline_tok_s=off["output_tok_s"], vs_offline=srv["output_tok_s"] / off["output_tok_s"],
                     offline_run=off.get("measured_at", {}).get("run_id"))
        entry["meets_target"] = entry["vs_offline"] >= SERVER_OVER_OFFLINE_MIN
        line += (f"; server/offline {entry['vs_offline']:.2f} (offline {off['output_tok_s']:,.1f} tok/s, same "
                 f"requests, card and commit; target >= {SERVER_OVER_OFFLINE_MIN}: "
                 f"{'met' if entry['meets_target'] else 'MISSED'})")
    elif off is not None:
        line += (f"; the offline row ({off['card']} at {off.get('measured_at', {}).get('commit', '?')}, requests "
                 f"{off['prompts_digest']}) is not this run's card, commit and requests {srv['prompts_digest']}: "
                 f"rerun {command} --side offline")
    else:
        line += f"; no offline row yet: run {command} --side offline"
    return line, entry


def report(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Print the verdict first, then this model's rows of the file; returns the verdict's entry."""
    path = common.RESULTS_DIR / f"{name}.json"
    rows = json.loads(path.read_text()).get("rows", []) if path.exists() else []
    command = f"python3 -m benchmarks.serve_reference --model {args.model} --num-prompts {args.num_prompts} " \
              f"--input-len {args.input_len} --output-len {args.output_len} --concurrency {args.concurrency}"
    line, entry = verdict(rows, args.model, args.concurrency, workload_label(args), command)
    print(line)
    mine = [r for r in rows if r.get("model") == args.model and r.get("workload") == workload_label(args)
            and r.get("concurrency") == args.concurrency]
    table = [{"mode": r["mode"], "card": r["card"], "commit": r.get("measured_at", {}).get("commit"),
              "output_tok_s": r["output_tok_s"],
              **{f"{k[:-3]}_{q}": (r.get(k) or {}).get(q) for k in LATENCIES[:2] for q in ("median", "p99")}}
             for r in mine]
    if table:
        print_table(table, ["mode", "card", "commit", "output_tok_s", "ttft_median", "ttft_p99", "itl_median",
                            "itl_p99"])
    for r in mine:
        st = r.get("steps") or {}
        print(f"{r['mode']}: {st.get('steps', 0)} steps, busy {st.get('busy', 0.0):.2f}, mean batch "
              f"{st.get('mean_batch', 0.0):.1f}, decode {st.get('decode_steps', 0)} of "
              f"{st.get('decode_step_ms', 0.0):.2f} ms at batch {st.get('decode_batch', 0.0):.1f}")
    return entry


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    if args.side in ("offline", "both"):
        rows.append(run_offline_side(args))
    if args.side in ("server", "both"):
        with tempfile.TemporaryDirectory(prefix="serve_reference_") as scratch:
            log_dir = args.step_log_dir or scratch
            os.makedirs(log_dir, exist_ok=True)
            rows.append(run_server_side(args, log_dir))
    if rows:
        merge_rows(args.result_name, rows, case_fields=CASE_FIELDS, reference=dict(REFERENCES))
    entry = report(args.result_name, args)
    if rows:  # the verdict of this run's file, beside its rows (a per-model table: it merges as they do)
        merge_rows(args.result_name, [], case_fields=CASE_FIELDS, verdict=[entry])
    return 0


if __name__ == "__main__":
    sys.exit(main())
