"""The experts' matmuls: a grouped GEMM over the sorted pairs, per-pair streaming kernels, the k-sum.

The grouped GEMM runs twice per layer. gate_up (GATED): rows x[t] of the pairs against the
expert's ``w13 [2I, H]``, two accumulators (gate rows n, up rows I + n) so ``silu(gate) * up`` is
formed in the epilogue and only [pairs, I] is written. down (MUL_WEIGHT): rows act[p] against
``w2 [H, I]``, the fp32 routing weight applied to the fp32 accumulator before rounding. Output
rows are indexed by pair, so the final ``moe_sum_kernel`` adds each token's k rows without atomics
and skips pairs that were not routed (padding rows, other ranks' experts); their rows are never
written. The small-batch path is two streaming kernels: gate_up per pair, down per token with
the slot sum in registers.

gate and up are rounded to the activation dtype before silu * up, as when the two projections and
the activation run apart. References: kernels/moe_reference.experts_reference.

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
  tests/test_moe_fp8_interp.py (16 tokens, top-4 of 8 experts, H 256, I 128): relative L2 error
  6.8e-4 against the fp32-dequantized reference, where the per-column path has 5.4e-5.
- otherwise (W8A8, A_QUANT, or BLOCK_N wider than a scale row): a K step never crosses a scale block
  (the host caps BLOCK_K at GROUP_K; A_QUANT needs it equal) and its partial sum takes its block
  scale once per output column.
References: kernels/moe_fp8_reference.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphserve.kernels.moe_align import pair_histogram
from graphserve.kernels.pdl import pdl_enter


@triton.jit
def _epilogue(acc_g, acc_u, w, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, DTYPE: tl.constexpr):
    if GATED:
        g = acc_g.to(DTYPE).to(tl.float32)
        u = acc_u.to(DTYPE).to(tl.float32)
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


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])  # batch-sized ints: see server/warmup.py
def fused_moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr, as_ptr, bs_ptr,
    num_pairs, N, num_blocks_m, stride_am, stride_be, stride_bn, stride_cm,
    stride_asm, stride_bse, stride_bsn, scale_up_row,
    K: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    B_FP8: tl.constexpr, A_FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    PER_CHANNEL: tl.constexpr, K_SCALES: tl.constexpr, A_QUANT: tl.constexpr, FP8_MAX_C: tl.constexpr,
    MIN_SCALE_C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] output tile of one expert's run; the grid covers the worst-case sort."""
    pdl_enter(PDL)
    if A_QUANT:  # a step's activation scale is its K step's amax: one weight scale block per step
        tl.static_assert(B_FP8 and not PER_CHANNEL and not A_FP8 and not K_SCALES)
        tl.static_assert(BLOCK_K == GROUP_K or BLOCK_K >= K)
    A8: tl.constexpr = A_FP8 or A_QUANT  # the step runs on the FP8 tensor cores with both scales
    pid = tl.program_id(0)
    num_blocks_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M tiles of M walk the same B columns one after another, so those stay in L2
    per_group = GROUP_M * num_blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
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
            af = a.to(tl.float32)
            a_s = tl.maximum(tl.max(tl.abs(af), axis=1) / FP8_MAX_C, MIN_SCALE_C)[:, None]
            a = tl.clamp(af / a_s, -FP8_MAX_C, FP8_MAX_C).to(b_ptr.dtype.element_ty)
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
    w = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
    out = _epilogue(acc_g, acc_u, w, GATED, MUL_WEIGHT, c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out, mask=row_mask[:, None] & (offs_n[None, :] < N))


@triton.jit
def _gate_up_tile(g_ptrs, u_ptrs, x_row, offs_k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The gate and up weight tiles and the x slice at K offset ``k0``; only a K tail is masked."""
    if K % BLOCK_K == 0:
        return tl.load(g_ptrs + k0), tl.load(u_ptrs + k0), tl.load(x_row + k0 + offs_k)
    k_mask = (k0 + offs_k) < K
    g = tl.load(g_ptrs + k0, mask=k_mask[None, :], other=0.0)
    u = tl.load(u_ptrs + k0, mask=k_mask[None, :], other=0.0)
    return g, u, tl.load(x_row + k0 + offs_k, mask=k_mask, other=0.0)


@triton.jit
def _row_scales(sg_ptrs, su_ptrs, k0, GROUP_K: tl.constexpr):
    """Block-scaled fp8: the gate and up rows' scales for the K step at ``k0`` (one block along K)."""
    return tl.load(sg_ptrs + k0 // GROUP_K), tl.load(su_ptrs + k0 // GROUP_K)


@triton.jit(do_not_specialize=["num_pairs"])  # batch-sized ints: see server/warmup.py
def fused_moe_gemv_gate_up_kernel(
    x_ptr, w13_ptr, act_ptr, ids_ptr, valid_ptr, counts_ptr, ws_ptr, N, expert_start, num_pairs,
    stride_xm, stride_we, stride_wn, stride_am, stride_se, stride_sn, scale_up_row,
    K: tl.constexpr, TOP_K: tl.constexpr, E: tl.constexpr, E_LOCAL: tl.constexpr, HAS_VALID: tl.constexpr,
    W_FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """act[p, n-block] = silu(gate) * up for pair ``program_id(0)``: its expert's gate and up rows
    streamed once, FMA in fp32.

    At a few tokens the grouped GEMM pads every pair to a 16-row tile and needs a sort; here a
    program reads only the weight rows it needs, and a pair that is not routed returns before
    reading anything. Program (0, 0) also writes the per-expert counts, saving their launch.
    The next K step's tiles are loaded before the current ones are multiplied: a program then
    always has a load in flight, where a plain loop would leave HBM idle while it computes.
    FP8 weights are widened in registers against the model-dtype x (no activation quantization:
    at a few tokens the weight stream is the cost); a block scale multiplies each step's row sums.
    """
    pdl_enter(PDL)
    pair = tl.program_id(0)
    if (pair == 0) & (tl.program_id(1) == 0):
        hist = pair_histogram(ids_ptr, valid_ptr, num_pairs, 0, TOP_K, E, HAS_VALID, BLOCK_P, BLOCK_E)
        tl.store(counts_ptr + tl.arange(0, BLOCK_E), hist, mask=tl.arange(0, BLOCK_E) < E)
    expert = tl.load(ids_ptr + pair) - expert_start
    skip = (expert < 0) | (expert >= E_LOCAL)
    if HAS_VALID:
        skip = skip | (tl.load(valid_ptr + pair // TOP_K) == 0)
    if skip:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N re-read row N-1 so the weight loads need no mask along N; never stored
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    g_ptrs = w13_ptr + expert.to(tl.int64) * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + N * stride_wn
    sg_ptrs = ws_ptr + expert.to(tl.int64) * stride_se + (rows // GROUP_N) * stride_sn
    su_ptrs = ws_ptr + expert.to(tl.int64) * stride_se + (scale_up_row + rows // GROUP_N) * stride_sn
    BLOCK_SCALED: tl.constexpr = W_FP8 and not PER_CHANNEL
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    g, u, x = _gate_up_tile(g_ptrs, u_ptrs, x_row, offs_k, 0, K, BLOCK_K)
    if BLOCK_SCALED:
        sg, su = _row_scales(sg_ptrs, su_ptrs, 0, GROUP_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        g_next, u_next, x_next = _gate_up_tile(g_ptrs, u_ptrs, x_row, offs_k, k0, K, BLOCK_K)
        xf = x.to(tl.float32)[None, :]
        if BLOCK_SCALED:
            sg_next, su_next = _row_scales(sg_ptrs, su_ptrs, k0, GROUP_K)
            acc_g += tl.sum(g.to(tl.float32) * xf, axis=1) * sg
            acc_u += tl.sum(u.to(tl.float32) * xf, axis=1) * su
            sg, su = sg_next, su_next
        else:
            acc_g += tl.sum(g.to(tl.float32) * xf, axis=1)
            acc_u += tl.sum(u.to(tl.float32) * xf, axis=1)
        g, u, x = g_next, u_next, x_next
    xf = x.to(tl.float32)[None, :]
    if BLOCK_SCALED:
        acc_g += tl.sum(g.to(tl.float32) * xf, axis=1) * sg
        acc_u += tl.sum(u.to(tl.float32) * xf, axis=1) * su
    else:
        acc_g += tl.sum(g.to(tl.float32) * xf, axis=1)
        acc_u += tl.sum(u.to(tl.float32) * xf, axis=1)
    if W_FP8 and PER_CHANNEL:
        acc_g *= tl.load(sg_ptrs)
        acc_u *= tl.load(su_ptrs)
    out = _epilogue(acc_g, acc_u, 0.0, True, False, act_ptr.dtype.element_ty)
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, out, mask=offs_n < N)


@triton.jit
def _down_tile(w_base, a_base, routed, offs_k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Every slot's weight tile [S, N, BLOCK_K] and activation slice [S, BLOCK_K] at K offset ``k0``.

    An unrouted slot is masked off whole (no memory traffic); the mask is uniform along K, so the
    loads still vectorise there.
    """
    cols = k0 + offs_k
    if K % BLOCK_K == 0:
        w = tl.load(w_base + cols[None, None, :], mask=routed[:, None, None], other=0.0)
        a = tl.load(a_base + cols[None, :], mask=routed[:, None], other=0.0)
    else:
        k_mask = cols < K
        w = tl.load(w_base + cols[None, None, :], mask=routed[:, None, None] & k_mask[None, None, :], other=0.0)
        a = tl.load(a_base + cols[None, :], mask=routed[:, None] & k_mask[None, :], other=0.0)
    return w, a


@triton.jit
def fused_moe_gemv_down_kernel(
    act_ptr, w2_ptr, out_ptr, weights_ptr, ids_ptr, valid_ptr, ws_ptr, H, expert_start,
    stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sn,
    K: tl.constexpr, TOP_K: tl.constexpr, E_LOCAL: tl.constexpr, HAS_VALID: tl.constexpr,
    W_FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[t, n-block] = sum over token t's routed slots of weight * (w2[expert] @ act[pair]).

    The slot sum happens in registers, so the small-batch path needs neither the per-pair output
    nor the sum launch. The token's expert ids and routing weights are read once, up front, and
    every K step loads all slots' weight tiles as one [BLOCK_S, BLOCK_N, BLOCK_K] tile, the next
    step's tile issued before the current one is multiplied: at one token a program must keep
    many bytes in flight, and a per-step chain of id load -> weight load -> multiply leaves HBM
    idle (measured on an H200 at 1.2 TB/s). The routing weight scales the activation, so one fp32
    accumulator serves every slot. A padding row comes out as zeros. FP8 weights: each slot's
    step sums take their block scales [BLOCK_S, BLOCK_N] (per-channel scales: once, at the end).
    """
    pdl_enter(PDL)
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, H - 1).to(tl.int64)
    slots = tl.arange(0, BLOCK_S)
    pairs = t * TOP_K + slots
    expert = tl.load(ids_ptr + pairs, mask=slots < TOP_K, other=0) - expert_start
    routed = (slots < TOP_K) & (expert >= 0) & (expert < E_LOCAL)
    if HAS_VALID:
        routed = routed & (tl.load(valid_ptr + t) != 0)
    expert = tl.where(routed, expert, 0)
    # a padding row's router output may be NaN; 0 * NaN would leak into its zero output
    weight = tl.where(routed, tl.load(weights_ptr + pairs, mask=routed, other=0.0), 0.0)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w2_ptr + expert.to(tl.int64)[:, None, None] * stride_we + rows[None, :, None] * stride_wn
    a_base = act_ptr + pairs.to(tl.int64)[:, None] * stride_am
    s_base = ws_ptr + expert.to(tl.int64)[:, None] * stride_se + (rows // GROUP_N)[None, :] * stride_sn
    BLOCK_SCALED: tl.constexpr = W_FP8 and not PER_CHANNEL
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    w, a = _down_tile(w_base, a_base, routed, offs_k, 0, K, BLOCK_K)
    if BLOCK_SCALED:
        s = tl.load(s_base, mask=routed[:, None], other=0.0)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_next, a_next = _down_tile(w_base, a_base, routed, offs_k, k0, K, BLOCK_K)
        if BLOCK_SCALED:
            s_next = tl.load(s_base + k0 // GROUP_K, mask=routed[:, None], other=0.0)
        part = tl.sum(w.to(tl.float32) * (a.to(tl.float32) * weight[:, None])[:, None, :], axis=2)
        if BLOCK_SCALED:
            acc += part * s
            s = s_next
        else:
            acc += part
        w, a = w_next, a_next
    part = tl.sum(w.to(tl.float32) * (a.to(tl.float32) * weight[:, None])[:, None, :], axis=2)
    if BLOCK_SCALED:
        acc += part * s
    else:
        acc += part
    if W_FP8 and PER_CHANNEL:
        acc *= tl.load(s_base, mask=routed[:, None], other=0.0)
    out = tl.sum(acc, axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < H)


@triton.jit
def moe_sum_kernel(
    c_ptr, out_ptr, ids_ptr, valid_ptr, H, expert_start, stride_cm, stride_om,
    TOP_K: tl.constexpr, E_LOCAL: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[t] = sum of token t's routed pair rows, in fp32; padding rows and unrouted tokens get zeros."""
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
