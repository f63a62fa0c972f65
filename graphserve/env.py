"""Every GRAPHSERVE_* environment switch, declared once with its default and what it does.

Code reads a switch through ``get`` / ``flag`` / ``path`` / ``is_set``, never ``os.environ`` directly, so a
switch nobody declared cannot steer the engine unseen (tests/unit/test_env.py reads the tree for that). The README's
table is this module's output:

    python3 -m graphserve.env --markdown
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Switch:
    name: str
    default: str | None  # None: unset, the reader decides (the doc says what happens)
    doc: str


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("GRAPHSERVE_CACHE", "~/.cache/graphserve",
           "Where `builtin:` checkpoints and converted tokenizers are made and kept."),
    Switch("GRAPHSERVE_CACHE_DIR", None,
           "Root of the per-card kernel tables `graphserve tune` writes and the engine reads "
           "(unset: `$XDG_CACHE_HOME/graphserve`, else `~/.cache/graphserve`)."),
    Switch("GRAPHSERVE_API_KEY", None,
           "Bearer key the server asks of every route but `/health` and `/metrics` when `--api-key` is not "
           "given (`$VLLM_API_KEY` is read first)."),
    Switch("GRAPHSERVE_PDL", "1",
           "`0` launches no Triton kernel with programmatic dependent launch (Hopper and later)."),
    Switch("GRAPHSERVE_PDL_SKIP", None,
           "Comma-separated kernel functions launched without PDL (unset: `_fp8_gemv_kernel`); a name that is "
           "no kernel is refused."),
    Switch("GRAPHSERVE_PDL_RELEASE_LEFT_OUT", "1",
           "`0`: a kernel left out of PDL no longer lets the PDL kernel after it launch during its tail."),
    Switch("GRAPHSERVE_PDL_JOIN", "1",
           "`0`: the output projection after decode attention stays off PDL even where attention runs in one "
           "wave."),
    Switch("GRAPHSERVE_ALLREDUCE", None,
           "`nccl`, `oneshot` or `twoshot`: the all-reduce path for every message size it can take, for A/B runs "
           "(unset: each size takes the path measured fastest at start-up)."),
    Switch("GRAPHSERVE_L2_PREFETCH_MB", None,
           "MB a layer that each MoE L2-prefetch link asks for, 0..48 (unset: 24 each; `0` turns both off)."),
    Switch("GRAPHSERVE_ENGINE_CPUS", None,
           "CPUs the server's engine process runs on, as `taskset -c` writes them (`0`, `0,2`, `4-7`); the HTTP "
           "front-ends are kept off them, so their tokenizing and streaming never take the core an eager prefill "
           "step's launches wait on (graphserve/engine/cpu_affinity.py). Unset, or with `--engine-in-process`: the OS "
           "places every process."),
    Switch("GRAPHSERVE_GPU_MEMORY_FRACTION", None,
           "A fraction in (0, 1]: each engine process caps its allocator at that share of its GPU and plans its "
           "memory as if the card held only that much (graphserve/engine/gpu_share.py), so engines that share one "
           "card (`benchmarks.gpu_tests --jobs N`) do not take each other's memory. Unset: the whole card."),
    Switch("GRAPHSERVE_FAULT_INJECT", None,
           "Test hook: a prompt holding this marker makes the server's engine step fail, to exercise the "
           "error path."),
    Switch("GRAPHSERVE_COMMIT", None,
           "The commit benchmark and tuning results are stamped with, for a tree that travels without `.git` "
           "(unset: `git rev-parse --short HEAD`); `python3 -m graphserve.tuning.timing` prints it as `COMMIT:TREE`, "
           "whose tree id lets a copy beside an older `.git` prove it holds that commit's code."),
    Switch("GRAPHSERVE_ALLOW_DIRTY", "0",
           "`1` lets results be written from a tree with uncommitted changes under `graphserve/` or "
           "`benchmarks/`, their commit stamped `-dirty`."),
)}


def switch(name: str) -> Switch:
    try:
        return SWITCHES[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in graphserve/env.py (declared: {', '.join(SWITCHES)})") from None


def is_set(name: str) -> bool:
    return switch(name).name in os.environ


def get(name: str) -> str | None:
    """The switch's value as set (an empty string included), else its declared default."""
    return os.environ.get(name, switch(name).default)


def flag(name: str) -> bool:
    """An on/off switch: on unless its value is "0"."""
    return get(name) != "0"


def path(name: str) -> Path | None:
    """A folder switch, ``~`` expanded; an empty value counts as unset."""
    value = os.environ.get(name) or switch(name).default
    return Path(value).expanduser() if value else None


def markdown() -> str:
    lines = ["| Variable | Default | What it does |", "|---|---|---|"]
    lines += [f"| `{s.name}` | {f'`{s.default}`' if s.default is not None else 'unset'} | {s.doc} |"
              for s in SWITCHES.values()]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", action="store_true", help="print the README's table of switches")
    args = p.parse_args()
    if args.markdown:
        print(markdown())
    else:
        for s in SWITCHES.values():
            value = os.environ.get(s.name, "(unset)")
            print(f"{s.name:<32} {value:<20} default {s.default or 'unset'}")


if __name__ == "__main__":
    main()
