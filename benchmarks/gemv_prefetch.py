"""FP8 decode steps with the streaming matmul's L2 prefetch (kernels/fp8_gemv.PREFETCH_STEPS K-steps of each
program's weight slab asked of L2 before its wait and prologue) against the same steps without it.

Each model loads once (``--quantization fp8``); its decode graphs are captured once per prefetch setting (the
setting is read at launch, so a graph keeps the one it was captured with) and replayed in alternating turns, each
turn 20 synced steps as benchmarks.fp8 times them. ``vs_off`` is each setting's median over the median without.

Run on a GPU: python3 -m benchmarks.gemv_prefetch [--models dummy:llama3-8b dummy:qwen3-30b-a3b] [--steps 0 2 8]
[--rounds 5]   (writes benchmarks/results/gemv_prefetch.json)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.decode import make_batch
from benchmarks.decode_setup import captured_graphs, context_kv_caches, release_gpu_memory
from graphserve.config import EngineConfig
from graphserve.kernels import fp8_gemv
from graphserve.kernels.argmax import greedy_argmax
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.models.loader import load_model

CASES = ((1, 512), (64, 2048))  # (batch, context): the FP8 decode table's rows
COLS = ["model", "bs", "ctx", "prefetch_steps", "step_ms", "vs_off"]


@contextlib.contextmanager
def prefetch_steps(steps: int):
    before = fp8_gemv.PREFETCH_STEPS
    fp8_gemv.PREFETCH_STEPS = steps
    try:
        yield
    finally:
        fp8_gemv.PREFETCH_STEPS = before


def measure(name: str, settings: list[int], rounds: int) -> list[dict]:
    device = torch.device("cuda")
    ctx = max(c for _, c in CASES)
    sizes = [bs for bs, _ in CASES]
    cfg = EngineConfig(model=name, device="cuda", quantization="fp8", max_model_len=ctx + 64)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    kv_caches = context_kv_caches(info, max(sizes), ctx, cfg.block_size, device)
    backend = TritonAttentionBackend()
    rows = []
    with torch.inference_mode():
        graphs = {}
        for steps in settings:
            with prefetch_steps(steps):
                graphs[steps] = captured_graphs(model, backend, kv_caches, sizes, ctx, cfg, device)
        for bs, c in CASES:
            batch = make_batch(bs, c, kv_caches, backend, info.vocab_size)
            turns = {steps: [] for steps in settings}
            for _ in range(rounds):
                for steps in settings:
                    turns[steps].append(cuda_time_ms(lambda g=graphs[steps], b=batch: greedy_argmax(g.replay(b)),
                                                     warmup=3, iters=20))  # fmt: skip
            off = statistics.median(turns[0]) if 0 in turns else None
            for steps in settings:
                ms = statistics.median(turns[steps])
                rows.append({"model": name, "bs": bs, "ctx": c, "prefetch_steps": steps, "step_ms": ms,
                             "vs_off": ms / off if off else None, "turns_ms": turns[steps]})
            print_table(rows[-len(settings):], COLS)
        del graphs
    del model, loaded, kv_caches
    release_gpu_memory()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["dummy:llama3-8b", "dummy:qwen3-30b-a3b"])
    p.add_argument("--steps", nargs="+", type=int, default=[0, 2, 8])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.rounds < 1 or any(s < 0 for s in args.steps):
        p.error(f"--rounds {args.rounds} must be >= 1 and --steps {args.steps} >= 0")
    rows = [r for m in args.models for r in measure(m, args.steps, args.rounds)]
    print_table(rows, COLS)
    write_result("gemv_prefetch", {"rows": rows})


if __name__ == "__main__":
    main()
