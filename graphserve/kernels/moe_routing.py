"""Routing in one launch: router logits [T, E] -> (weights fp32 [T, k], expert ids int32 [T, k]).

Two modes. Softmax top-k (Qwen-MoE, Mixtral, OLMoE): transformers computes softmax in fp32, takes
torch.topk of the probabilities and optionally divides by their sum; apart that is four or five
launches per layer on a decode step. Grouped sigmoid top-k (DeepSeek-V3): sigmoid scores, a
correction bias for the choice only, the best ``topk_group`` of ``n_group`` groups, then top-k;
apart that is a dozen launches. Here each program takes ``BLOCK_T`` rows whole (E <= a few hundred
fits in registers), finds maxima by rounds of argmax (the first index wins a tie, as torch.topk
does on CPU) and writes weights and ids once. References: kernels/moe_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.pdl import pdl_args, pdl_enter

MAX_EXPERTS = 1024


# How _softmax_topk_store picks the k largest of a row (the same weights and ids either way):
# "rounds": k rounds of argmax, each a reduction carrying value and index;
# "packed": k rounds of max over one int64 key per expert, the probability's bits above the complement of its
#   column (probabilities are >= 0, so their bits order as the floats do; a tie goes to the lower column);
# "bitonic": tl.topk (a bitonic sort network cut to k) over the same keys.
# The default, by `python3 -m benchmarks.decode_latency --only router-select` on an H200 (da8f5ad, each a CUDA graph of
# 48 layers' calls): in the tensor-core gate at k 8, bitonic took 7.73 / 8.26 / 11.52 us at 16 / 32 / 64 rows where
# the rounds took 8.35 / 8.84 / 11.53 and packed 8.58 / 9.21 / 11.87; standalone at 64 rows 2.03 against 2.10 / 2.03.
# The FMA gate (kernels/moe_gate.py, up to its few rows) keeps the rounds: not measured there.
TOPK_SELECTS = ("rounds", "packed", "bitonic")
TOPK_SELECT = "bitonic"


def topk_select(select: str | None) -> int:
    """The kernels' ``SELECT`` for ``select``, or for the module's ``TOPK_SELECT``; anything else is refused by name."""
    select = TOPK_SELECT if select is None else select
    if select not in TOPK_SELECTS:
        raise ValueError(f"select={select!r} must be one of {TOPK_SELECTS}")
    return TOPK_SELECTS.index(select)


@triton.jit
def _softmax_topk_store(
    logits, rows, row_mask, cols, weights_ptr, ids_ptr,
    E: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    SELECT: tl.constexpr,
):  # fmt: skip
    """Softmax over the fp32 logits [BLOCK_T, BLOCK_E] of ``rows``, the k largest, written once (``SELECT``: the
    index in ``TOPK_SELECTS`` of the way to pick them)."""
    mask = row_mask[:, None] & (cols[None, :] < E)
    logits = tl.where(mask, logits, float("-inf"))
    row_max = tl.max(logits, axis=1)
    row_max = tl.where(row_mask, row_max, 0.0)  # rows past T are all -inf: keep them NaN-free
    p = tl.exp(logits - row_max[:, None])
    p = p / tl.where(row_mask, tl.sum(p, axis=1), 1.0)[:, None]
    p = tl.where(mask, p, -1.0)  # padded experts can never be chosen
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    if SELECT == 0:  # rounds
        for s in tl.static_range(TOP_K):
            # value and index in one reduction (the first index wins a tie)
            best_p, best = tl.max(p, axis=1, return_indices=True, return_indices_tie_break_left=True)
            top_w = tl.where(slots[None, :] == s, best_p[:, None], top_w)
            top_i = tl.where(slots[None, :] == s, best[:, None].to(tl.int32), top_i)
            p = tl.where(cols[None, :] == best[:, None], -1.0, p)
    else:
        # key: the probability's bits over (BLOCK_E - 1) - column, so a tie goes to the lower column. -1.0 (padding)
        # has the sign bit: its key is negative, below every probability's
        last: tl.constexpr = cols.shape[0] - 1
        low = (last - cols.to(tl.int64)) + 0  # + 0: Triton's interpreter keeps constexpr - tensor a constexpr
        key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | low[None, :]
        # one-row tiles keep the rounds of max: tl.topk of a [1, E] tile cut to one element does not compile
        # (Triton 3.6), and those tiles were measured so
        if SELECT == 1 or BLOCK_T == 1 or BLOCK_K == 1:
            top = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
            for s in tl.static_range(TOP_K):
                best_key = tl.max(key, axis=1)
                top = tl.where(slots[None, :] == s, best_key[:, None], top)
                # a taken key drops below every probability's (above padding's; k <= E, so never taken again)
                key = tl.where(key == best_key[:, None], -(1 << 62), key)
        else:
            top = tl.topk(key, BLOCK_K)  # bitonic, descending
        top_w = tl.where(slots[None, :] < TOP_K, (top >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
        top_i = tl.where(slots[None, :] < TOP_K, -(top & 0xFFFFFFFF).to(tl.int32) + last, 0)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    offs = rows[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + offs, top_w, mask=out_mask)
    tl.store(ids_ptr + offs, top_i, mask=out_mask)


@triton.jit(do_not_specialize=["T"])  # batch-sized ints: see engine/warmup.py
def moe_softmax_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, T, stride_t,
    E: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SELECT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < T
    mask = row_mask[:, None] & (cols[None, :] < E)
    logits = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=float("-inf"))
    _softmax_topk_store(logits.to(tl.float32), rows, row_mask, cols, weights_ptr, ids_ptr,
                        E, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_K, SELECT)  # fmt: skip


def _num_experts(logits: torch.Tensor) -> int:
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got {tuple(logits.shape)}")
    return logits.shape[1]


def _route(kernel, logits: torch.Tensor, top_k: int, block_t: int | None, logits_per_program: int, **args
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch both modes share, once their arguments are checked: the outputs (weights fp32 [T, k],
    expert ids int32 [T, k]) and ``block_t`` rows per program, by default about ``logits_per_program``
    logits (a decode batch is one or a few programs, a prefill chunk spreads). ``args``: the kernel's own."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    block_t = block_t or max(1, min(triton.next_power_of_2(t), logits_per_program // block_e))
    kernel[(triton.cdiv(t, block_t),)](
        logits_ptr=logits, weights_ptr=weights, ids_ptr=ids, T=t, stride_t=logits.stride(0),
        E=e, TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4 if block_e * block_t >= 2048 else 1, **args, **pdl_args(logits.device, kernel.__name__),
    )  # fmt: skip
    return weights, ids


def moe_softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, *, block_t: int | None = None, select: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int32 [T, k]) of the k most probable experts of each row (``select``: one of
    ``TOPK_SELECTS``, default ``TOPK_SELECT``)."""
    e = _num_experts(logits)
    if not 0 < e <= MAX_EXPERTS:
        raise ValueError(f"num_experts={e} must be in 1..{MAX_EXPERTS} for the routing kernel")
    if not 0 < top_k <= e:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={e}")
    # about 128 logits a program (one row of E = 128, one warp): the k rounds of argmax are a chain of
    # reductions, so a decode batch spreads over many programs rather than a few programs of many rows
    return _route(moe_softmax_topk_kernel, logits, top_k, block_t, 128, RENORMALIZE=renormalize,
                  SELECT=topk_select(select))


@triton.jit(do_not_specialize=["T"])  # batch-sized ints: see engine/warmup.py
def moe_grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, T, stride_t, scaling,
    E: tl.constexpr, TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < T
    mask = row_mask[:, None] & (cols[None, :] < E)
    logits = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)
    bias = tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)
    biased = tl.where(mask, scores + bias[None, :], float("-inf"))
    group_of = cols // (E // N_GROUP)
    groups = tl.arange(0, BLOCK_G)
    # a group's merit: the sum of its two best biased scores (its best alone if it has one expert)
    merit = tl.full((BLOCK_T, BLOCK_G), float("-inf"), dtype=tl.float32)
    for g in tl.static_range(N_GROUP):
        in_group = tl.where((group_of == g)[None, :], biased, float("-inf"))
        best = tl.max(in_group, axis=1)
        m = best
        if E // N_GROUP > 1:
            first = tl.argmax(in_group, axis=1, tie_break_left=True)
            m = best + tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), in_group), axis=1)
        merit = tl.where(groups[None, :] == g, m[:, None], merit)
    allowed = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        g_best = tl.argmax(merit, axis=1, tie_break_left=True)
        allowed = allowed | (group_of[None, :] == g_best[:, None])
        merit = tl.where(groups[None, :] == g_best[:, None], float("-inf"), merit)
    choice = tl.where(allowed & mask, biased, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for s in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1, tie_break_left=True)
        picked = cols[None, :] == best[:, None]
        w = tl.sum(tl.where(picked, scores, 0.0), axis=1)  # the unbiased score weighs the expert
        top_w = tl.where(slots[None, :] == s, w[:, None], top_w)
        top_i = tl.where(slots[None, :] == s, best[:, None].to(tl.int32), top_i)
        choice = tl.where(picked, float("-inf"), choice)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, axis=1)[:, None] + 1e-20)
    top_w = top_w * scaling
    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    offs = rows[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + offs, top_w, mask=out_mask)
    tl.store(ids_ptr + offs, top_i, mask=out_mask)


def moe_grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    *,
    block_t: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's grouped sigmoid top-k in one launch; see moe_reference.grouped_sigmoid_topk_reference."""
    e = _num_experts(logits)
    if not 0 < e <= MAX_EXPERTS or n_group <= 0 or e % n_group:
        raise ValueError(f"num_experts={e} must be in 1..{MAX_EXPERTS} and divisible by n_group={n_group}")
    if not 0 < topk_group <= n_group or not 0 < top_k <= topk_group * (e // n_group):
        raise ValueError(f"top_k={top_k}, topk_group={topk_group} do not fit n_group={n_group} of {e} experts")
    if correction_bias.shape != (e,):
        raise ValueError(f"e_score_correction_bias must be [{e}], got {tuple(correction_bias.shape)}")
    return _route(moe_grouped_topk_kernel, logits, top_k, block_t, 2048, bias_ptr=correction_bias.contiguous(),
                  scaling=float(routed_scaling_factor), N_GROUP=n_group, TOPK_GROUP=topk_group,
                  RENORMALIZE=renormalize, BLOCK_G=triton.next_power_of_2(n_group))
