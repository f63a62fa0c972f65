"""FP8 expert weights' scales as the MoE kernels read them (kernels/moe_fused.py launches with them).

``ExpertScales`` holds one weight's fp32 scales ``[E, SN, SK]``: one per ``[group_n, group_k]`` block, or
one per output row. It knows the grouped GEMM's K step for a tile (a step never crosses a scale block unless
the scales vary along k only) and the launch arguments; ``a8_problem`` says why weights cannot take a tile
that quantizes its activations in the GEMM (``check_a8_tile`` refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphserve.kernels.fp8_quant import FP8_DTYPE
from graphserve.kernels.moe_config import GemmTile


def k_only_scales(group_n: int, block_n: int, w8a8: bool) -> bool:
    """W8A16 grouped GEMM tiles whose ``block_n`` columns lie in one block-scale row (``group_n`` rows):
    the weight scale varies along k only and is folded into an operand before the MMA, so a K step
    may span several scale blocks (kernels/moe_gemm.py, ``K_SCALES``); the tuner's fp8 tile space
    follows the same rule."""
    return not w8a8 and group_n % block_n == 0


def stream_step(group_n: int, group_k: int, block_n: int, block_k: int) -> tuple[int, bool]:
    """(K step, ``K_SCALES``) of the small-batch streaming kernels (kernels/moe_stream.py) for a tile of
    ``block_n`` rows and ``block_k`` columns over ``[group_n, group_k]`` scale blocks: a step past the block's K
    where the tile's rows lie in one block-scale row (each column's scale then multiplies the activation);
    otherwise the step is capped at the block's K and a step's row sums take one scale. The tuner's streaming space
    follows the same rule."""
    if group_n % block_n == 0 and block_k > group_k:
        return block_k, True
    return min(block_k, group_k), False


@dataclass(frozen=True)
class ExpertScales:
    """One weight's fp8 scales as the kernels read them: fp32 ``[E, SN, SK]``, one per
    ``[group_n, group_k]`` block; per channel ``group_n`` 1 and ``group_k`` the weight's K (SK 1).
    ``up_row``: the first scale row of w13's up half (gate's row blocks come first)."""

    scale: torch.Tensor
    group_n: int
    group_k: int
    up_row: int = 0

    @property
    def per_channel(self) -> bool:
        """One scale per output row. Block scales whose K fits in one block also have one scale column, but
        they stay blocks (their rows share a scale per block): the kernels read column 0 for every step."""
        return self.group_n == 1 and self.scale.shape[2] == 1

    def block_k(self, block_k: int) -> int:
        """A K step never crosses a scale block."""
        return block_k if self.per_channel else min(block_k, self.group_k)

    def k_only_scales(self, block_n: int, w8a8: bool) -> bool:
        """Block scales the grouped GEMM folds into an operand along k (module function k_only_scales)."""
        return not self.per_channel and k_only_scales(self.group_n, block_n, w8a8)

    def stream_step(self, block_k: int, block_n: int) -> tuple[int, bool]:
        """The streaming kernels' (K step, ``K_SCALES``) for a tile: the module function ``stream_step``'s for block
        scales; per channel the tile's step, no per-column scales."""
        return (block_k, False) if self.per_channel else stream_step(self.group_n, self.group_k, block_n, block_k)

    def gemm_block_k(self, block_k: int, block_n: int, w8a8: bool) -> int:
        """The grouped GEMM's K step: the tile's, capped at the scale block unless the scales vary along k only."""
        return block_k if self.k_only_scales(block_n, w8a8) else self.block_k(block_k)


def expert_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                  block: tuple[int, int] | None) -> tuple[ExpertScales, ExpertScales]:  # fmt: skip
    """Check the fp8 weights' scales against their shapes; refuse a mismatch naming the tensor."""
    (e, two_i, h), inter = w13.shape, w13.shape[1] // 2
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"scaled expert weights must be {FP8_DTYPE}, got w13 {w13.dtype}, w2 {w2.dtype}")
    if block is None:
        shapes = ((e, two_i, 1), (e, h, 1))
        groups = ((1, h, inter), (1, inter, 0))
    else:
        bn, bk = block
        if bk & (bk - 1) or bk < 16:
            raise ValueError(f"fp8 weight block {block}: its K size must be a power of two >= 16")
        shapes = ((e, 2 * -(-inter // bn), -(-h // bk)), (e, -(-h // bn), -(-inter // bk)))
        groups = ((bn, bk, -(-inter // bn)), (bn, bk, 0))
    out = []
    for name, scale, shape, (gn, gk, up) in zip(("w13_scale", "w2_scale"), (w13_scale, w2_scale), shapes, groups):
        if tuple(scale.shape) != shape or scale.dtype != torch.float32 or not scale.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 {shape} for block={block}, got {scale.dtype} "
                             f"{tuple(scale.shape)}")
        out.append(ExpertScales(scale, gn, gk, up))
    return out[0], out[1]


def scale_args(scales: ExpertScales | None, weight: torch.Tensor) -> dict:
    """The kernels' fp8 arguments; unquantized weights pass themselves as an unread scale pointer."""
    if scales is None:
        return {"scale": weight, "stride_e": 0, "stride_n": 0, "up_row": 0,
                "consts": {"GROUP_N": 1, "GROUP_K": 1, "PER_CHANNEL": False}}  # fmt: skip
    return {"scale": scales.scale, "stride_e": scales.scale.stride(0), "stride_n": scales.scale.stride(1),
            "up_row": scales.up_row,
            "consts": {"GROUP_N": scales.group_n, "GROUP_K": scales.group_k, "PER_CHANNEL": scales.per_channel}}


def a8_problem(tile: GemmTile, sb: ExpertScales | None) -> str | None:
    """Why these weights cannot take a tile that quantizes the activations in the GEMM (``a8``), or None:
    it needs block-scaled fp8 weights and a K step of exactly one scale block (one activation scale per
    row and step, one weight scale per column)."""
    if sb is None or sb.per_channel:
        return (f"GemmTile a8=True quantizes the activations per K step against block-scaled fp8 weights; "
                f"these expert weights have {'no' if sb is None else 'per-channel'} scales")
    if tile.block_k != sb.group_k:
        return f"GemmTile a8=True needs block_k equal to the weight scale block's K {sb.group_k} (got block_k={tile.block_k})"
    return None


def check_a8_tile(tile: GemmTile, sb: ExpertScales | None) -> None:
    """Refuse an ``a8`` tile these weights cannot take (``a8_problem``)."""
    if tile.a8 and (problem := a8_problem(tile, sb)):
        raise ValueError(problem)
