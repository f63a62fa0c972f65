"""Programmatic dependent launch on and off: the same decode step captured both ways, timed in turns.

For each model and batch size: one model load, one KV cache, two CUDA-graph captures of the decode step
(kernels/pdl.py: ``pdl(False)``, and ``pdl(True)`` as the engine runs it, with the kernels it leaves out by
default; a third capture with every kernel in), replayed alternately for ``--rounds`` rounds so clock and
thermal drift fall on both alike; each side's time is the median of its rounds. ``--skip a,b --skip c`` adds
one more capture per list: PDL on except the named kernels (kernels/pdl.py), to find a kernel that loses by it. MoE models route uniformly
(``--moe-routing uniform``), so both sides touch the same experts. The floor is the bytes the step must read
(ModelDescription.decode_read_bytes, with the experts the replay actually touched) over the best read
bandwidth measured in this run (benchmarks/roofline.py).

Run: python3 -m benchmarks.pdl [--models dummy:qwen3-30b-a3b dummy:llama3-8b dummy:deepseek-v2-lite]
     [--fp8-models dummy:llama3-8b] [--bs 1 8] [--ctx 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
from collections.abc import Callable

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.decode import make_batch, step_cost
from benchmarks.decode_setup import captured_graphs, context_kv_caches
from benchmarks.moe import experts_touched, set_routing, touched_total
from benchmarks.roofline import measured_read_bw
from graphserve.config import KV_CACHE_DTYPES, EngineConfig
from graphserve.kernels.argmax import greedy_argmax
from graphserve.kernels.pdl import DEFAULT_SKIP, checked_skip, pdl, pdl_on
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.models.loader import load_model

COLS = ["model", "quantization", "bs", "ctx", "off_ms", "on_ms", "speedup", "floor_ms", "ratio_off", "ratio_on"]


def bench_model(name: str, quantization: str, sizes: list[int], ctx: int, rounds: int, bw,
                skips: list[frozenset[str]]) -> list[dict]:
    # variant: (PDL on, kernels left out); "off", "on", then "on except ..." per --skip list
    variants = {"off": (False, frozenset()), "on": (True, DEFAULT_SKIP)}  # "on": as the engine runs
    if DEFAULT_SKIP:
        variants["on with every kernel"] = (True, frozenset())
    variants.update({"on except " + ",".join(sorted(skip)): (True, skip) for skip in skips})
    scopes = {label: (lambda e=enabled, s=skip: pdl(e, s)) for label, (enabled, skip) in variants.items()}
    rows = timed_captures(name, quantization, sizes, ctx, rounds, bw, scopes)
    for r in rows:
        r["off_ms"], r["on_ms"] = r["variants_ms"]["off"], r["variants_ms"]["on"]
        r["speedup"] = r["off_ms"] / r["on_ms"]
    return rows


def timed_captures(name: str, quantization: str, sizes: list[int], ctx: int, rounds: int, bw,
                   scopes: dict[str, Callable[[], contextlib.AbstractContextManager]],
                   kv_cache_dtype: str = "auto", routing: str = "uniform") -> list[dict]:  # fmt: skip
    """One model load and KV cache, one CUDA-graph capture of the decode step per entry of ``scopes`` (captured
    inside the context its factory makes), replayed in turns for ``rounds`` rounds; per batch size the median
    of each variant's rounds (``variants_ms``), the bytes the step reads and whether every variant's greedy
    tokens equal the first's. ``routing``: MoE layers route "uniform"ly, or by their own router (anything else:
    benchmarks/moe.set_routing)."""
    device = torch.device("cuda")
    cfg = EngineConfig(model=name, device="cuda", quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                       max_model_len=ctx + 64)  # fmt: skip
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    layers = set_routing(model, routing)
    kv_caches = context_kv_caches(info, max(sizes), ctx, cfg.block_size, device)
    backend = TritonAttentionBackend()
    rows = []
    with torch.inference_mode():
        graphs = {}
        for label, scope in scopes.items():
            with scope():
                graphs[label] = captured_graphs(model, backend, kv_caches, sizes, ctx, cfg, device)
        first = next(iter(scopes))
        for bs in sizes:
            batch = make_batch(bs, ctx, kv_caches, backend, info.vocab_size)
            times: dict[str, list[float]] = {label: [] for label in scopes}
            tokens = {label: greedy_argmax(graphs[label].replay(batch)) for label in scopes}
            for _ in range(rounds):
                for label in scopes:
                    step = lambda g=graphs[label], b=batch: greedy_argmax(g.replay(b))  # noqa: E731
                    times[label].append(cuda_time_ms(step, warmup=2, iters=10))
            touched = experts_touched(layers)
            nbytes = step_cost(info, bs, ctx, touched)[0]  # as every decode benchmark counts a step
            med = {label: statistics.median(t) for label, t in times.items()}
            for ms in med.values():
                bw.observe(f"{name} {quantization} decode bs={bs}", nbytes, ms)
            rows.append({"model": name, "quantization": quantization, "kv_cache_dtype": kv_cache_dtype, "bs": bs,
                         "ctx": ctx, "bytes": nbytes, "routing": routing,
                         "experts_touched": touched_total(touched),
                         "same_tokens": all(torch.equal(tokens[first], t) for t in tokens.values()),
                         "variants_ms": med, "rounds_ms": times})
            print(f"{name} {quantization} bs={bs}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items()))
        del graphs
    del model, loaded, kv_caches
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def compare_captures(doc: str, scopes: dict[str, Callable[[], contextlib.AbstractContextManager]], *,
                     result_name: str, models: list[str], fp8_models: list[str],
                     bs: list[int], routing: str = "uniform",
                     ) -> tuple[argparse.Namespace, list[dict], Callable[[list[str]], None]]:  # fmt: skip
    """A comparison script's common part: its command line (``--models``, ``--fp8-models``, ``--bs``, ``--ctx``,
    ``--rounds``, ``--kv-cache-dtype``, ``--result-name``; the defaults given), the read probe, and
    ``timed_captures`` of ``scopes`` per model, quantization and context. Returns the arguments, the rows (each
    with its ``floor_ms`` against the run's best rate) and ``finish(columns)``, which prints the table and writes
    the result."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--models", nargs="*", default=models, help="run in the checkpoint's dtype")
    p.add_argument("--fp8-models", nargs="*", default=fp8_models, help="run with --quantization fp8")
    p.add_argument("--bs", nargs="+", type=int, default=bs)
    p.add_argument("--ctx", nargs="+", type=int, default=[512])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--result-name", default=result_name, help="benchmarks/results/NAME.json")
    args = p.parse_args()
    if args.rounds < 1 or min(args.ctx) < 1 or min(args.bs) < 1:
        p.error(f"--rounds {args.rounds}, --ctx {args.ctx} and --bs {args.bs} must all be >= 1")
    bw = measured_read_bw()
    print(bw.describe())
    rows = []
    for quantization, names in (("none", args.models), ("fp8", args.fp8_models)):
        for name in names:
            for ctx in args.ctx:
                rows += timed_captures(name, quantization, args.bs, ctx, args.rounds, bw, scopes, args.kv_cache_dtype,
                                       routing)  # fmt: skip
    for r in rows:  # every row against the best rate of the whole run
        r["floor_ms"] = bw.floor_ms(r["bytes"])

    def finish(columns: list[str]) -> None:
        print_table(rows, columns)
        write_result(args.result_name, {"read_bandwidth": bw.summary(), "rounds": args.rounds, "rows": rows})

    return args, rows, finish


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["dummy:qwen3-30b-a3b", "dummy:llama3-8b", "dummy:deepseek-v2-lite"])
    p.add_argument("--fp8-models", nargs="*", default=["dummy:llama3-8b"], help="run again with --quantization fp8")
    p.add_argument("--bs", nargs="+", type=int, default=[1, 8])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--result-name", default="pdl", help="benchmarks/results/NAME.json")
    p.add_argument("--skip", action="append", default=[], metavar="KERNEL,KERNEL",
                   help="one more capture: PDL on except these kernels (repeatable)")
    args = p.parse_args()
    for name in ("rounds", "ctx"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} is invalid: must be >= 1")
    if min(args.bs) < 1:
        p.error(f"--bs {args.bs} is invalid: every batch size must be >= 1")
    try:  # refused now, not after the first model has loaded
        skips = [checked_skip({k.strip() for k in s.split(",") if k.strip()}, f"--skip {s!r}") for s in args.skip]
    except ValueError as e:
        p.error(str(e))
    if not pdl_on(torch.device("cuda")):
        p.error("this GPU, Triton or GRAPHSERVE_PDL setting cannot launch with PDL: nothing to compare")
    bw = measured_read_bw()
    print(bw.describe())
    rows = []
    for quantization, models in (("none", args.models), ("fp8", args.fp8_models)):
        for m in models:
            rows += bench_model(m, quantization, args.bs, args.ctx, args.rounds, bw, skips)
    for r in rows:  # every row against the best rate of the whole run
        r["floor_ms"] = bw.floor_ms(r["bytes"])
        r["ratio_off"], r["ratio_on"] = r["off_ms"] / r["floor_ms"], r["on_ms"] / r["floor_ms"]
    print_table(rows, COLS)
    write_result(args.result_name, {"read_bandwidth": bw.summary(), "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
