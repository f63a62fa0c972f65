"""FP4 routed experts: ``fp4_fused_experts``, the FP4 counterpart of kernels/moe_fused.fused_experts.

Weights as the loading side stores them (kernels/fp4_layout.py): w13 [E, 2I, H/2] (gate rows, then up rows),
w2 [E, H, I/2], block scales [E, rows, K/group], NVFP4 global scales [E, 2] (gate's, up's) and [E, 1], or one
per row ([E, 2I], [E, H]: applied in the same epilogue, no launch after it); optional
biases w13_bias [E, 2I] (added to gate and up before the activation) and w2_bias [E, H] (added to each
expert's down output before its routing weight). Activations: "silu" (silu(gate) * up) or gpt-oss's
"swiglu_oai" (gate = min(gate, limit); up = clamp(up, -limit, limit); (up + 1) * gate * sigmoid(alpha * gate)),
or DeepSeek-V4's "silu_clamp" (silu(gate) * up on the same clamps), gate and up rounded to the activation dtype
first, as a separate projection would store them.

Two paths, chosen from the shape alone (a captured graph replays one) by kernels/fp4_moe_config.plan: the card's
table where ``graphserve tune --tables fp4`` measured the shape, else the streaming path up to ``STREAM_MAX_PAIRS``:
- streaming, as kernels/moe_stream.py: gate_up per pair, its expert's gate and up rows streamed once and widened in
  registers, the activation in the epilogue; down per token, each slot's rows against its activation row, times its
  routing weight, summed in registers. Two launches; program (0, 0) of the first writes the per-expert counts.
- grouped GEMM, as kernels/moe_gemm.py over kernels/moe_align.py's sort: tiles of one expert's pairs
  (kernels/fp4_moe_gemm.py), each GEMM in its tile's variant: "bf16" widens the FP4 tile to bf16 in registers,
  "fp8" converts it to e4m3 for the FP8 tensor cores against its input quantized per row by one launch before
  (x per token, the activation per pair); then kernels/moe_gemm.moe_sum_kernel adds each token's slots.
Reference: kernels/fp4_experts_reference.fp4_fused_experts_reference (same arguments).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import sm_count
from graphserve.kernels.fp4_layout import (
    GROUP,
    WIDEN_UNIT_LOG2,
    block_scale,
    default_widen,
    fp4_check,
    group_bytes,
    widen_code,
    widen_fp16,
)
from graphserve.kernels.fp4_moe_config import DEFAULT_STREAM_MAX_PAIRS, VARIANTS, Fp4MoeTile, plan
from graphserve.kernels.fp4_moe_gemm import _fp4_moe_gemm_fp8_kernel, _fp4_moe_gemm_kernel, activate
from graphserve.kernels.fp4_words import word_row_sums, words_of
from graphserve.kernels.fp8_quant import per_token_group_quant
from graphserve.kernels.l2_prefetch import no_prefetch_args
from graphserve.kernels.moe_align import HISTOGRAM_PAIRS, moe_align, pair_histogram
from graphserve.kernels.moe_gemm import moe_sum_kernel
from graphserve.kernels.pdl import pdl_args, pdl_enter

ACTIVATIONS = ("silu", "swiglu_oai", "silu_clamp")  # ACT 0, 1, 2: kernels/moe_gemm.py's
PATHS = ("stream", "gemm")
X_DTYPES = (torch.bfloat16, torch.float16)
STREAM_MAX_PAIRS = DEFAULT_STREAM_MAX_PAIRS  # where no table says (kernels/fp4_moe_config.py)
_SUM_WARPS = 4
# the streaming down kernel runs a program per token and column block, each over its token's top-k experts in turn;
# where that leaves fewer than this many programs an SM, it runs a program per pair and a slot sum after it
DOWN_PER_PAIR_BELOW = 2


def stream_down_per_pair(tokens: int, hidden: int, block_n: int, device: torch.device) -> bool:
    """Whether the streaming down projection of ``tokens`` rows runs a program per (pair, column block), then
    kernels/moe_gemm.moe_sum_kernel, rather than one per (token, column block): below ``DOWN_PER_PAIR_BELOW``
    programs an SM (gpt-oss at one token: 90 programs on an H100's 132 SMs, each reading 4 experts' rows one after
    another) the card waits on each program's chain of loads; a program per pair is top-k times as many, shorter."""
    return tokens * triton.cdiv(hidden, block_n) < DOWN_PER_PAIR_BELOW * sm_count(device)


@triton.jit
def _row_sums(w_ptrs, s_ptrs, x_row, byte3, k0, ok, g_mask, K: tl.constexpr, GROUP_K: tl.constexpr,
              MX: tl.constexpr):  # fmt: skip
    """One K step's [BLOCK_N] sums of FP4 rows (bytes [BLOCK_N, KB, G2] at ``w_ptrs``) against an x row."""
    m3 = g_mask[None, :, None] & ok
    b = tl.load(w_ptrs + k0 // 2, mask=m3, other=0)
    s = tl.load(s_ptrs + k0 // GROUP_K, mask=g_mask[None, :] & ok, other=0)
    lo, hi = widen_fp16(b.to(tl.int32))
    cols = k0 + 2 * byte3
    x_mask = (g_mask[:, None] & (byte3 >= 0)) & ok
    xe = tl.load(x_row + cols, mask=x_mask, other=0.0).to(tl.float32)
    xo = tl.load(x_row + cols + 1, mask=x_mask, other=0.0).to(tl.float32)
    part = tl.sum(lo.to(tl.float32) * xe[None, :, :] + hi.to(tl.float32) * xo[None, :, :], axis=2)
    return tl.sum(part * block_scale(s, MX, 14), axis=1)


@triton.jit(do_not_specialize=["num_pairs"])
def _fp4_stream_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, act_ptr, ids_ptr, valid_ptr, counts_ptr, N, expert_start, num_pairs,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_gse, stride_be, stride_am, alpha, limit,
    K: tl.constexpr, TOP_K: tl.constexpr, E: tl.constexpr, E_LOCAL: tl.constexpr, HAS_VALID: tl.constexpr,
    GROUP_K: tl.constexpr, MX: tl.constexpr, HAS_GLOBAL: tl.constexpr, ROW_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr, WIDEN: tl.constexpr, UNIT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """act[pair, n-block] = activation(gate, up) for pair ``program_id(0)``; an unrouted pair reads nothing."""
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
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read row N-1; never stored
    offs_g, byte3 = group_bytes(BLOCK_K, GROUP_K)
    e = expert.to(tl.int64)
    g_ptrs = w_ptr + e * stride_we + rows[:, None, None] * stride_wn + byte3[None, :, :]
    u_ptrs = g_ptrs + N * stride_wn
    sg_ptrs = s_ptr + e * stride_se + rows[:, None] * stride_sn + offs_g[None, :]
    su_ptrs = sg_ptrs + N * stride_sn
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    gw_rows = w_ptr + e * stride_we + rows * stride_wn  # WIDEN > 0: w_ptr holds int32 words (kernels/fp4_words.py)
    for k0 in range(0, K, BLOCK_K):
        if WIDEN > 0:
            acc_g += word_row_sums(gw_rows, sg_ptrs, x_row, k0, True, K, GROUP_K, MX, BLOCK_K, WIDEN, UNIT)
            acc_u += word_row_sums(gw_rows + N * stride_wn, su_ptrs, x_row, k0, True, K, GROUP_K, MX, BLOCK_K, WIDEN,
                                   UNIT)
        else:
            g_mask = (k0 // GROUP_K + offs_g) < K // GROUP_K
            acc_g += _row_sums(g_ptrs, sg_ptrs, x_row, byte3, k0, True, g_mask, K, GROUP_K, MX)
            acc_u += _row_sums(u_ptrs, su_ptrs, x_row, byte3, k0, True, g_mask, K, GROUP_K, MX)
    if HAS_GLOBAL:
        if ROW_GLOBAL:  # one per w13 row: gate's rows, then up's
            acc_g *= tl.load(gs_ptr + e * stride_gse + rows)
            acc_u *= tl.load(gs_ptr + e * stride_gse + N + rows)
        else:
            acc_g *= tl.load(gs_ptr + e * stride_gse)
            acc_u *= tl.load(gs_ptr + e * stride_gse + 1)
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + e * stride_be + rows).to(tl.float32)
        acc_u += tl.load(b_ptr + e * stride_be + N + rows).to(tl.float32)
    out = activate(acc_g, acc_u, alpha, limit, ACT, act_ptr.dtype.element_ty)
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, out, mask=offs_n < N)


@triton.jit
def _fp4_stream_down_kernel(
    act_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, weights_ptr, ids_ptr, valid_ptr, H, expert_start,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_gse, stride_be, stride_om,
    K: tl.constexpr, TOP_K: tl.constexpr, E_LOCAL: tl.constexpr, HAS_VALID: tl.constexpr, GROUP_K: tl.constexpr,
    MX: tl.constexpr, HAS_GLOBAL: tl.constexpr, ROW_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDEN: tl.constexpr, UNIT: tl.constexpr, PER_PAIR: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """out[t, n-block] = sum over token t's routed slots of weight * (w2[expert] @ act[pair] + w2_bias[expert]);
    an unrouted slot reads nothing (its masked loads move no bytes) and a padding row comes out as zeros.
    ``PER_PAIR``: program_id(0) is a pair, not a token: out[pair] (fp32) = its one slot's term, which
    kernels/moe_gemm.moe_sum_kernel then adds per token in slot order (the same fp32 sum, in the same order)."""
    pdl_enter(PDL)
    t = tl.program_id(0) // TOP_K if PER_PAIR else tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, H - 1).to(tl.int64)
    offs_g, byte3 = group_bytes(BLOCK_K, GROUP_K)
    token_ok = True
    if HAS_VALID:
        token_ok = tl.load(valid_ptr + t) != 0
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(1 if PER_PAIR else TOP_K):
        pair = tl.program_id(0) if PER_PAIR else t * TOP_K + slot
        expert = tl.load(ids_ptr + pair) - expert_start
        routed = (expert >= 0) & (expert < E_LOCAL) & token_ok
        e = tl.where(routed, expert, 0).to(tl.int64)
        # a padding row's router output may be NaN; 0 * NaN would leak into its zero output
        weight = tl.where(routed, tl.load(weights_ptr + pair), 0.0)
        w_ptrs = w_ptr + e * stride_we + rows[:, None, None] * stride_wn + byte3[None, :, :]
        s_ptrs = s_ptr + e * stride_se + rows[:, None] * stride_sn + offs_g[None, :]
        a_row = act_ptr + pair.to(tl.int64) * stride_am
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if WIDEN > 0:
                acc += word_row_sums(w_ptr + e * stride_we + rows * stride_wn, s_ptrs, a_row, k0, routed, K, GROUP_K,
                                     MX, BLOCK_K, WIDEN, UNIT)  # fmt: skip
            else:
                g_mask = (k0 // GROUP_K + offs_g) < K // GROUP_K
                acc += _row_sums(w_ptrs, s_ptrs, a_row, byte3, k0, routed, g_mask, K, GROUP_K, MX)
        if HAS_GLOBAL:
            if ROW_GLOBAL:
                acc *= tl.load(gs_ptr + e * stride_gse + rows, mask=routed, other=0.0)
            else:
                acc *= tl.load(gs_ptr + e * stride_gse, mask=routed, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + e * stride_be + rows, mask=routed, other=0.0).to(tl.float32)
        out += weight * acc
    row = tl.program_id(0).to(tl.int64)  # the token's row, or with PER_PAIR the pair's
    tl.store(out_ptr + row * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < H)


def _check(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, topk_weights, topk_ids, w13_bias, w2_bias,
           activation):  # fmt: skip
    if x.dim() != 2 or x.dtype not in X_DTYPES:
        raise ValueError(f"fp4_fused_experts: x must be [T, H] in one of {X_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    if w13.dim() != 3:
        raise ValueError(f"fp4_fused_experts: w13 must be [E, 2I, H/2], got {tuple(w13.shape)}")
    e, h = w13.shape[0], x.shape[1]
    two_i, _ = fp4_check("fp4_fused_experts w13", w13, w13_scale, w13_global, fmt, h, (e,))
    if two_i % 2:
        raise ValueError(f"fp4_fused_experts: w13 has {two_i} rows, must be [gate; up]: an even count")
    inter = two_i // 2
    h2, _ = fp4_check("fp4_fused_experts w2", w2, w2_scale, w2_global, fmt, inter, (e,))
    if h2 != h:
        raise ValueError(f"fp4_fused_experts: w2 has {h2} rows, the hidden size is {h}")
    for name, g, cols, rows in (("w13_global", w13_global, 2, two_i), ("w2_global", w2_global, 1, h)):
        if fmt == "nvfp4":
            if g is None or g.dtype != torch.float32 or tuple(g.shape) not in ((e, cols), (e, rows)) \
                    or not g.is_contiguous():
                raise ValueError(f"fp4_fused_experts: nvfp4 {name} must be contiguous fp32 [{e}, {cols}] (one per "
                                 f"part) or [{e}, {rows}] (one per row), got "
                                 f"{None if g is None else (g.dtype, tuple(g.shape))}")
        elif g is not None:
            raise ValueError(f"fp4_fused_experts: mxfp4 takes no {name}, got shape {tuple(g.shape)}")
    for name, b, n in (("w13_bias", w13_bias, two_i), ("w2_bias", w2_bias, h)):
        if b is not None and (tuple(b.shape) != (e, n) or not b.is_contiguous()):
            raise ValueError(f"fp4_fused_experts: {name} must be contiguous [{e}, {n}], got {tuple(b.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"fp4_fused_experts: activation={activation!r} must be one of {ACTIVATIONS}")
    if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_ids must be int32 and topk_weights fp32, got {topk_ids.dtype}, {topk_weights.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be "
                         f"[{x.shape[0]}, k]")


def fp4_fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w13_global: torch.Tensor | None,
    w2: torch.Tensor, w2_scale: torch.Tensor, w2_global: torch.Tensor | None, fmt: str,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, valid: torch.Tensor | None = None,
    expert_start: int = 0, counts: torch.Tensor | None = None, w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
    path: str | None = None, widen: str | None = None, variant: str | None = None,
    tiles: tuple[Fp4MoeTile, Fp4MoeTile] | None = None, down_per_pair: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """sum over slots of weight * (down(act(gate_up(x) + w13_bias)) + w2_bias) over this rank's experts, [T, H].

    ``valid`` (bool [T]) marks real rows; ``counts`` (int32 [E global]) receives the pairs per expert;
    ``expert_start``: the first local expert's global id (expert parallel). ``path`` ("stream" | "gemm")
    overrides the rule (tests, benchmarks). ``widen`` (fp4_layout.WIDENINGS; None: fp4_layout.default_widen): the
    streaming path's widening (kernels/fp4_words.py); the grouped GEMM ignores it. ``variant`` ("bf16" | "fp8")
    runs both grouped GEMMs in that variant with its default tiles, ``tiles`` (gate_up's, down's) with these
    (tests, benchmarks, the tuner); neither: the card's table (kernels/fp4_moe_config.py). ``down_per_pair``: the
    streaming down projection's grid (``stream_down_per_pair``; None: by the shape)."""
    _check(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, topk_weights, topk_ids, w13_bias, w2_bias,
           activation)  # fmt: skip
    if path not in (None, *PATHS):
        raise ValueError(f"fp4_fused_experts: path={path!r} must be one of {PATHS}")
    if variant not in (None, *VARIANTS):
        raise ValueError(f"fp4_fused_experts: variant={variant!r} must be one of {VARIANTS}")
    widen_id = widen_code("fp4_fused_experts", widen or default_widen(x.device), x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    t, h = x.shape
    num_local, inter, k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    pairs, device = t * k, x.device
    if counts is None:
        counts = torch.empty(expert_start + num_local, dtype=torch.int32, device=device)
    out = torch.empty(t, h, dtype=x.dtype, device=device)
    if t == 0:
        counts.zero_()
        return out
    group, mx = GROUP[fmt], fmt == "mxfp4"
    valid_arg = topk_ids if valid is None else valid.view(torch.uint8)
    placeholder = out
    g13 = w13_global if w13_global is not None else placeholder
    g2 = w2_global if w2_global is not None else placeholder
    b13 = w13_bias if w13_bias is not None else placeholder
    b2 = w2_bias if w2_bias is not None else placeholder
    s13, s2 = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    common = dict(GROUP_K=group, MX=mx, HAS_GLOBAL=w13_global is not None)
    # one global per row ([E, 2I] / [E, H]) where given, else one per part ([E, 2] gate's and up's / [E, 1])
    row13 = w13_global is not None and w13_global.shape[1] == 2 * inter
    row2 = w2_global is not None and w2_global.shape[1] == h > 1
    gs13_stride = w13_global.stride(0) if w13_global is not None else 2
    gs2_stride = w2_global.stride(0) if w2_global is not None else 1
    act_id = ACTIVATIONS.index(activation)
    chosen = plan(fmt, num_local, inter, h, pairs, device, variant)
    if (path or chosen.path) == "stream":
        act = torch.empty(pairs, inter, dtype=x.dtype, device=device)
        bn, words = 32, widen_id > 0
        unit = WIDEN_UNIT_LOG2[widen_id]
        w13s = words_of(w13, "fp4_fused_experts: w13") if words else w13
        w2s = words_of(w2, "fp4_fused_experts: w2") if words else w2
        _fp4_stream_gate_up_kernel[(pairs, triton.cdiv(inter, bn))](
            x, w13s, s13, g13, b13, act, topk_ids, valid_arg, counts, inter, expert_start, pairs,
            x.stride(0), w13s.stride(0), w13s.stride(1), s13.stride(0), s13.stride(1), gs13_stride, 2 * inter,
            act.stride(0), float(alpha), float(limit), K=h, TOP_K=k, E=counts.numel(), E_LOCAL=num_local,
            HAS_VALID=valid is not None, ROW_GLOBAL=row13, HAS_BIAS=w13_bias is not None, ACT=act_id, BLOCK_N=bn,
            BLOCK_K=max(group, min(256, triton.next_power_of_2(h))), BLOCK_P=HISTOGRAM_PAIRS,
            BLOCK_E=triton.next_power_of_2(counts.numel()), WIDEN=widen_id, UNIT=unit, num_warps=4, **common,
            **pdl_args(device, "_fp4_stream_gate_up_kernel"),
        )  # fmt: skip
        per_pair = stream_down_per_pair(t, h, bn, device) if down_per_pair is None else down_per_pair
        terms = torch.empty(pairs, h, dtype=torch.float32, device=device) if per_pair else out
        _fp4_stream_down_kernel[(pairs if per_pair else t, triton.cdiv(h, bn))](
            act, w2s, s2, g2, b2, terms, topk_weights, topk_ids, valid_arg, h, expert_start,
            act.stride(0), w2s.stride(0), w2s.stride(1), s2.stride(0), s2.stride(1), gs2_stride, h, terms.stride(0),
            K=inter, TOP_K=k, E_LOCAL=num_local, HAS_VALID=valid is not None, ROW_GLOBAL=row2,
            HAS_BIAS=w2_bias is not None,
            BLOCK_N=bn, BLOCK_K=max(group, min(256, triton.next_power_of_2(inter))), WIDEN=widen_id, UNIT=unit,
            PER_PAIR=per_pair, num_warps=4, **common,
            **pdl_args(device, "_fp4_stream_down_kernel"),
        )  # fmt: skip
        if per_pair:
            _sum_slots(terms, out, topk_ids, valid_arg, valid is not None, expert_start, num_local, k, device)
        return out
    gu_tile, dn_tile = tiles or (chosen.gate_up, chosen.down)
    gu_tile.check("fp4_fused_experts gate_up tile", group, h)
    dn_tile.check("fp4_fused_experts down tile", group, inter)
    if gu_tile.block_m != dn_tile.block_m:
        raise ValueError(f"fp4_fused_experts: the gate_up and down tiles share one sort: block_m {gu_tile.block_m} "
                         f"and {dn_tile.block_m} must be equal")
    align = moe_align(topk_ids, valid, counts, expert_start, num_local, gu_tile.block_m)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=device)
    down = torch.empty(pairs, h, dtype=x.dtype, device=device)
    for a, w, s, g, b, c, n, kk, gated, tile in ((x, w13, s13, g13, b13, act, inter, h, True, gu_tile),
                                                 (act, w2, s2, g2, b2, down, h, inter, False, dn_tile)):
        fp8 = tile.variant == "fp8"
        if fp8:  # one scale a row: x's per token, the activation's per pair
            aq, a_scale = per_token_group_quant(a, kk)
            a_args = (aq.view(torch.uint8), a_scale)
            a_strides = (aq.stride(0), a_scale.stride(0))
        else:
            a_args, a_strides = (a,), (a.stride(0),)
        grid = (align.max_blocks * triton.cdiv(n, tile.block_n),)
        kernel = _fp4_moe_gemm_fp8_kernel if fp8 else _fp4_moe_gemm_kernel
        kernel[grid](
            *a_args, w, s, g, b, c, topk_weights, align.sorted_ids, align.expert_ids, align.num_post_padded, pairs, n,
            align.max_blocks, *a_strides, w.stride(0), w.stride(1), s.stride(0), s.stride(1),
            gs13_stride if gated else gs2_stride, 2 * n if gated else n, c.stride(0), float(alpha), float(limit),
            K=kk, A_ROW_DIV=k if gated else 1, GATED=gated, MUL_WEIGHT=not gated, ACT=act_id,
            ROW_GLOBAL=row13 if gated else row2,
            HAS_BIAS=(w13_bias if gated else w2_bias) is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k, GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages,
            **common, **pdl_args(device, kernel.__name__),
        )  # fmt: skip
    _sum_slots(down, out, topk_ids, valid_arg, valid is not None, expert_start, num_local, k, device)
    return out


def _sum_slots(terms: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor, valid_arg: torch.Tensor,
               has_valid: bool, expert_start: int, num_local: int, k: int, device: torch.device) -> None:
    """out[t] = the sum of token t's routed pair rows of ``terms`` (kernels/moe_gemm.moe_sum_kernel)."""
    t, h = out.shape
    block_h = min(1024, triton.next_power_of_2(h))
    moe_sum_kernel[(t, triton.cdiv(h, block_h))](
        terms, out, topk_ids, valid_arg, h, expert_start, terms.stride(0), out.stride(0), **no_prefetch_args(terms),
        PF_THREADS=32 * _SUM_WARPS, TOP_K=k, E_LOCAL=num_local, HAS_VALID=has_valid, BLOCK_H=block_h,
        num_warps=_SUM_WARPS, **pdl_args(device, "moe_sum_kernel"),
    )  # fmt: skip

