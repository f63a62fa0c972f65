"""gpt-oss's routed experts in bf16 (expert biases, the clamped ``swiglu_oai`` activation) against the same
experts as plain SiLU experts, at gpt-oss-20b's and -120b's expert shapes (32 / 128 experts of 2880, hidden
2880, top-4), batch 1..256, routing from random logits.

Both replayed from CUDA graphs, alternating two weight copies so the routed experts come from HBM as in a decode
step. The epilogue is the only difference between the columns: ``oai / silu`` is the cost of the biases and the
clamped activation. Floor: bytes the step must move (the experts routed to, with their biases for gpt-oss, plus
the activations) over the read bandwidth measured in this run; the last column is gpt-oss's experts / floor.

Run: python3 -m benchmarks.moe_swiglu [--quick]      (about a minute)
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import print_table, write_result
from benchmarks.moe_tune import graph_ms
from benchmarks.roofline import read_bandwidth_gbs
from graphserve.kernels.moe_config import moe_tiles
from graphserve.kernels.moe_fused import fused_experts
from graphserve.kernels.moe_routing import moe_softmax_topk

DT = torch.bfloat16
SHAPES = {"gpt-oss-20b": (32, 2880, 2880, 4), "gpt-oss-120b": (128, 2880, 2880, 4)}
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
QUICK_BATCHES = [1, 8, 64, 256]


def _weights(e: int, h: int, i: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return ((torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5).to(DT),
            (torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5).to(DT),
            torch.randn(e, 2 * i, device="cuda", generator=gen).to(DT),
            torch.randn(e, h, device="cuda", generator=gen).to(DT))  # fmt: skip


def measure(name: str, batches: list[int], bw_gbs: float, gen: torch.Generator) -> list[dict]:
    e, h, i, k = SHAPES[name]
    sets = [_weights(e, h, i, gen) for _ in range(2)]
    tiles = moe_tiles(e, i, h, DT, torch.device("cuda"))
    rows = []
    for bs in batches:
        x = torch.randn(bs, h, device="cuda", generator=gen).to(DT)
        w, ids = moe_softmax_topk(torch.randn(bs, e, device="cuda", generator=gen), k, True)

        def silu(x=x, w=w, ids=ids) -> None:
            for w13, w2, _, _ in sets:
                fused_experts(x, w13, w2, w, ids)

        def oai(x=x, w=w, ids=ids) -> None:
            for w13, w2, b13, b2 in sets:
                fused_experts(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, activation="swiglu_oai")

        silu_ms, oai_ms = graph_ms(silu) / len(sets), graph_ms(oai) / len(sets)
        touched = int(torch.unique(ids).numel())
        nbytes = touched * (3 * i * h + 2 * i + h) * 2 + 2 * bs * h * 2
        floor_ms = nbytes / (bw_gbs * 1e9) * 1e3
        rows.append({
            "model": name, "bs": bs, "experts_touched": touched,
            "path": "gemv" if bs * k <= tiles.small_max_pairs else "gemm",
            "silu_us": silu_ms * 1e3, "oai_us": oai_ms * 1e3, "oai_over_silu": oai_ms / silu_ms,
            "floor_us": floor_ms * 1e3, "ratio": oai_ms / floor_ms,
        })  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"batches {QUICK_BATCHES} only")
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = read_bandwidth_gbs()
    print(f"measured read bandwidth {bw:.0f} GB/s on {torch.cuda.get_device_name(0)}")
    rows = []
    for name in args.models:
        rows += measure(name, QUICK_BATCHES if args.quick else BATCHES, bw, gen)
        torch.cuda.empty_cache()
    print_table(rows, ["model", "bs", "experts_touched", "path", "silu_us", "oai_us", "oai_over_silu", "floor_us",
                       "ratio"])  # fmt: skip
    print(f"wrote {write_result('moe_swiglu', {'read_bandwidth_gbs': bw, 'rows': rows})}")


if __name__ == "__main__":
    main()
