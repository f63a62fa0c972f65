"""The FP4 routed experts' grouped GEMM kernels (kernels/fp4_moe.py's "gemm" path), in two variants as
kernels/fp4_gemm.py's dense GEMM has them:

- ``_fp4_moe_gemm_kernel`` ("bf16", W4A16): each FP4 tile widened and scaled to bf16 in registers for the bf16
  tensor cores; the widening is CUDA-core work per weight element per M tile.
- ``_fp4_moe_gemm_fp8_kernel`` ("fp8", W4A8): E2M1 is exact in e4m3, so the tile becomes fp8 by masks and shifts
  alone (fp4_layout.fp8_weight_tile) and runs on the FP8 tensor cores, 32 columns a step (fp4_layout.fp8_mma_step:
  NVFP4's two 16-column groups take two MMAs), against its input quantized per row (one scale a row: x per token
  before gate_up, the activation per pair before down, each one launch before its GEMM). The weight is the MMA's
  first operand, from registers, as in fp4_gemm.py, so the accumulator is [BLOCK_N, BLOCK_M]; it is transposed once
  for the epilogue the two variants share.

Both take one [BLOCK_M, BLOCK_N] tile of one expert's sorted pairs (kernels/moe_gemm.fused_moe_gemm_kernel's grid):
gate_up (GATED: gate's and up's rows, the activation in the epilogue) or down (MUL_WEIGHT: bias, then the routing
weight). Tiles come from kernels/fp4_moe_config.py. Reference: kernels/fp4_experts_reference.py (``variant="fp8"``
rounds x and the activation as this variant's inputs are rounded).
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphserve.kernels.fp4_layout import block_scale, fp8_mma_step, fp8_weight_tile, group_bytes, widen_fp16
from graphserve.kernels.pdl import pdl_enter
from graphserve.kernels.tile_order import grouped_tile_ids


@triton.jit
def activate(g, u, alpha, limit, ACT: tl.constexpr, DTYPE: tl.constexpr):
    """gate and up (fp32, rounded to DTYPE first as the projection would store them) -> the activation in DTYPE."""
    g = g.to(DTYPE).to(tl.float32)
    u = u.to(DTYPE).to(tl.float32)
    if ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    elif ACT == 2:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = g / (1.0 + tl.exp(-g)) * u
    else:
        out = g / (1.0 + tl.exp(-g)) * u
    return out.to(DTYPE)


@triton.jit
def _epilogue(acc_g, acc_u, e, rows, offs_n, pairs, row_mask, gs_ptr, b_ptr, c_ptr, weights_ptr, N, stride_gse,
              stride_be, stride_cm, alpha, limit, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, ACT: tl.constexpr,
              HAS_GLOBAL: tl.constexpr, ROW_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Globals, biases, then the activation (gate_up) or the routing weight (down) of a [BLOCK_M, BLOCK_N] tile,
    stored at its pairs' rows."""
    if HAS_GLOBAL:
        if ROW_GLOBAL:
            acc_g *= tl.load(gs_ptr + e * stride_gse + rows)[None, :]
            if GATED:
                acc_u *= tl.load(gs_ptr + e * stride_gse + N + rows)[None, :]
        else:
            acc_g *= tl.load(gs_ptr + e * stride_gse)
            if GATED:
                acc_u *= tl.load(gs_ptr + e * stride_gse + 1)
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + e * stride_be + rows).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_ptr + e * stride_be + N + rows).to(tl.float32)[None, :]
    if GATED:
        out = activate(acc_g, acc_u, alpha, limit, ACT, c_ptr.dtype.element_ty)
    else:
        out = acc_g
        if MUL_WEIGHT:
            out = out * tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
        out = out.to(c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out, mask=row_mask[:, None] & (offs_n[None, :] < N))


@triton.jit
def _widened_tile(w_ptrs, s_ptrs, k0, offs_g, K: tl.constexpr, GROUP_K: tl.constexpr, MX: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """The FP4 tile at K offset ``k0`` dequantized to DTYPE [BLOCK_N, BLOCK_K] (exact in bf16), in K order."""
    if K % BLOCK_K == 0:
        b = tl.load(w_ptrs + k0 // 2)
        s = tl.load(s_ptrs + k0 // GROUP_K)
    else:
        g_ok = (k0 // GROUP_K + offs_g) < K // GROUP_K
        b = tl.load(w_ptrs + k0 // 2, mask=g_ok[None, :, None], other=0)
        s = tl.load(s_ptrs + k0 // GROUP_K, mask=g_ok[None, :], other=0)
    lo, hi = widen_fp16(b.to(tl.int32))
    sf = block_scale(s, MX, 14)[:, :, None]
    w = tl.interleave((lo.to(tl.float32) * sf).to(DTYPE), (hi.to(tl.float32) * sf).to(DTYPE))
    return tl.reshape(w, (BLOCK_N, BLOCK_K))



@triton.jit
def _dense_weight_tile(w_ptr, s_ptr, N, stride_wn, stride_sn, K: tl.constexpr, GROUP_K: tl.constexpr,
                       MX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """This program's [BLOCK_N, BLOCK_K] tile of a dense FP4 weight [N, K/2] (program ids: row tile, K tile) in fp32
    with its block scales, and the tile's rows and first column: the conversions' (dequant, e4m3) shared first half."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_g, byte3 = group_bytes(BLOCK_K, GROUP_K)
    w_ptrs = w_ptr + rows[:, None, None] * stride_wn + byte3[None, :, :]
    s_ptrs = s_ptr + rows[:, None] * stride_sn + offs_g[None, :]
    w = _widened_tile(w_ptrs, s_ptrs, k0, offs_g, K, GROUP_K, MX, BLOCK_N, BLOCK_K, tl.float32)
    return w, offs_n, rows, k0

@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _fp4_moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
    num_pairs, N, num_blocks_m, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_gse, stride_be,
    stride_cm, alpha, limit,
    K: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    ACT: tl.constexpr, GROUP_K: tl.constexpr, MX: tl.constexpr, HAS_GLOBAL: tl.constexpr, ROW_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The "bf16" variant: x (or the activation) in its own dtype against widened tiles."""
    pdl_enter(PDL)
    pid_m, pid_n = grouped_tile_ids(N, num_blocks_m, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return  # past the padded total: no pair here (the cost of a bound-sized grid)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    row_mask = pairs < num_pairs
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_g, byte3 = group_bytes(BLOCK_K, GROUP_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    g_ptrs = w_ptr + e * stride_we + rows[:, None, None] * stride_wn + byte3[None, :, :]
    sg_ptrs = s_ptr + e * stride_se + rows[:, None] * stride_sn + offs_g[None, :]
    # from 64 rows of x the widened tile is the MMA's first operand, from registers, as in fp4_gemm.py: as the
    # second (through shared memory) the kernel fails to compile at BLOCK_M 64 ("Illegal shared layout" in
    # TritonGPUOptimizeDotOperands, Triton 3.6, sm_90); below 64 rows x stays first, the tile every call took before
    W_FIRST: tl.constexpr = BLOCK_M >= 64
    if W_FIRST:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:
            a = tl.load(a_ptrs + k0, mask=row_mask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        wg = _widened_tile(g_ptrs, sg_ptrs, k0, offs_g, K, GROUP_K, MX, BLOCK_N, BLOCK_K, a.dtype)
        if W_FIRST:
            acc_g = tl.dot(wg, tl.trans(a), acc_g)
        else:
            acc_g = tl.dot(a, tl.trans(wg), acc_g)
        if GATED:
            wu = _widened_tile(g_ptrs + N * stride_wn, sg_ptrs + N * stride_sn, k0, offs_g, K, GROUP_K, MX, BLOCK_N,
                               BLOCK_K, a.dtype)  # fmt: skip
            if W_FIRST:
                acc_u = tl.dot(wu, tl.trans(a), acc_u)
            else:
                acc_u = tl.dot(a, tl.trans(wu), acc_u)
    if W_FIRST:
        acc_g = tl.trans(acc_g)
        if GATED:
            acc_u = tl.trans(acc_u)
    _epilogue(acc_g, acc_u, e, rows, offs_n, pairs, row_mask, gs_ptr, b_ptr, c_ptr, weights_ptr, N, stride_gse,
              stride_be, stride_cm, alpha, limit, GATED, MUL_WEIGHT, ACT, HAS_GLOBAL, ROW_GLOBAL, HAS_BIAS)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _fp4_moe_gemm_fp8_kernel(
    a_ptr, as_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
    num_pairs, N, num_blocks_m, stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_gse,
    stride_be, stride_cm, alpha, limit,
    K: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    ACT: tl.constexpr, GROUP_K: tl.constexpr, MX: tl.constexpr, HAS_GLOBAL: tl.constexpr, ROW_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The "fp8" variant: ``a_ptr`` the input's fp8 bytes (uint8) [rows, K] and ``as_ptr`` its fp32 scale a row;
    BLOCK_K = 32 divides K."""
    pdl_enter(PDL)
    pid_m, pid_n = grouped_tile_ids(N, num_blocks_m, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    row_mask = pairs < num_pairs
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    # a padding slot reads row 0 (any real row) rather than past the input: its results are never stored
    a_rows = tl.where(row_mask, pairs // A_ROW_DIV, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    g_ptrs = w_ptr + e * stride_we + rows[:, None] * stride_wn + tl.arange(0, BLOCK_K // 2)[None, :]
    sg_ptrs = s_ptr + e * stride_se + rows * stride_sn
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs + k0)  # fp8 bytes: NVFP4's halves are selected as integers, then bitcast
        wg = fp8_weight_tile(tl.load(g_ptrs + k0 // 2).to(tl.int32), BLOCK_N, BLOCK_K)
        acc_g = fp8_mma_step(acc_g, wg, a, sg_ptrs, k0, GROUP_K, BLOCK_K, MX)
        if GATED:
            wu = fp8_weight_tile(tl.load(g_ptrs + N * stride_wn + k0 // 2).to(tl.int32), BLOCK_N, BLOCK_K)
            acc_u = fp8_mma_step(acc_u, wu, a, sg_ptrs + N * stride_sn, k0, GROUP_K, BLOCK_K, MX)
    a_scale = tl.load(as_ptr + a_rows * stride_asm)[None, :]
    acc_g = tl.trans(acc_g * a_scale)
    if GATED:
        acc_u = tl.trans(acc_u * a_scale)
    _epilogue(acc_g, acc_u, e, rows, offs_n, pairs, row_mask, gs_ptr, b_ptr, c_ptr, weights_ptr, N, stride_gse,
              stride_be, stride_cm, alpha, limit, GATED, MUL_WEIGHT, ACT, HAS_GLOBAL, ROW_GLOBAL, HAS_BIAS)

