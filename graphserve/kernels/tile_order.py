"""The order programs take a GEMM's output tiles in, shared by the grouped GEMM kernels (moe_gemm, fp8_gemm,
fp4_gemm, fp4_moe_gemm)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile_ids(N, num_blocks_m, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program: GROUP_M row tiles walk the same weight columns one after another, so a
    weight tile comes from HBM once a group and from L2 for the group's other row tiles."""
    pid = tl.program_id(0)
    num_blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size
