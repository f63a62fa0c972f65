"""Weights asked of L2 ahead of the launch that reads them (kernels/l2_prefetch.py), by link and budget.

For each model and batch size: one model load, one CUDA-graph capture of the decode step per setting, replayed in
turns for ``--rounds`` rounds (benchmarks/pdl.py ``timed_captures``: clock and thermal drift fall on every variant
alike); each variant's time is the median of its rounds. Settings: "off" (no link asks), "defaults" (the budgets
the code ships, ``DEFAULT_MB``), and each ``--variant LINK=MB,...`` (links not named keep their defaults). The MoE
layers route by their own routers, as benchmarks.fp8 runs them (the gate launch that asks is the router's own,
which uniform routing replaces). The floor is the bytes the step must read over the best read bandwidth measured
in this run (benchmarks/roofline.py); ``ratio X`` is each variant's ratio to it.

Run: python3 -m benchmarks.l2_prefetch [--models ...] [--fp8-models dummy:qwen3-30b-a3b] [--bs 64] [--ctx 2048]
     [--variant attention=8 --variant attention=16,gate=0 ...]
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.pdl import compare_captures
from graphserve.kernels.l2_prefetch import LINKS, l2_prefetch


def parse_variant(spec: str) -> dict[str, float]:
    """``LINK=MB,LINK=MB`` -> {link: MB}, refused by name where a link or a number is wrong."""
    out = {}
    for part in spec.split(","):
        link, _, mb = part.partition("=")
        if link not in LINKS:
            raise SystemExit(f"--variant {spec!r}: {link!r} is not a link; links: {LINKS}")
        try:
            out[link] = float(mb)
        except ValueError:
            raise SystemExit(f"--variant {spec!r}: {mb!r} is not a number of MB") from None
    return out


def main() -> None:
    # --variant is this script's own; the rest is compare_captures' command line
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--variant", action="append", default=[], metavar="LINK=MB,...")
    own, rest = pre.parse_known_args()
    sys.argv = [sys.argv[0], *rest]
    scopes = {"off": lambda: l2_prefetch(0), "defaults": lambda: l2_prefetch()}
    for spec in own.variant:
        budgets = parse_variant(spec)
        scopes[spec] = lambda budgets=budgets: l2_prefetch(**budgets)
    args, rows, finish = compare_captures(__doc__, scopes, result_name="l2_prefetch", models=[],
                                          fp8_models=["dummy:qwen3-30b-a3b"], bs=[64], routing="router")
    for r in rows:
        for k, ms in r["variants_ms"].items():
            r[k] = ms
            r[f"ratio {k}"] = ms / r["floor_ms"]
    finish(["model", "quantization", "bs", "ctx", "experts_touched", *scopes, "floor_ms",
            *(f"ratio {k}" for k in scopes)])


if __name__ == "__main__":
    main()
