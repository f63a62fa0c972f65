"""The routed experts' small-batch path: two streaming kernels in place of the sort, the grouped GEMMs
and the k-sum (kernels/moe_fused.py takes it up to the tuned table's ``small_max_pairs``).

gate_up runs per (token, slot) pair: the expert's gate and up rows streamed once, silu(gate) * up
formed in registers (gate and up rounded to the activation dtype first, as the grouped GEMM's
epilogue does) and [pairs, I] written. down runs per token: its k slots' rows of ``w2`` and the
routing weights, the slot sum in registers, so no moe_sum launch follows. FP8 weights (``W_FP8``)
are widened in registers against model-dtype activations, a block scale multiplying each K step's
row sums (per channel: the row's scale once). gpt-oss's expert biases (``HAS_BIAS``) join the accumulators
after the scales and its activation is gated_epilogue's ``ACT``. References: kernels/moe_reference.experts_reference,
kernels/moe_fp8_reference.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphserve.kernels.moe_align import pair_histogram
from graphserve.kernels.moe_gemm import _k_scales, gated_epilogue
from graphserve.kernels.pdl import pdl_enter


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


@triton.jit
def _gate_up_scales(sg_ptrs, su_ptrs, kg_row, ku_row, offs_k, k0, K: tl.constexpr, GROUP_K: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_SCALED: tl.constexpr, K_SCALES: tl.constexpr):  # fmt: skip
    """The gate's and the up rows' scales of the K step at ``k0``: with ``K_SCALES`` one per column along the
    program's block rows ``kg_row`` / ``ku_row`` (the grouped GEMM's moe_gemm._k_scales), block-scaled one per
    row, else none (1.0)."""
    sg, su = 1.0, 1.0
    if K_SCALES:
        sg, su = _k_scales(kg_row, k0, offs_k, K, GROUP_K, BLOCK_K), _k_scales(ku_row, k0, offs_k, K, GROUP_K, BLOCK_K)
    if BLOCK_SCALED:
        sg, su = _row_scales(sg_ptrs, su_ptrs, k0, GROUP_K)
    return sg, su


@triton.jit
def _gate_up_acc(acc_g, acc_u, g, u, xf, sg, su, BLOCK_SCALED: tl.constexpr, K_SCALES: tl.constexpr):
    """The accumulators plus one K step's gate and up row sums in fp32 (``xf``: x widened, [1, BLOCK_K]), its
    scales applied: to x per column (``K_SCALES``) or to the sums per row (block scales); per-channel scales wait
    for the end."""
    if K_SCALES:
        acc_g += tl.sum(g.to(tl.float32) * (xf * sg[None, :]), axis=1)
        acc_u += tl.sum(u.to(tl.float32) * (xf * su[None, :]), axis=1)
    elif BLOCK_SCALED:
        acc_g += tl.sum(g.to(tl.float32) * xf, axis=1) * sg
        acc_u += tl.sum(u.to(tl.float32) * xf, axis=1) * su
    else:
        acc_g += tl.sum(g.to(tl.float32) * xf, axis=1)
        acc_u += tl.sum(u.to(tl.float32) * xf, axis=1)
    return acc_g, acc_u


@triton.jit(do_not_specialize=["num_pairs"])  # batch-sized ints: see engine/warmup.py
def fused_moe_gemv_gate_up_kernel(
    x_ptr, w13_ptr, act_ptr, ids_ptr, valid_ptr, counts_ptr, ws_ptr, N, expert_start, num_pairs,
    stride_xm, stride_we, stride_wn, stride_am, stride_se, stride_sn, scale_up_row,
    K: tl.constexpr, TOP_K: tl.constexpr, E: tl.constexpr, E_LOCAL: tl.constexpr, HAS_VALID: tl.constexpr,
    W_FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, PER_CHANNEL: tl.constexpr,
    K_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr, PDL: tl.constexpr, b13_ptr, stride_b13e, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """act[p, n-block] = silu(gate) * up for pair ``program_id(0)``: its expert's gate and up rows
    streamed once, FMA in fp32.

    At a few tokens the grouped GEMM pads every pair to a 16-row tile and needs a sort; here a
    program reads only the weight rows it needs, and a pair that is not routed returns before
    reading anything. Program (0, 0) also writes the per-expert counts, saving their launch.
    The next K step's tiles are loaded before the current ones are multiplied: a program then
    always has a load in flight, where a plain loop would leave HBM idle while it computes.
    FP8 weights are widened in registers against the model-dtype x (no activation quantization:
    at a few tokens the weight stream is the cost); a block scale multiplies each step's row sums, or, with
    ``K_SCALES`` (the program's rows in one row of scale blocks, a step spanning several blocks along K), x's
    elements, each by its block's scale (the gate's and the up rows' apart).
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
    BLOCK_SCALED: tl.constexpr = W_FP8 and not PER_CHANNEL and not K_SCALES
    kg_row, ku_row = sg_ptrs, su_ptrs  # K_SCALES: the program's one row of scale blocks, for gate and for up
    if K_SCALES:
        block_row = (tl.program_id(1) * BLOCK_N) // GROUP_N
        kg_row = ws_ptr + expert.to(tl.int64) * stride_se + block_row * stride_sn
        ku_row = ws_ptr + expert.to(tl.int64) * stride_se + (scale_up_row + block_row) * stride_sn
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    g, u, x = _gate_up_tile(g_ptrs, u_ptrs, x_row, offs_k, 0, K, BLOCK_K)
    sg, su = _gate_up_scales(sg_ptrs, su_ptrs, kg_row, ku_row, offs_k, 0, K, GROUP_K, BLOCK_K, BLOCK_SCALED, K_SCALES)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        g_next, u_next, x_next = _gate_up_tile(g_ptrs, u_ptrs, x_row, offs_k, k0, K, BLOCK_K)
        xf = x.to(tl.float32)[None, :]
        sg_next, su_next = _gate_up_scales(sg_ptrs, su_ptrs, kg_row, ku_row, offs_k, k0, K, GROUP_K, BLOCK_K,
                                           BLOCK_SCALED, K_SCALES)  # fmt: skip
        acc_g, acc_u = _gate_up_acc(acc_g, acc_u, g, u, xf, sg, su, BLOCK_SCALED, K_SCALES)
        g, u, x = g_next, u_next, x_next
        if BLOCK_SCALED or K_SCALES:  # unscaled, sg and su stay the constants they are (not carried by the loop)
            sg, su = sg_next, su_next
    acc_g, acc_u = _gate_up_acc(acc_g, acc_u, g, u, x.to(tl.float32)[None, :], sg, su, BLOCK_SCALED, K_SCALES)
    if W_FP8 and PER_CHANNEL:
        acc_g *= tl.load(sg_ptrs)
        acc_u *= tl.load(su_ptrs)
    if HAS_BIAS:  # gpt-oss: the expert's gate and up biases, before the activation
        b_row = b13_ptr + expert.to(tl.int64) * stride_b13e
        acc_g += tl.load(b_row + rows).to(tl.float32)
        acc_u += tl.load(b_row + N + rows).to(tl.float32)
    out = gated_epilogue(acc_g, acc_u, 0.0, True, False, act_ptr.dtype.element_ty, ACT, ALPHA, LIMIT)
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
def _down_scales(s_base, k_rows, routed, offs_k, k0, K: tl.constexpr, GROUP_K: tl.constexpr,
                 BLOCK_SCALED: tl.constexpr, K_SCALES: tl.constexpr):  # fmt: skip
    """The K step at ``k0``'s scales: with ``K_SCALES`` [slots, BLOCK_K], one per slot and column (each slot's
    expert's block row ``k_rows``); block-scaled [slots, BLOCK_N], one per slot and row; else none (1.0). An
    unrouted slot's are 0."""
    s = 1.0
    if K_SCALES:
        cols = k0 + offs_k
        s = tl.load(k_rows[:, None] + (cols // GROUP_K)[None, :], mask=routed[:, None] & (cols < K)[None, :],
                    other=0.0)  # fmt: skip
    if BLOCK_SCALED:
        s = tl.load(s_base + k0 // GROUP_K, mask=routed[:, None], other=0.0)
    return s


@triton.jit
def _down_sums(w, a, weight, s, BLOCK_SCALED: tl.constexpr, K_SCALES: tl.constexpr):
    """One K step's [slots, BLOCK_N] sums of every slot's tile against its activation times its routing weight,
    its scales applied: to the activation per column (``K_SCALES``) or to the sums (block scales)."""
    wf = w.to(tl.float32)
    aw = a.to(tl.float32) * weight[:, None]
    if K_SCALES:
        aw = aw * s
    part = tl.sum(wf * aw[:, None, :], axis=2)
    if BLOCK_SCALED:
        part = part * s
    return part


@triton.jit
def fused_moe_gemv_down_kernel(
    act_ptr, w2_ptr, out_ptr, weights_ptr, ids_ptr, valid_ptr, ws_ptr, H, expert_start,
    stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sn,
    K: tl.constexpr, TOP_K: tl.constexpr, E_LOCAL: tl.constexpr, HAS_VALID: tl.constexpr,
    W_FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, PER_CHANNEL: tl.constexpr,
    K_SCALES: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    b2_ptr, stride_b2e, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """out[t, n-block] = sum over token t's routed slots of weight * (w2[expert] @ act[pair]).

    The slot sum happens in registers, so the small-batch path needs neither the per-pair output
    nor the sum launch. The token's expert ids and routing weights are read once, up front, and
    every K step loads all slots' weight tiles as one [BLOCK_S, BLOCK_N, BLOCK_K] tile, the next
    step's tile issued before the current one is multiplied: at one token a program must keep
    many bytes in flight, and a per-step chain of id load -> weight load -> multiply leaves HBM
    idle (measured on an H200 at 1.2 TB/s). The routing weight scales the activation, so one fp32
    accumulator serves every slot. A padding row comes out as zeros. FP8 weights: each slot's
    step sums take their block scales [BLOCK_S, BLOCK_N] (per-channel scales: once, at the end); with
    ``K_SCALES`` (the program's rows in one row of scale blocks) the scales multiply the activation instead, one
    per slot and column, so a step may span several blocks along K.
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
    BLOCK_SCALED: tl.constexpr = W_FP8 and not PER_CHANNEL and not K_SCALES
    k_rows = s_base  # K_SCALES: each slot's expert's row of scale blocks for the program's rows
    if K_SCALES:
        k_rows = ws_ptr + expert.to(tl.int64) * stride_se + ((tl.program_id(1) * BLOCK_N) // GROUP_N) * stride_sn
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    w, a = _down_tile(w_base, a_base, routed, offs_k, 0, K, BLOCK_K)
    s = _down_scales(s_base, k_rows, routed, offs_k, 0, K, GROUP_K, BLOCK_SCALED, K_SCALES)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_next, a_next = _down_tile(w_base, a_base, routed, offs_k, k0, K, BLOCK_K)
        s_next = _down_scales(s_base, k_rows, routed, offs_k, k0, K, GROUP_K, BLOCK_SCALED, K_SCALES)
        acc += _down_sums(w, a, weight, s, BLOCK_SCALED, K_SCALES)
        w, a = w_next, a_next
        if BLOCK_SCALED or K_SCALES:  # unscaled, s stays the constant it is (not carried by the loop)
            s = s_next
    acc += _down_sums(w, a, weight, s, BLOCK_SCALED, K_SCALES)
    if W_FP8 and PER_CHANNEL:
        acc *= tl.load(s_base, mask=routed[:, None], other=0.0)
    if HAS_BIAS:  # gpt-oss: each slot's expert's down bias, weighted as its product is
        bias = tl.load(b2_ptr + expert.to(tl.int64)[:, None] * stride_b2e + rows[None, :], mask=routed[:, None],
                       other=0.0)  # fmt: skip
        acc += bias.to(tl.float32) * weight[:, None]
    out = tl.sum(acc, axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < H)
