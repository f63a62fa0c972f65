"""The grouped GEMMs reading the routing themselves (kernels/moe_fused.RouteScan, up to ``SCAN_MAX_PAIRS`` pairs)
against the sort launch before them (kernels/moe_align.py), on the same calls.

Kernels: the experts of one Qwen3-30B-A3B layer (top-8 of 128, H 2048, I 768) at T tokens, bf16 and fp8 (128x128
block scales) weights, the tuned table's tiles, timed as benchmarks/moe_tune.py times a bucket (CUDA graphs of
back-to-back calls over two weight copies, so the second call's experts are not in L2). Each routing is timed in
``--rounds`` alternating turns and the median taken.

Steps: ``dummy:qwen3-30b-a3b --quantization fp8`` decode steps (its own router) at the batches given, ctx 2048,
captured twice (the choice is made at capture) and replayed in alternating turns, each turn 20 synced steps
as benchmarks.fp8 times them.

Run on a GPU: python3 -m benchmarks.moe_scan [--tokens 4 8 16 32 64 128] [--bs 16 32 64] [--rounds 5]
(writes benchmarks/results/moe_scan.json)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.decode import make_batch
from benchmarks.decode_setup import captured_graphs, context_kv_caches, release_gpu_memory
from benchmarks.moe_tune import _Bucket as TuneBucket
from benchmarks.moe_tune import _weights as tune_weights
from graphserve.config import EngineConfig
from graphserve.kernels import moe_fused
from graphserve.kernels.argmax import greedy_argmax
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.models.loader import load_model

MODEL = "dummy:qwen3-30b-a3b"
ROUTINGS = ("scan", "sort")


@contextlib.contextmanager
def routing(kind: str):
    """Calls made inside run with ``kind``: the scan at every size the kernels take, or the sort at every size."""
    before = moe_fused.SCAN_MAX_PAIRS
    moe_fused.SCAN_MAX_PAIRS = 1 << 30 if kind == "scan" else -1
    rows_before = moe_fused.SCAN_MAX_ROWS_PER_EXPERT
    moe_fused.SCAN_MAX_ROWS_PER_EXPERT = 1 << 30
    try:
        yield
    finally:
        moe_fused.SCAN_MAX_PAIRS = before
        moe_fused.SCAN_MAX_ROWS_PER_EXPERT = rows_before


def kernel_rows(tokens: list[int], rounds: int, e: int = 128, h: int = 2048, i: int = 768, k: int = 8) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for fp8 in (True, False):
        sets = [tune_weights(e, h, i, torch.bfloat16, fp8, gen) for _ in range(2)]
        for t in tokens:
            bucket = TuneBucket(sets, t, e, h, k, torch.bfloat16, gen)
            times = {kind: [] for kind in ROUTINGS}
            for _ in range(rounds):
                for kind in ROUTINGS:
                    with routing(kind):
                        times[kind].append(bucket.ms(path="gemm") * 1e3)
            scan, sort = (statistics.median(times[kind]) for kind in ROUTINGS)
            rows.append({"weights": "fp8" if fp8 else "bf16", "tokens": t, "pairs": t * k, "scan_us": scan,
                         "sort_us": sort, "scan/sort": scan / sort, "scan_turns_us": times["scan"],
                         "sort_turns_us": times["sort"]})  # fmt: skip
            print_table([rows[-1]], ["weights", "tokens", "pairs", "scan_us", "sort_us", "scan/sort"])
        del sets
    return rows


def step_rows(sizes: list[int], ctx: int, rounds: int) -> list[dict]:
    device = torch.device("cuda")
    cfg = EngineConfig(model=MODEL, device="cuda", quantization="fp8", max_model_len=ctx + 64)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    kv_caches = context_kv_caches(info, max(sizes), ctx, cfg.block_size, device)
    backend = TritonAttentionBackend()
    rows = []
    with torch.inference_mode():
        graphs = {}
        for kind in ROUTINGS:
            with routing(kind):
                graphs[kind] = captured_graphs(model, backend, kv_caches, sizes, ctx, cfg, device)
        for bs in sizes:
            batch = make_batch(bs, ctx, kv_caches, backend, info.vocab_size)
            times = {kind: [] for kind in ROUTINGS}
            for _ in range(rounds):
                for kind in ROUTINGS:
                    times[kind].append(cuda_time_ms(lambda g=graphs[kind], b=batch: greedy_argmax(g.replay(b)),
                                                    warmup=3, iters=20))  # fmt: skip
            scan, sort = (statistics.median(times[kind]) for kind in ROUTINGS)
            rows.append({"model": MODEL, "quantization": "fp8", "bs": bs, "ctx": ctx, "scan_ms": scan, "sort_ms": sort,
                         "scan/sort": scan / sort, "scan_turns_ms": times["scan"], "sort_turns_ms": times["sort"]})
            print_table([rows[-1]], ["model", "bs", "ctx", "scan_ms", "sort_ms", "scan/sort"])
        del graphs
    del model, loaded, kv_caches
    release_gpu_memory()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", nargs="*", type=int, default=[4, 8, 16, 32, 64, 128])
    p.add_argument("--bs", nargs="*", type=int, default=[16, 32, 64])
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    for name, values in (("--tokens", args.tokens), ("--bs", args.bs), ("--rounds", [args.rounds])):
        if any(v < 1 for v in values):
            p.error(f"{name} {values} is invalid: every value must be >= 1")
    kernels = kernel_rows(args.tokens, args.rounds)
    steps = step_rows(args.bs, args.ctx, args.rounds) if args.bs else []
    print_table(kernels, ["weights", "tokens", "pairs", "scan_us", "sort_us", "scan/sort"])
    print_table(steps, ["model", "bs", "ctx", "scan_ms", "sort_ms", "scan/sort"])
    write_result("moe_scan", {"scan_max_pairs": moe_fused.SCAN_MAX_PAIRS, "kernels": kernels, "steps": steps})


if __name__ == "__main__":
    main()
