"""Before and after a restructuring, on the same card in the same call: decode steps and HTTP ratios of two trees.

A restructuring (one engine client, one output path, stop strings in the engine core) must not cost speed. This
runs the same two benchmarks in an older tree (``--base``, a checkout of the commit before) and in this one, in
alternation, each in its own process with its own tree first on the import path:

- ``benchmarks.decode`` (step time at the given batch sizes and context, graphs on), and
- ``benchmarks.http_overhead`` (the same requests through ``LLM.generate`` and through ``/v1/completions``; its
  ratio is HTTP output tok/s over offline tok/s on the same requests and scheduler settings).

Each row gives both sides' figures and the change (head ÷ base − 1); the verdict says whether every change lies
within ``--tolerance``. With ``--rounds`` above 1 the sides alternate (base, head, base, head, ...) and each side's
figure is the median of its rounds.

Run: python3 -m benchmarks.house_ab --base .base [--rounds 1] [--tolerance 0.03]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import write_result

HERE = Path(__file__).resolve().parents[1]


def _env(tree: Path, commit: str | None) -> dict[str, str]:
    """The environment of a run in ``tree``: that tree first on the import path, and no other graphserve tree."""
    env = dict(os.environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() not in (HERE, tree.resolve())]  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *rest])
    env.pop("OUT", None)  # the sides' own result files stay in their trees; this module writes the comparison
    if commit:
        env["GRAPHSERVE_COMMIT"] = commit
    return env


def _run(tree: Path, commit: str | None, module: str, args: list[str], result: str, timeout: float) -> dict:
    """Run ``python3 -m module args`` in ``tree`` and return the result file it wrote there."""
    path = tree / "benchmarks" / "results" / f"{result}.json"
    if path.exists():
        path.unlink()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=tree, env=_env(tree, commit),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if proc.returncode != 0 or not path.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{module} in {tree} exited {proc.returncode} without {path.name}:\n{tail}")
    print(f"  {module} in {tree.name or tree}: {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads(path.read_text())


def decode_figures(payload: dict) -> dict[str, float]:
    """``decode bs B ctx C`` -> step_ms, from a benchmarks.decode result (graph rows)."""
    return {f"decode {r['model']} bs {r['bs']} ctx {r['ctx']} step_ms": r["step_ms"]
            for r in payload["rows"] if r.get("graph", True)}  # fmt: skip


def http_figures(payload: dict) -> dict[str, float]:
    """``http MODEL C mode`` -> ratio (HTTP tok/s ÷ offline tok/s on the same requests), from http_overhead."""
    return {f"http {r['model']} C{r['concurrency']} {r['mode']} ratio": r["ratio"] for r in payload["rows"]}


def compare(base: dict[str, list[float]], head: dict[str, list[float]], tolerance: float) -> list[dict]:
    """One row per figure both sides measured: the medians, and head ÷ base − 1. A step time may not grow by
    more than ``tolerance``; an HTTP ratio may not fall by more than it."""
    rows = []
    for key in sorted(set(base) & set(head)):
        b, h = statistics.median(base[key]), statistics.median(head[key])
        change = h / b - 1.0
        worse = change if key.endswith("step_ms") else -change
        rows.append({"case": key, "base": b, "head": h, "change": change, "base_runs": base[key],
                     "head_runs": head[key], "within": worse <= tolerance})  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="a checkout of the commit before (its graphserve/ and benchmarks/)")
    p.add_argument("--base-commit", default=None, help="the commit --base holds, stamped into its result files")
    p.add_argument("--decode-model", default="dummy:llama3-8b")
    p.add_argument("--bs", nargs="+", default=["1", "64"])
    p.add_argument("--ctx", default="512")
    p.add_argument("--http-model", default="dummy:qwen3-0.6b")
    p.add_argument("--concurrency", default="64")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--tolerance", type=float, default=0.03)
    p.add_argument("--timeout", type=float, default=400.0, help="seconds a benchmark run may take")
    a = p.parse_args()
    base = Path(a.base).resolve()
    sides = {"base": (base, a.base_commit), "head": (HERE, None)}
    figures: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
    envs: dict[str, list[dict]] = {"base": [], "head": []}
    decode_args = ["--models", a.decode_model, "--bs", *a.bs, "--ctx", a.ctx]
    http_args = ["--models", a.http_model, "--quick", "--skip-ready-warm", "--concurrency", a.concurrency,
                 "--result-name", "house_ab_http"]  # fmt: skip
    for r in range(a.rounds):
        for side in ("base", "head") if r % 2 == 0 else ("head", "base"):
            tree, commit = sides[side]
            print(f"round {r + 1}, {side}", flush=True)
            dec = _run(tree, commit, "benchmarks.decode", decode_args, "decode", a.timeout)
            http = _run(tree, commit, "benchmarks.http_overhead", http_args, "house_ab_http", a.timeout)
            envs[side].append({"decode": dec.get("environment"), "http": http.get("environment"),
                               "decode_read_ceiling": dec.get("ceilings", {}).get("read")})  # fmt: skip
            for key, v in {**decode_figures(dec), **http_figures(http)}.items():
                figures[side].setdefault(key, []).append(v)
    rows = compare(figures["base"], figures["head"], a.tolerance)
    ok = bool(rows) and all(r["within"] for r in rows)
    verdict = (f"every figure within {a.tolerance:.0%} of before" if ok else
               "slower than before: " + ", ".join(f"{r['case']} {r['change']:+.1%}" for r in rows if not r["within"]))
    print(verdict)
    for r in rows:
        print(f"  {r['case']:<52} base {r['base']:9.4f}  head {r['head']:9.4f}  {r['change']:+.1%}")
    write_result("house_ab", {"verdict": verdict, "tolerance": a.tolerance, "rounds": a.rounds,
                              "base_tree": str(base), "runs": envs, "rows": rows})  # fmt: skip
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
