"""What a decode step's launch structure costs by itself: the step's weights read by pure streaming reads.

A dense model's batch-1 decode step reads each layer's four projection weights in four launches, with the
attention launch between the first two, then the lm_head. This benchmark replays that structure with the
compute taken out: every launch is kernels/stream_read.py (the read probe's kernel) over the very weight
tensor the engine's launch reads, in the engine's order. The rows, each one CUDA graph replayed in turns with the
others over the same cold weights:

- ``engine step``: the engine's own captured decode step (graph replay and greedy argmax), bs 1;
- ``reads, one launch a weight`` for each of the read probe's grid shapes (benchmarks/roofline.STREAM_GRIDS):
  one streaming read per projection weight and one for the lm_head, in the step's order;
- the same with one small launch a layer where attention runs (a read of a few KB: a launch with no bytes
  to speak of), the step's launch count;
- ``one launch of the same bytes``: the probe's single stream over one buffer of the reads' total size.

FP8 weights are read as 16-bit elements (``roofline.wide_view``), so every row's reader loads the same bytes a
thread.

Every row's ``ratio`` is against the floor of its own bytes at the best read rate of the run (the engine row's
bytes are benchmarks/decode.step_cost's: weights, scales and KV). Where the reads with the step's launches take
``x`` times the floor, a step of separate launches a projection would need a reader faster than this one to take
less than ``x`` without overlapping its launches, however fast its matmuls; ``vs_skeleton`` of the engine row is
what the matmuls, attention and norms cost above the bare reads.

Run: python3 -m benchmarks.step_skeleton [--model dummy:llama3-8b] [--quantization fp8] [--ctx 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.decode import make_batch, step_cost
from benchmarks.decode_setup import captured_graphs, release_gpu_memory
from benchmarks.kernels import CapturedCalls
from benchmarks.roofline import STREAM_GRIDS, measured_read_bw, stream_programs, wide_view
from graphserve.config import QUANTIZATIONS, EngineConfig
from graphserve.kernels.argmax import greedy_argmax
from graphserve.kernels.common import sm_count
from graphserve.kernels.stream_read import stream_read
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.models.loader import load_model

SMALL_READ_ELEMS = 1024  # the stand-in launch in attention's place


def step_weights(model) -> list[list[torch.Tensor]]:
    """Each decoder layer's 2-D ``weight`` parameters (not their scales) in the order a decode step reads them
    (the projections as the layer registers them: qkv, o, gate_up, down for the Llama family), then
    ``[lm_head]``. A model with routed experts is refused: which experts a step reads depends on its router."""
    layers = []
    for i, layer in enumerate(model.model.layers):
        if any("experts" in n for n, _ in layer.named_modules()):
            raise ValueError(f"step_skeleton: layer {i} has routed experts; the skeleton covers dense models")
        layers.append([p for n, p in layer.named_parameters() if n.rsplit(".", 1)[-1] == "weight" and p.dim() == 2])
    return layers + [[model.lm_head.weight]]


def skeleton(weights: list[list[torch.Tensor]], grid: tuple[int, int, int], sms: int,
             small: torch.Tensor | None) -> Callable[[], torch.Tensor]:  # fmt: skip
    """The step's reads as one function to capture: every weight streamed once, in order (one-byte weights as
    16-bit elements, ``roofline.wide_view``); with ``small``, one read of it after each layer's first weight
    (where attention runs). Every launch writes its partial sums to the front of one buffer."""
    per_sm, block, warps = grid
    wide = [[wide_view(w) for w in group] for group in weights]
    grids = [[stream_programs(per_sm, sms, w.numel(), block) for w in group] for group in wide]
    out = torch.empty(max(sms, *(n for g in grids for n in g)), dtype=torch.float32, device=weights[0][0].device)

    def run():
        for group, programs in zip(wide, grids, strict=True):
            for j, (w, n) in enumerate(zip(group, programs, strict=True)):
                stream_read(w, n, block=block, num_warps=warps, out=out[:n])
                if small is not None and j == 0 and len(group) > 1:
                    stream_read(small, sms, block=SMALL_READ_ELEMS, num_warps=4, out=out[:sms])
        return out

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy:llama3-8b")
    p.add_argument("--quantization", default="fp8", choices=QUANTIZATIONS)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--result-name", default="step_skeleton", help="benchmarks/results/NAME.json")
    args = p.parse_args()
    if args.rounds < 1 or args.ctx < 1:
        p.error(f"--rounds {args.rounds} and --ctx {args.ctx} must be >= 1")
    device = torch.device("cuda")
    bw = measured_read_bw()
    print(bw.describe())
    cfg = EngineConfig(model=args.model, device="cuda", quantization=args.quantization, max_model_len=args.ctx + 64)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    weights = step_weights(model)
    read = sum(w.numel() * w.element_size() for group in weights for w in group)
    launches = sum(len(g) for g in weights)
    sms = sm_count(device)
    kv_caches = info.kv.allocate((args.ctx + 2 * cfg.block_size) // cfg.block_size + 2, cfg.block_size, device,
                                 fill="random")  # fmt: skip
    backend = TritonAttentionBackend()
    small = torch.randn(SMALL_READ_ELEMS * sms, device=device)
    flat = torch.randn(read // 2, dtype=torch.bfloat16, device=device)  # one buffer of the reads' bytes
    with torch.inference_mode():
        engine = captured_graphs(model, backend, kv_caches, [1], args.ctx, cfg, device)
        batch = make_batch(1, args.ctx, kv_caches, backend, info.vocab_size)
        # (label, kind, graph or step, bytes, launches); kind "skeleton" marks the reads with the step's launches
        variants = [("engine step", "engine", lambda g=engine, b=batch: greedy_argmax(g.replay(b)),
                     step_cost(info, 1, args.ctx)[0], None)]  # fmt: skip
        for grid in STREAM_GRIDS:
            label = "{}x{}x{}w".format(*grid) if grid[0] else "a program a block x{}x{}w".format(*grid[1:])
            variants += [
                (f"reads, one launch a weight ({label})", "reads", CapturedCalls(skeleton(weights, grid, sms, None)),
                 read, launches),
                (f"reads + a small launch a layer ({label})", "skeleton",
                 CapturedCalls(skeleton(weights, grid, sms, small)), read, launches + len(weights) - 1),
                (f"one launch of the same bytes ({label})", "one launch",
                 CapturedCalls(skeleton([[flat]], grid, sms, None)), read, 1),
            ]  # fmt: skip
        times: dict[str, list[float]] = {v[0]: [] for v in variants}
        for round_ in range(args.rounds):
            for label, _, fn, _, _ in variants:
                if round_ == 0:
                    print(f"timing {label}", flush=True)
                times[label].append(cuda_time_ms(fn, warmup=2, iters=10))
    rows = []
    for label, kind, _, nbytes, count in variants:
        ms = statistics.median(times[label])
        bw.observe(f"step skeleton: {label}", nbytes, ms)
        rows.append({"variant": label, "kind": kind, "launches": count, "bytes": nbytes, "ms": ms,
                     "rounds_ms": times[label]})  # fmt: skip
    skeleton_ms = min(r["ms"] for r in rows if r["kind"] == "skeleton")
    for r in rows:
        r["floor_ms"] = bw.floor_ms(r["bytes"])
        r["ratio"] = r["ms"] / r["floor_ms"]
        r["vs_skeleton"] = r["ms"] / skeleton_ms
    print(f"{args.model} --quantization {args.quantization}, bs 1, ctx {args.ctx}; floor: {bw.describe()}")
    print_table(rows, ["variant", "launches", "ms", "floor_ms", "ratio", "vs_skeleton"])
    write_result(args.result_name, {"model": args.model, "quantization": args.quantization, "bs": 1,
                                    "ctx": args.ctx, "rounds": args.rounds, "read_bandwidth": bw.summary(),
                                    "rows": rows})  # fmt: skip
    del engine, model, loaded, kv_caches
    release_gpu_memory()


if __name__ == "__main__":
    main()
