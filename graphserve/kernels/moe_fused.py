"""The routed experts on CUDA: sort/align, gate_up (+SiLU·mul), down (x routing weight), sum over slots.

``fused_experts`` is what layers/moe.FusedMoE calls with the router's (weights, ids). It reads
nothing back to the host: every buffer is sized from T * k, the grids cover the worst-case sort
and tiles past the padded total exit at once, so a decode step captures into a CUDA graph at any
padded batch size and replays with whatever routing the step produces. Up to the table's
``small_max_pairs`` pairs two streaming kernels replace the sort, the grouped GEMMs and the sum.
Reference: kernels/moe_reference.experts_reference.
"""

from __future__ import annotations

import torch
import triton

from graphserve.kernels.moe_align import histogram_block, max_padded_pairs, moe_align
from graphserve.kernels.moe_config import GemmTile, GemvTile, MoeTiles, moe_tiles
from graphserve.kernels.moe_gemm import (
    fused_moe_gemm_kernel,
    fused_moe_gemv_down_kernel,
    fused_moe_gemv_gate_up_kernel,
    moe_sum_kernel,
)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PATHS = ("gemv", "gemm")


def _check(hidden, w13, w2, topk_weights, topk_ids) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"need hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")  # fmt: skip
    e, two_i, h = w13.shape
    if hidden.shape[1] != h or two_i % 2 or w2.shape != (e, h, two_i // 2):
        raise ValueError(f"shapes disagree: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if hidden.dtype not in SUPPORTED_DTYPES or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"hidden {hidden.dtype}, w13 {w13.dtype}, w2 {w2.dtype} must share one of {SUPPORTED_DTYPES}")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("expert weights must be contiguous")
    if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_ids must be int32 and topk_weights fp32, got {topk_ids.dtype}, {topk_weights.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be "
                         f"[{hidden.shape[0]}, k]")  # fmt: skip


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    expert_start: int = 0,
    counts: torch.Tensor | None = None,
    tiles: MoeTiles | None = None,
    path: str | None = None,
    gemm_tiles: tuple[GemmTile, GemmTile] | None = None,
    gemv_tiles: tuple[GemvTile, GemvTile] | None = None,
) -> torch.Tensor:
    """sum over slots of weight * down(silu(gate(x)) * up(x)) over this rank's experts, [T, H].

    ``valid`` (bool [T]) marks real rows; ``counts`` (int32 [E global]) receives pairs per expert.
    ``path`` / ``gemm_tiles`` / ``gemv_tiles`` override the table (tests, tuner, benchmarks).
    """
    _check(hidden, w13, w2, topk_weights, topk_ids)
    if path not in (None, *PATHS):
        raise ValueError(f"path={path!r} must be one of {PATHS}")
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    t, h = hidden.shape
    num_local, inter = w13.shape[0], w2.shape[2]
    k = topk_ids.shape[1]
    pairs = t * k
    device, dtype = hidden.device, hidden.dtype
    if counts is None:
        counts = torch.empty(expert_start + num_local, dtype=torch.int32, device=device)
    out = torch.empty(t, h, dtype=dtype, device=device)
    if t == 0:
        counts.zero_()
        return out
    tiles = tiles or moe_tiles(num_local, inter, h, dtype, device)
    valid_arg = topk_ids if valid is None else valid.view(torch.uint8)
    if path == "gemv" or (path is None and pairs <= tiles.small_max_pairs):
        _streaming_path(hidden, w13, w2, topk_weights, topk_ids, valid, valid_arg, expert_start, counts, out,
                        gemv_tiles or tiles.gemv_tiles(k, inter, h))  # fmt: skip
    else:
        _grouped_gemm_path(hidden, w13, w2, topk_weights, topk_ids, valid, valid_arg, expert_start, counts, out,
                           gemm_tiles or tiles.gemm_tiles(pairs))  # fmt: skip
    return out


def _streaming_path(hidden, w13, w2, topk_weights, topk_ids, valid, valid_arg, expert_start, counts, out, tiles):
    """Three launches in all with the router: gate_up per pair (+ counts), down per token (+ slot sum).

    Tiles come from the table or, where it has none, from the shape (moe_config.default_gemv_tiles).
    """
    (t, h), (num_local, two_i, _), k = hidden.shape, w13.shape, topk_ids.shape[1]
    inter = two_i // 2
    gu, dn = tiles
    block_e = triton.next_power_of_2(counts.numel())
    act = torch.empty(t * k, inter, dtype=hidden.dtype, device=hidden.device)
    fused_moe_gemv_gate_up_kernel[(t * k, triton.cdiv(inter, gu.block_n))](
        hidden, w13, act, topk_ids, valid_arg, counts, inter, expert_start, t * k,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        K=h, TOP_K=k, E=counts.numel(), E_LOCAL=num_local, HAS_VALID=valid is not None,
        BLOCK_N=gu.block_n, BLOCK_K=min(gu.block_k, triton.next_power_of_2(h)), BLOCK_P=histogram_block(block_e),
        BLOCK_E=block_e, num_warps=gu.num_warps, num_stages=gu.num_stages,
    )  # fmt: skip
    fused_moe_gemv_down_kernel[(t, triton.cdiv(h, dn.block_n))](
        act, w2, out, topk_weights, topk_ids, valid_arg, h, expert_start,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        K=inter, TOP_K=k, E_LOCAL=num_local, HAS_VALID=valid is not None, BLOCK_S=triton.next_power_of_2(k),
        BLOCK_N=dn.block_n, BLOCK_K=min(dn.block_k, triton.next_power_of_2(inter)), num_warps=dn.num_warps,
        num_stages=dn.num_stages,
    )  # fmt: skip


def _grouped_gemm_path(hidden, w13, w2, topk_weights, topk_ids, valid, valid_arg, expert_start, counts, out, tiles):
    """Sort/align, gate_up and down grouped GEMMs over [pairs] rows, then the slot sum."""
    (t, h), (num_local, two_i, _), k = hidden.shape, w13.shape, topk_ids.shape[1]
    inter, pairs = two_i // 2, t * k
    gu, dn = tiles
    if gu.block_m != dn.block_m:
        raise ValueError(f"gate_up block_m={gu.block_m} and down block_m={dn.block_m} must match (one sort)")
    align = moe_align(topk_ids, valid, counts, expert_start, num_local, gu.block_m)
    act = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    down = torch.empty(pairs, h, dtype=hidden.dtype, device=hidden.device)
    for a, b, c, n, kk, a_div, tile, gated in ((hidden, w13, act, inter, h, k, gu, True),
                                               (act, w2, down, h, inter, 1, dn, False)):  # fmt: skip
        fused_moe_gemm_kernel[(align.max_blocks * triton.cdiv(n, tile.block_n),)](
            a, b, c, topk_weights, align.sorted_ids, align.expert_ids, align.num_post_padded,
            pairs, n, align.max_blocks, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
            K=kk, A_ROW_DIV=a_div, GATED=gated, MUL_WEIGHT=not gated, IEEE=hidden.dtype == torch.float32,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=min(tile.block_k, max(16, triton.next_power_of_2(kk))),
            GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages,
        )  # fmt: skip
    block_h = min(1024, triton.next_power_of_2(h))
    moe_sum_kernel[(t, triton.cdiv(h, block_h))](
        down, out, topk_ids, valid_arg, h, expert_start, down.stride(0), out.stride(0),
        TOP_K=k, E_LOCAL=num_local, HAS_VALID=valid is not None, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip


def moe_workspace_bytes(
    num_tokens: int, top_k: int, num_local_experts: int, intermediate: int, hidden: int, dtype: torch.dtype,
    block_m: int = 128,
) -> int:  # fmt: skip
    """Bytes one MoE layer's forward of ``num_tokens`` rows allocates (the start-up memory plan reserves them).

    The padding-row mask (built from an int64 arange), the router's fp32 weights and int32 ids,
    the sort at the largest tile the tuner tries
    (block_m 128), the [pairs, I] activation, the [pairs, H] per-pair output and the [T, H] result.
    """
    es = torch.empty((), dtype=dtype).element_size()
    pairs = num_tokens * top_k
    slots = max_padded_pairs(pairs, num_local_experts, block_m)
    sort = 4 * (slots + slots // block_m + 1 + num_local_experts)
    return 9 * num_tokens + 8 * pairs + sort + es * (pairs * intermediate + pairs * hidden + num_tokens * hidden)
