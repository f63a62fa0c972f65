"""The experts' first weights asked of L2 by the router's gate launch, and the next layer's qkv weight by the slot
sum's (kernels/l2_prefetch.py), by budget.

For each model and batch size: one model load, one CUDA-graph capture of the decode step per setting
(``expert_prefetch(mb)``; "off" asks for nothing), replayed in turns for ``--rounds`` rounds
(benchmarks/pdl.py ``timed_captures``: clock and thermal drift fall on every variant alike); each variant's time is
the median of its rounds. The MoE layers route by their own routers, as benchmarks.fp8 runs them (the gate launch
that asks is the router's own, which uniform routing replaces). The floor is the bytes the step must read over the
best read bandwidth measured in this run (benchmarks/roofline.py); ``ratio X`` is each variant's ratio to it.

Run: python3 -m benchmarks.expert_prefetch [--fp8-models dummy:qwen3-30b-a3b] [--bs 64] [--ctx 2048]
     [--mb 16 32 48] [--only 24]  (--only: those budgets on each link alone too)
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.pdl import compare_captures
from graphserve.kernels.l2_prefetch import MAX_MB, expert_prefetch

DEFAULT_MB = [16, 24, 32, 40, 48]


def label(mb: float) -> str:
    return "off" if mb == 0 else f"{mb:g} MB"


def main() -> None:
    # --mb is this script's own; the rest is compare_captures' command line
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--mb", nargs="+", type=float, default=DEFAULT_MB, help=f"budgets a layer, 0..{MAX_MB:g} MB")
    pre.add_argument("--only", nargs="*", type=float, default=[], help="budgets to time on each link alone too")
    own, rest = pre.parse_known_args()
    if not all(0 < mb <= MAX_MB for mb in own.only) or not all(0 <= mb <= MAX_MB for mb in own.mb):
        pre.error(f"--mb {own.mb} / --only {own.only}: every budget must be in 0..{MAX_MB:g} MB (--only: above 0)")
    sys.argv = [sys.argv[0], *rest]
    scopes = {label(mb): (lambda mb=mb: expert_prefetch(mb)) for mb in sorted({0.0, *own.mb})}
    # each budget on one link alone
    scopes.update({f"{label(mb)} experts only": (lambda mb=mb: expert_prefetch(mb, 0)) for mb in own.only})
    scopes.update({f"{label(mb)} next only": (lambda mb=mb: expert_prefetch(0, mb)) for mb in own.only})
    args, rows, finish = compare_captures(__doc__, scopes, result_name="expert_prefetch", models=[],
                                          fp8_models=["dummy:qwen3-30b-a3b"], bs=[64], routing="router")
    for r in rows:
        for k, ms in r["variants_ms"].items():
            r[k] = ms
            r[f"ratio {k}"] = ms / r["floor_ms"]
    finish(["model", "quantization", "bs", "ctx", "experts_touched", *scopes, "floor_ms",
            *(f"ratio {k}" for k in scopes)])


if __name__ == "__main__":
    main()
