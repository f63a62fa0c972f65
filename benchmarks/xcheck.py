"""The cross-check of our client against an external one on the same server: do they count the same output
tokens and see the same TTFT, within the noise the external client shows on its own?

Each ``--run LABEL FILE ...`` is one sitting against one server (LABEL names it: the server's commit), with
the prefix cache flushed before every client run. FILEs are ``graphserve bench --output-file`` JSONs and the
JSONL that SGLang's ``bench_serving.py --output-file`` appends to (its last line is read). Both clients ran
the same workload (same dataset, lengths, concurrency, seed); the external client itself stays outside the
repository, only its output files are read here.

Per run, ``ours`` and ``external`` are the means over each client's backends of mean and median TTFT, and
``noise`` is the spread (max - min) of the external client's own backends in that run: the same client
against the same server, minutes apart, differs by that much. Pooled over runs (the row ``all runs``),
``noise`` is the largest change of one external backend between two runs. ``within`` says whether |ours - external| <= noise.

The file's ``environment`` says where the runs were measured: the date of our client's files, the run labels
(the servers' commits) and ``--device``, the card the server ran on, as the command line gives it.

Run: python3 -m benchmarks.xcheck --device "NVIDIA H200" --run fed59c7 DIR/gs_*.json DIR/bs_*.jsonl --run e78b826 ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import print_table, write_result

METRICS = ("ttft_mean_ms", "ttft_median_ms")


def read_row(path: Path) -> dict[str, Any]:
    """One client run's totals, from a graphserve bench JSON or a bench_serving JSONL."""
    text = path.read_text().strip()
    if path.suffix == ".jsonl":
        d = json.loads(text.splitlines()[-1])
        return {"client": "bench_serving", "backend": d["backend"], "completed": d["completed"],
                "output_tokens": d["total_output_tokens"], "output_tok_s": d["output_throughput"],
                "ttft_mean_ms": d["mean_ttft_ms"], "ttft_median_ms": d["median_ttft_ms"],
                "ttft_p99_ms": d["p99_ttft_ms"], "tpot_mean_ms": d["mean_tpot_ms"], "file": path.name}
    d = json.loads(text)
    s = d["summary"]
    return {"client": "graphserve", "backend": d["config"]["backend"], "completed": s["completed"],
            "output_tokens": s["total_output_tokens"], "output_tok_s": s["output_throughput"],
            "ttft_mean_ms": s["ttft_ms"]["mean"], "ttft_median_ms": s["ttft_ms"]["median"],
            "ttft_p99_ms": s["ttft_ms"]["p99"], "tpot_mean_ms": s["tpot_ms"]["mean"], "file": path.name}


def compare(rows: list[dict], noise: dict[str, float]) -> dict[str, Any]:
    """ours vs external per metric, against ``noise`` per metric."""
    out: dict[str, Any] = {}
    for m in METRICS:
        ours = statistics.mean(r[m] for r in rows if r["client"] == "graphserve")
        ext = statistics.mean(r[m] for r in rows if r["client"] != "graphserve")
        out[m] = {"ours": ours, "external": ext, "difference": ours - ext, "noise": noise[m],
                  "within": abs(ours - ext) <= noise[m]}
    return out


def summarize(runs: list[tuple[str, list[dict]]]) -> dict[str, Any]:
    per_run = []
    for label, rows in runs:
        clients = {r["client"] for r in rows}
        if clients != {"graphserve", "bench_serving"}:
            raise ValueError(f"run {label}: needs both clients' files, got {sorted(clients)}")
        ext = [r for r in rows if r["client"] != "graphserve"]
        spread = {m: max(r[m] for r in ext) - min(r[m] for r in ext) for m in METRICS}
        per_run.append({"run": label, "same_output_tokens": len({(r["completed"], r["output_tokens"])
                                                                 for r in rows}) == 1,
                        **compare(rows, spread)})
    out: dict[str, Any] = {"comparison": per_run}
    if len(runs) > 1:
        by_backend: dict[str, list[dict]] = {}
        for _, rows in runs:
            for r in rows:
                if r["client"] != "graphserve":
                    by_backend.setdefault(r["backend"], []).append(r)
        noise = {m: max((max(r[m] for r in rs) - min(r[m] for r in rs) for rs in by_backend.values()
                         if len(rs) > 1), default=0.0) for m in METRICS}
        pooled = [r for _, rows in runs for r in rows]
        per_run.append({"run": "all runs", "same_output_tokens": all(p["same_output_tokens"] for p in per_run)
                        and len({r["output_tokens"] for r in pooled}) == 1, **compare(pooled, noise)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", nargs="+", action="append", required=True, metavar=("LABEL", "FILE"),
                   help="a run's label (the server's commit), then its client output files")
    p.add_argument("--device", required=True, help="the card the server ran on (the files do not say)")
    p.add_argument("--result-name", default="xcheck_bench_serving")
    args = p.parse_args()
    runs = []
    for label, *files in args.run:
        if not files:
            p.error(f"--run {label}: no files given")
        rows = [{"run": label, **read_row(Path(f))} for f in files]
        runs.append((label, rows))
    dates = sorted({t[:10] for _, *files in args.run for f in files if f.endswith(".json")
                    if (t := json.loads(Path(f).read_text()).get("environment", {}).get("time"))})
    all_rows = [r for _, rows in runs for r in rows]
    print_table(all_rows, ["run", "client", "backend", "completed", "output_tokens", "output_tok_s",
                           "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms", "tpot_mean_ms"])
    summary = summarize(runs)
    print(json.dumps(summary, indent=1))
    measured = {"date": "..".join(dict.fromkeys([dates[0], dates[-1]])) if dates else None,
                "commit": "+".join(label for label, _ in runs), "device": args.device}
    path = write_result(args.result_name, {"environment": measured, "rows": all_rows, **summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
