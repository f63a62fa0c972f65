"""One MoE layer's routed experts: the fused Triton path against the PyTorch loop over experts.

For qwen3-30b-a3b and mixtral-8x7b expert shapes at batch 1..256, routing from random logits with a
per-expert popularity bias ("skewed") and round-robin ("uniform"). Fused: the routing
kernel and fused_experts replayed from a CUDA graph, alternating two weight copies so the routed
experts come from HBM as in a decode step. Loop: kernels/moe_reference.experts_loop_reference
(eager, one gather + three matmuls per routed expert). Floor: bytes the step must move (the
experts actually routed to, counted from the router's output, plus the activations) over the
read bandwidth measured in this run. The last column is fused / floor.

Run: python3 -m benchmarks.moe_kernels [--quick]      (about 1.5 minutes on an H200; --quick ~40 s)

``--sweep-gemv``: instead, at one token, the streaming path with each kernel's tile varied around
its default (block_n, block_k, warps, compiler pipelining on top of the hand prefetch), the other
kernel on its default: the data for retuning moe_config.default_gemv_tiles (about 1 minute).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.moe_tune import SHAPES, graph_ms
from benchmarks.roofline import read_bandwidth_gbs
from graphserve.kernels.moe_config import GemvTile, default_gemv_tiles, moe_tiles
from graphserve.kernels.moe_fused import fused_experts
from graphserve.kernels.moe_reference import experts_loop_reference, uniform_routing
from graphserve.kernels.moe_routing import moe_softmax_topk

DT = torch.bfloat16
MODELS = ["qwen3-30b-a3b", "mixtral-8x7b"]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
QUICK_BATCHES = [1, 8, 64, 256]


def _weights(e: int, h: int, i: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5).to(DT),
        (torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5).to(DT),
    )


def _time_case(sets: list, x, logits, w, ids, k: int) -> tuple[float, float]:
    """(fused ms, loop ms); with ``logits`` the fused graph also runs the routing kernel, as the layer does."""

    def fused() -> None:
        for w13, w2 in sets:
            if logits is not None:
                moe_softmax_topk(logits, k, True)
            fused_experts(x, w13, w2, w, ids)

    fused_ms = graph_ms(fused) / len(sets)
    loop_ms = cuda_time_ms(lambda: experts_loop_reference(x, sets[0][0], sets[0][1], w, ids), 2, 10)
    return fused_ms, loop_ms


def measure(name: str, batches: list[int], bw_gbs: float, gen: torch.Generator) -> list[dict]:
    e, h, i, k = SHAPES[name]
    sets = [_weights(e, h, i, gen) for _ in range(2)]
    tiles = moe_tiles(e, i, h, DT, torch.device("cuda"))
    expert_bytes = (3 * i * h) * 2
    # a fixed per-expert bias makes some experts popular, as trained routers are; random logits
    # alone would spread the pairs almost evenly
    popularity = 1.5 * torch.randn(e, device="cuda", generator=gen)
    rows = []
    for bs in batches:
        x = torch.randn(bs, h, device="cuda", generator=gen).to(DT)
        logits = torch.randn(bs, e, device="cuda", generator=gen) + popularity
        for routing in ("skewed", "uniform"):
            if routing == "uniform":
                w, ids = uniform_routing(bs, k, e, x.device)
            else:
                w, ids = moe_softmax_topk(logits, k, True)
            fused_ms, loop_ms = _time_case(sets, x, logits if routing == "skewed" else None, w, ids, k)
            touched = int(torch.unique(ids).numel())
            nbytes = touched * expert_bytes + 2 * bs * h * 2
            floor_ms = nbytes / (bw_gbs * 1e9) * 1e3
            rows.append({
                "model": name, "bs": bs, "routing": routing, "experts_touched": touched,
                "path": "gemv" if bs * k <= tiles.small_max_pairs else "gemm",
                "loop_us": loop_ms * 1e3, "fused_us": fused_ms * 1e3, "speedup": loop_ms / fused_ms,
                "floor_us": floor_ms * 1e3, "ratio": fused_ms / floor_ms,
            })  # fmt: skip
    return rows


def _around(tile: GemvTile) -> list[GemvTile]:
    """The default, then each knob moved one step: block_n halved/doubled, block_k halved/doubled,
    8 warps, and 3 compiler pipeline stages on top of the hand prefetch."""
    bn, bk, w = tile.block_n, tile.block_k, tile.num_warps
    out = [tile, GemvTile(max(1, bn // 2), bk, w), GemvTile(bn * 2, bk, w), GemvTile(bn, max(64, bk // 2), w),
           GemvTile(bn, bk * 2, w), GemvTile(bn, bk, 2 * w), GemvTile(bn, bk, w, num_stages=3)]  # fmt: skip
    return list(dict.fromkeys(out))


def sweep_gemv(name: str, bw_gbs: float, gen: torch.Generator) -> list[dict]:
    e, h, i, k = SHAPES[name]
    sets = [_weights(e, h, i, gen) for _ in range(2)]
    x = torch.randn(1, h, device="cuda", generator=gen).to(DT)
    w, ids = moe_softmax_topk(torch.randn(1, e, device="cuda", generator=gen), k, True)
    gate_up, down = default_gemv_tiles(k, i, h)
    floor_us = (k * 3 * i * h * 2) / (bw_gbs * 1e9) * 1e6
    rows = []
    for kernel, tiles in (("gate_up", [(t, down) for t in _around(gate_up)]),
                          ("down", [(gate_up, t) for t in _around(down)])):  # fmt: skip
        for pair in tiles:
            tile = pair[0] if kernel == "gate_up" else pair[1]

            def run(pair=pair) -> None:
                for w13, w2 in sets:
                    fused_experts(x, w13, w2, w, ids, path="gemv", gemv_tiles=pair)

            try:
                us = graph_ms(run) / len(sets) * 1e3
            except Exception as err:  # a tile this card cannot compile (registers, shared memory): said, skipped
                print(f"{name} {kernel} {tile}: {type(err).__name__}: {str(err)[:100]}")
                continue
            rows.append({"model": name, "kernel": kernel, "block_n": tile.block_n, "block_k": tile.block_k,
                         "warps": tile.num_warps, "stages": tile.num_stages, "experts_us": us,
                         "floor_us": floor_us, "ratio": us / floor_us})  # fmt: skip
            print_table([rows[-1]], list(rows[-1]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"batches {QUICK_BATCHES} only")
    p.add_argument("--models", nargs="+", default=MODELS, choices=list(SHAPES))
    p.add_argument("--sweep-gemv", action="store_true", help="sweep the streaming tiles at one token instead")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = read_bandwidth_gbs()
    print(f"measured read bandwidth {bw:.0f} GB/s on {torch.cuda.get_device_name(0)}")
    if args.sweep_gemv:
        rows = [r for name in args.models for r in sweep_gemv(name, bw, gen)]
        print_table(rows, list(rows[0]) if rows else [])
        print(f"wrote {write_result('moe_gemv_sweep', {'read_bandwidth_gbs': bw, 'rows': rows})}")
        return
    rows = []
    for name in args.models:
        rows += measure(name, QUICK_BATCHES if args.quick else BATCHES, bw, gen)
        torch.cuda.empty_cache()
    cols = ["model", "bs", "routing", "experts_touched", "path", "loop_us", "fused_us", "speedup", "floor_us", "ratio"]
    print_table(rows, cols)
    path = write_result("moe_kernels", {"read_bandwidth_gbs": bw, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
