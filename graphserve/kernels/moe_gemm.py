"""The experts' matmuls: a grouped GEMM over the sorted pairs and the k-sum (the small-batch path's
per-pair streaming kernels are in kernels/moe_stream.py).

The grouped GEMM runs twice per layer. gate_up (GATED): rows x[t] of the pairs against the
expert's ``w13 [2I, H]``, two accumulators (gate rows n, up rows I + n) so ``silu(gate) * up`` is
formed in the epilogue and only [pairs, I] is written. down (MUL_WEIGHT): rows act[p] against
``w2 [H, I]``, the fp32 routing weight applied to the fp32 accumulator before rounding. Output
rows are indexed by pair, so the final ``moe_sum_kernel`` adds each token's k rows without atomics
and skips pairs that were not routed (padding rows, other ranks' experts); their rows are never
written.

gate and up are rounded to the activation dtype before silu * up, as when the two projections and
the activation run apart. gpt-oss's experts (``HAS_BIAS``, ``ACT`` SWIGLU_OAI) add a bias row to each
accumulator and take their clamped activation in the same epilogue; with neither the kernel compiles to
what it was. References: kernels/moe_reference.experts_reference.

FP8 expert weights (``B_FP8`` / ``W_FP8``): e4m3 weights with fp32 scales ``[E, SN, SK]``, one per
``[GROUP_N, GROUP_K]`` block (128x128 as DeepSeek-V3 / Qwen3-FP8 ship them; gate's row blocks, then
up's from row ``scale_up_row``) or one per output row (``PER_CHANNEL``: GROUP_N 1, SK 1); the
weights are never written dequantized. Three modes: W8A16 widens the fp8 tile to the activation dtype
in registers (exact: every e4m3 value is a bf16 value), W8A8 (``A_FP8``, grouped GEMM only)
multiplies fp8 activations quantized per token group on the FP8 tensor cores and applies both scales,
and ``A_QUANT`` (grouped GEMM, block scales) is W8A8 with the quantization inside the kernel: a is
loaded in the activation dtype and each row of each K step (one scale block wide) quantized in
registers as kernels/fp8_quant.per_token_group_quant does, as kernels/fp8_gemv.py's FP8 dot does for
the dense projections; no quantization launch and no fp8 copy of a in memory, the same step math.
On the producing side, ``QUANT_OUT`` lets gate_up write down's W8A8 input itself: where its tile is one
activation group wide, the epilogue quantizes silu * up per row as that launch would and stores fp8 and
the group's scale, and the launch between the two GEMMs does not run (kernels/moe_fused.quant_out_group).

Where the block scales go in the grouped GEMM:
- W8A16 with a tile's BLOCK_N columns inside one scale row (``K_SCALES``: BLOCK_N divides GROUP_N,
  tiles aligned): the weight scale is a function of k alone, so it is folded into one operand's k
  (in fp32, rounded back to the activation dtype, as kernels/fp8_gemv.py's dot path does for its x)
  and the accumulator feeds the MMA, ``acc = dot(a * s_k, b, acc)``; a K step may then span
  several scale blocks (the host lets BLOCK_K past GROUP_K). down scales a's columns; gate_up,
  whose gate and up have their own scale rows, scales the rows of each widened weight tile
  instead (``b * s_k``), where two scaled copies of a take more registers (ptxas, sm_90, BLOCK_M
  16, BLOCK_N 32, 4 warps, 3 stages, K step 256: 209 registers scaling a twice, 136 scaling b; down
  at a K step of 512: 96 scaling a, 144 scaling b). The cost is one rounding per product to the
  activation dtype, of the size of the rounding x already carries (the dtype's unit roundoff:
  2^-8 bf16, 2^-11 fp16; fp32 rounding only at fp32); gate_up then computes the experts on
  weights dequantized to the activation dtype, up to summation order. Measured at fp16 in
  tests/kernels/test_moe_fp8_interp.py (16 tokens, top-4 of 8 experts, H 256, I 128): relative L2 error
  6.8e-4 against the fp32-dequantized reference, where the per-column path has 5.4e-5.
- otherwise (W8A8, A_QUANT, or BLOCK_N wider than a scale row): a K step never crosses a scale block
  (the host caps BLOCK_K at GROUP_K; A_QUANT needs it equal) and its partial sum takes its block
  scale once per output column.
References: kernels/moe_fp8_reference.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphserve.kernels.fp8_quant import quantize_rows
from graphserve.kernels.l2_prefetch import issue_l2_prefetch
from graphserve.kernels.pdl import pdl_enter
from graphserve.kernels.tile_order import grouped_tile_ids

SILU, SWIGLU_OAI, SILU_CLAMP = 0, 1, 2  # the kernels' ACT: kernels/moe_reference.ACTIVATIONS in order


@triton.jit
def gated_epilogue(acc_g, acc_u, w, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, DTYPE: tl.constexpr,
                   ACT: tl.constexpr = 0, ALPHA: tl.constexpr = 1.702, LIMIT: tl.constexpr = 7.0):  # fmt: skip
    """``ACT`` SILU: silu(g) * u; SWIGLU_OAI (gpt-oss): g clamped above at LIMIT, u to +-LIMIT,
    (u + 1) * g * sigmoid(ALPHA * g); SILU_CLAMP (DeepSeek-V4): silu(g) * u clamped alike. g and u are rounded to
    DTYPE first every way."""
    if GATED:
        g = acc_g.to(DTYPE).to(tl.float32)
        u = acc_u.to(DTYPE).to(tl.float32)
        if ACT == 1:
            g = tl.minimum(g, LIMIT)
            u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
            out = g / (1.0 + tl.exp(-ALPHA * g)) * (u + 1.0)
        elif ACT == 2:
            g = tl.minimum(g, LIMIT)
            u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
            out = g / (1.0 + tl.exp(-g)) * u
        else:
            out = g / (1.0 + tl.exp(-g)) * u
    else:
        out = acc_g
    if MUL_WEIGHT:
        out = out * w
    return out.to(DTYPE)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs would otherwise be rounded to tf32 by the tensor cores
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _k_scales(s_row, k0, offs_k, K: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """K_SCALES: the weight scale of each k of the step at ``k0`` along one scale row [BLOCK_K]."""
    if K % BLOCK_K == 0:
        return tl.load(s_row + (k0 + offs_k) // GROUP_K)
    return tl.load(s_row + (k0 + offs_k) // GROUP_K, mask=(k0 + offs_k) < K, other=0.0)


@triton.jit
def _gemm_step(acc, a, b, a_s, bs_ptrs, ks, k0, IEEE: tl.constexpr, B_FP8: tl.constexpr, A_FP8: tl.constexpr,
               GROUP_K: tl.constexpr, PER_CHANNEL: tl.constexpr, K_SCALES: tl.constexpr,
               ONTO_B: tl.constexpr):  # fmt: skip
    """acc + a @ b for one K step; block-scaled fp8 weights take this step's scales (and a's, W8A8);
    ``K_SCALES``: the weight's per-k scales ``ks`` multiply b's rows (``ONTO_B``) or a's columns."""
    if K_SCALES and ONTO_B:
        b = (b.to(tl.float32) * ks[:, None]).to(a.dtype)
    elif B_FP8 and not A_FP8:
        b = b.to(a.dtype)  # W8A16: e4m3 -> bf16/fp32 is exact
    if K_SCALES and not ONTO_B:
        a = (a.to(tl.float32) * ks[None, :]).to(b.dtype)
    if B_FP8 and not PER_CHANNEL and not K_SCALES:
        scale = tl.load(bs_ptrs + k0 // GROUP_K)[None, :]
        if A_FP8:
            scale = scale * a_s
        return acc + _dot(a, b, IEEE) * scale
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])  # batch-sized ints: see engine/warmup.py
def fused_moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr, as_ptr, bs_ptr, cs_ptr,
    num_pairs, N, num_blocks_m, stride_am, stride_be, stride_bn, stride_cm,
    stride_asm, stride_bse, stride_bsn, stride_csm, scale_up_row,
    K: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    B_FP8: tl.constexpr, A_FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    PER_CHANNEL: tl.constexpr, K_SCALES: tl.constexpr, A_QUANT: tl.constexpr, QUANT_OUT: tl.constexpr,
    ACT_DTYPE: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
    bias_ptr, stride_bias_e, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] output tile of one expert's run; the grid covers the worst-case sort.

    ``HAS_BIAS`` (gpt-oss): the expert's bias row (gate_up: [2I], gate's then up's; down: [H]) joins the fp32
    accumulators after the weight scales, before the activation and before the routing weight. ``ACT``:
    gated_epilogue's activation.

    ``QUANT_OUT`` (gate_up): the tile's BLOCK_N columns are one activation group of the down step's W8A8; the
    epilogue quantizes each row of silu * up (rounded to ``ACT_DTYPE`` first, as it would be stored) and
    writes fp8 into ``c_ptr`` with the group's fp32 scale at ``cs_ptr`` [pairs, groups]: what the quantization
    launch would make of the stored tile, so that launch does not run."""
    pdl_enter(PDL)
    if A_QUANT:  # a step's activation scale is its K step's amax: one weight scale block per step
        tl.static_assert(B_FP8 and not PER_CHANNEL and not A_FP8 and not K_SCALES)
        tl.static_assert(BLOCK_K == GROUP_K or BLOCK_K >= K)
    if QUANT_OUT:
        tl.static_assert(GATED)
    A8: tl.constexpr = A_FP8 or A_QUANT  # the step runs on the FP8 tensor cores with both scales
    pid_m, pid_n = grouped_tile_ids(N, num_blocks_m, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return  # past the padded total: this tile holds no pair (the cost of a bound-sized grid)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    row_mask = pairs < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # columns past N re-read column N-1 so the weight loads need no mask along N; never stored
    b_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    bg_ptrs = b_ptr + expert * stride_be + b_rows[None, :] * stride_bn + offs_k[:, None]
    bu_ptrs = bg_ptrs + N * stride_bn
    # fp8 scales: the weight's per output column (gate and up rows apart), the activation's per pair row
    bsg_ptrs = bs_ptr + expert * stride_bse + (b_rows // GROUP_N) * stride_bsn
    bsu_ptrs = bs_ptr + expert * stride_bse + (scale_up_row + b_rows // GROUP_N) * stride_bsn
    as_ptrs = as_ptr + a_rows * stride_asm
    # K_SCALES: the tile's one scale row of gate and of up
    sg_row = bs_ptr + expert * stride_bse + (pid_n * BLOCK_N // GROUP_N) * stride_bsn
    su_row = sg_row + scale_up_row * stride_bsn
    a_s = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            bg = tl.load(bg_ptrs)
        else:
            k_mask = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            bg = tl.load(bg_ptrs, mask=k_mask[:, None], other=0.0)
        if A_FP8 and not PER_CHANNEL:
            a_s = tl.load(as_ptrs + k0 // GROUP_K, mask=row_mask, other=0.0)[:, None]
        if A_QUANT:
            # a's rows quantized per K step as kernels/fp8_quant.per_token_group_quant does (the step is
            # the scale block's K); rows past the pair count load zeros: scale MIN_SCALE_C, zeros, no NaN.
            # Gated: the one quantized tile serves the gate and the up dot
            a, a_s = quantize_rows(a.to(tl.float32), b_ptr.dtype.element_ty, FP8_MAX_C, MIN_SCALE_C)
            a_s = a_s[:, None]
        ks_g = _k_scales(sg_row, k0, offs_k, K, GROUP_K, BLOCK_K) if K_SCALES else 0.0
        acc_g = _gemm_step(acc_g, a, bg, a_s, bsg_ptrs, ks_g, k0, IEEE, B_FP8, A8, GROUP_K, PER_CHANNEL, K_SCALES,
                           GATED)  # fmt: skip
        if GATED:
            if K % BLOCK_K == 0:
                bu = tl.load(bu_ptrs)
            else:
                bu = tl.load(bu_ptrs, mask=((k0 + offs_k) < K)[:, None], other=0.0)
            ks_u = _k_scales(su_row, k0, offs_k, K, GROUP_K, BLOCK_K) if K_SCALES else 0.0
            acc_u = _gemm_step(acc_u, a, bu, a_s, bsu_ptrs, ks_u, k0, IEEE, B_FP8, A8, GROUP_K, PER_CHANNEL,
                               K_SCALES, GATED)  # fmt: skip
            bu_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        bg_ptrs += BLOCK_K
    if B_FP8 and PER_CHANNEL:  # one weight scale per output row (and one activation scale per row, W8A8)
        if A_FP8:
            a_s = tl.load(as_ptrs, mask=row_mask, other=0.0)[:, None]
            acc_g *= a_s
            acc_u *= a_s
        acc_g *= tl.load(bsg_ptrs)[None, :]
        if GATED:
            acc_u *= tl.load(bsu_ptrs)[None, :]
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias_e
        acc_g += tl.load(bias_row + b_rows)[None, :].to(tl.float32)
        if GATED:
            acc_u += tl.load(bias_row + N + b_rows)[None, :].to(tl.float32)
    w = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    if QUANT_OUT:
        out = gated_epilogue(acc_g, acc_u, w, GATED, MUL_WEIGHT, ACT_DTYPE, ACT, ALPHA, LIMIT).to(tl.float32)
        # columns past N hold re-read weights: zeros there, as the launch's group past K would load
        out = tl.where((offs_n < N)[None, :], out, 0.0)
        q, c_s = quantize_rows(out, c_ptr.dtype.element_ty, FP8_MAX_C, MIN_SCALE_C)
        tl.store(c_ptrs, q, mask=row_mask[:, None] & (offs_n[None, :] < N))
        tl.store(cs_ptr + pairs.to(tl.int64) * stride_csm + pid_n, c_s, mask=row_mask)
    else:
        out = gated_epilogue(acc_g, acc_u, w, GATED, MUL_WEIGHT, c_ptr.dtype.element_ty, ACT, ALPHA, LIMIT)
        tl.store(c_ptrs, out, mask=row_mask[:, None] & (offs_n[None, :] < N))


@triton.jit
def moe_sum_kernel(
    c_ptr, out_ptr, ids_ptr, valid_ptr, H, expert_start, stride_cm, stride_om, pf_ptr, pf_bytes, pf_piece,
    TOP_K: tl.constexpr, E_LOCAL: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK_H: tl.constexpr,
    PREFETCH: tl.constexpr, PF_THREADS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[t] = sum of token t's routed pair rows, in fp32; padding rows and unrouted tokens get zeros.
    ``PREFETCH``: first the program asks L2 for its share of the weight the step reads next (kernels/l2_prefetch.py)."""
    if PREFETCH:
        issue_l2_prefetch(pf_ptr, pf_bytes, pf_piece, tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                          PF_THREADS)  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs < H
    token_ok = True
    if HAS_VALID:
        token_ok = tl.load(valid_ptr + t) != 0
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        pair = t * TOP_K + s
        expert = tl.load(ids_ptr + pair) - expert_start
        routed = (expert >= 0) & (expert < E_LOCAL) & token_ok
        row = tl.load(c_ptr + pair.to(tl.int64) * stride_cm + offs, mask=h_mask & routed, other=0.0)
        acc += row.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=h_mask)
