"""The router gate projection and softmax top-k in one launch, for decode-sized batches.

Unfused, a decode step's router is three launches per MoE layer: the gate matmul (x [T, H] against
``mlp.gate.weight`` [E, H]; cuBLAS takes ~5 us on an H200 for qwen3-30b-a3b's 0.5 MB gate at one
row), the fp32 copy of the logits, and the top-k kernel; each also costs a gap in the graph.
Here each program computes the logits of ``BLOCK_EP`` experts for every row, rounded to the
activation dtype as the separate projection would write them, stores them to a small fp32
scratch and counts itself done on a per-layer counter. The program that finds it is the last
(the counter's atomic is acq_rel at GPU scope, after a barrier that orders its block's stores)
reads every logit back from L2, runs the softmax top-k of kernels/moe_routing.py, and resets the
counter for the next launch or graph replay. No host sync; the scratch is sized by T alone.
Reference: F.linear then kernels/moe_reference.softmax_topk_reference.

The same launch can take the layer's post-attention residual add and RMSNorm as well (``NORM``):
every program needs the whole normed row for its dot products anyway, so each one adds the
residual and normalises the row itself (a few KB from L2 at decode sizes) and writes its share of
columns of the normed hidden and of the new residual, which the experts and the next layer read.
That removes the norm's launch and its gap: two launches per MoE layer become one.
Reference: moe_add_norm_gate_reference.

Past ``MAX_ROWS`` rows of 16-bit activations (up to ``DOT_MAX_ROWS``) ``moe_gate_softmax_topk`` hands the call
to the tensor-core kernel of kernels/moe_gate_dot.py, one launch too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.moe_gate_dot import (
    DOT_DTYPES,
    DOT_MAX_ROWS,
    check_counter,
    checked_gate_args,
    moe_gate_dot_softmax_topk,
)
from graphserve.kernels.moe_reference import softmax_topk_reference
from graphserve.kernels.moe_routing import MAX_EXPERTS, _softmax_topk_store
from graphserve.kernels.norm import fused_add_rms_norm_reference
from graphserve.kernels.pdl import pdl_args, pdl_enter

MAX_ROWS = 8  # the FMA kernel's rows: beyond this the weight reuse favours tensor cores (and one program's x tile grows)
# The residual add + RMSNorm join the gate's launch only up to this many rows: each gate program
# normalises every row it reads, so the saved launch turns into a loss as rows grow. On the H200
# (benchmarks/results/launches.json, the four MoE presets' router shapes) the fusion saved 0.4-0.9 us
# per layer at 1 row and 0.1-0.5 us at 2, and cost up to 2.0 us at 4 rows and 2.1-6.2 us at 8.
ADD_NORM_MAX_ROWS = 2
TILE_ELEMS = 64 * 32 * 4  # products per K step of one program: 64 per thread at 4 warps
# The top-k tail ranks every expert against every other in one [E, E] comparison (below) for a single
# row of up to this many experts (128 x 128 compares: 128 per thread at 4 warps); more rows or experts
# take kernels/moe_routing.py's rounds of argmax.
RANK_TOPK_MAX_EXPERTS = 128


@triton.jit
def _rank_topk_store(
    logits_ptr, weights_ptr, ids_ptr, E: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Softmax top-k of one row of fp32 logits by ranks: expert i goes to slot rank(i) when rank(i) < k.

    rank(i) counts the experts with a larger probability, and the equal ones of lower index (the first
    index wins a tie, as torch.topk does on CPU and the argmax rounds do). Four block reductions (max,
    sum, ranks, the chosen sum) in place of one per slot: at batch 1 this tail runs alone, after the
    other programs are done, and each reduction is a shared-memory exchange across the warps."""
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    # .cg: from L2, where the other programs' stores are, never from a stale L1 line
    logits = tl.load(logits_ptr + cols, mask=valid, other=float("-inf"), cache_modifier=".cg")
    p = tl.exp(logits - tl.max(logits, 0))
    p = tl.where(valid, p / tl.sum(p, 0), -1.0)  # padded experts rank after every real one
    ahead = (p[None, :] > p[:, None]) | ((p[None, :] == p[:, None]) & (cols[None, :] < cols[:, None]))
    rank = tl.sum(ahead.to(tl.int32), 1)
    chosen = rank < TOP_K
    if RENORMALIZE:
        p = p / tl.sum(tl.where(chosen, p, 0.0), 0)
    tl.store(weights_ptr + rank, p, mask=chosen)
    tl.store(ids_ptr + rank, cols, mask=chosen)


@triton.jit
def _rows_tile(ptr, stride, rows, row_mask, cols, H: tl.constexpr, EVEN_H: tl.constexpr):
    """[BLOCK_T, BLOCK_H] activations of ``rows`` at ``cols`` (rows past T and columns past H read 0)."""
    mask = row_mask[:, None]
    if not EVEN_H:
        mask = mask & (cols < H)[None, :]
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _add_norm_tile(
    x_ptr, res_ptr, norm_w_ptr, normed_ptr, res_out_ptr, stride_xt, stride_rt, rows, row_mask, cols, rstd, own,
    H: tl.constexpr, EVEN_H: tl.constexpr,
):  # fmt: skip
    """rms_norm(x + residual) of one column tile, rounded where kernels/norm.py rounds; the columns this program
    owns (``own``) are written out as the normed hidden and the new residual."""
    dtype = x_ptr.dtype.element_ty
    summed = (_rows_tile(x_ptr, stride_xt, rows, row_mask, cols, H, EVEN_H).to(tl.float32)
              + _rows_tile(res_ptr, stride_rt, rows, row_mask, cols, H, EVEN_H).to(tl.float32)).to(dtype)  # fmt: skip
    if EVEN_H:
        nw = tl.load(norm_w_ptr + cols).to(tl.float32)
    else:
        nw = tl.load(norm_w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    normed = ((summed.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32) * nw[None, :]).to(dtype)
    out_mask = row_mask[:, None] & (own & (cols < H))[None, :]
    tl.store(normed_ptr + rows[:, None] * H + cols[None, :], normed, mask=out_mask)
    tl.store(res_out_ptr + rows[:, None] * H + cols[None, :], summed, mask=out_mask)
    return normed


@triton.jit(do_not_specialize=["T"])  # batch-sized ints: see engine/warmup.py
def moe_gate_softmax_topk_kernel(
    x_ptr, res_ptr, norm_w_ptr, normed_ptr, res_out_ptr, gate_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr,
    T, stride_xt, stride_rt, stride_ge, eps,
    E: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_EP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_H: tl.constexpr, ONE_TILE: tl.constexpr, W_IN_LOOP: tl.constexpr,
    RANK_TOPK: tl.constexpr, SELECT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    pid = tl.program_id(0)
    experts = pid * BLOCK_EP + tl.arange(0, BLOCK_EP)
    # experts past E re-read expert E-1 so the weight loads need no row mask; never stored
    g_rows = tl.minimum(experts, E - 1).to(tl.int64)
    rows = tl.arange(0, BLOCK_T)
    row_mask = rows < T
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_T, BLOCK_EP), dtype=tl.float32)
    if NORM:
        # every program needs the whole normed row for its experts' dot products, so each normalises it;
        # the stores of the normed hidden and the new residual are spread over the programs by column
        span = tl.cdiv(H, tl.num_programs(0))
        if ONE_TILE:
            # one tile: the gate rows load with the activations, nothing waits for the sum of squares
            w = tl.load(gate_ptr + g_rows[:, None] * stride_ge + offs_h[None, :], mask=(offs_h < H)[None, :],
                        other=0.0)  # fmt: skip
            summed = (_rows_tile(x_ptr, stride_xt, rows, row_mask, offs_h, H, EVEN_H).to(tl.float32)
                      + _rows_tile(res_ptr, stride_rt, rows, row_mask, offs_h, H, EVEN_H).to(tl.float32))  # fmt: skip
            sf = summed.to(x_ptr.dtype.element_ty).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, 1) / H + eps)
        else:
            sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + offs_h
                summed = (_rows_tile(x_ptr, stride_xt, rows, row_mask, cols, H, EVEN_H).to(tl.float32)
                          + _rows_tile(res_ptr, stride_rt, rows, row_mask, cols, H, EVEN_H).to(tl.float32))  # fmt: skip
                sf = summed.to(x_ptr.dtype.element_ty).to(tl.float32)
                sumsq += tl.sum(sf * sf, 1)
            rstd = 1.0 / tl.sqrt(sumsq / H + eps)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + offs_h
        if W_IN_LOOP:  # else loaded above, with the activations of the one tile
            if EVEN_H:
                w = tl.load(gate_ptr + g_rows[:, None] * stride_ge + cols[None, :])
            else:
                w = tl.load(gate_ptr + g_rows[:, None] * stride_ge + cols[None, :], mask=(cols < H)[None, :],
                            other=0.0)  # fmt: skip
        if NORM:
            own = (cols >= pid * span) & (cols < (pid + 1) * span)
            x = _add_norm_tile(x_ptr, res_ptr, norm_w_ptr, normed_ptr, res_out_ptr, stride_xt, stride_rt, rows,
                               row_mask, cols, rstd, own, H, EVEN_H)  # fmt: skip
        else:
            x = _rows_tile(x_ptr, stride_xt, rows, row_mask, cols, H, EVEN_H)
        acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
    # rounded where the separate gate projection would write its output
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    out_mask = row_mask[:, None] & (experts < E)[None, :]
    tl.store(logits_ptr + rows[:, None] * E + experts[None, :], logits, mask=out_mask)
    tl.debug_barrier()  # every thread's logits are written before the block counts itself done
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        if RANK_TOPK:  # one row
            _rank_topk_store(logits_ptr, weights_ptr, ids_ptr, E, TOP_K, RENORMALIZE, BLOCK_E)
        else:
            cols = tl.arange(0, BLOCK_E)
            mask = row_mask[:, None] & (cols[None, :] < E)
            # .cg: from L2, where the other programs' stores are, never from a stale L1 line
            all_logits = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=mask, other=float("-inf"),
                                 cache_modifier=".cg")  # fmt: skip
            _softmax_topk_store(all_logits, rows, row_mask, cols, weights_ptr, ids_ptr,
                                E, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_K, SELECT)  # fmt: skip
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


def gate_fusable(x: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    """Whether ``moe_gate_softmax_topk`` takes this call: decode-sized rows of matching dtype, 16-bit past
    ``MAX_ROWS`` rows (the caller has chosen the kernel path)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= (DOT_MAX_ROWS if x.dtype in DOT_DTYPES else MAX_ROWS)
        and x.dtype == gate_weight.dtype
        and gate_weight.dim() == 2
        and gate_weight.shape[1] == x.shape[1]
        and 0 < gate_weight.shape[0] <= MAX_EXPERTS
        and gate_weight.stride(1) == 1
        and not (torch.is_grad_enabled() and (x.requires_grad or gate_weight.requires_grad))
    )


def experts_per_program(num_experts: int) -> int:
    """Gate rows per program: about 64 programs at 128 experts and more, one row each below that."""
    return max(1, min(triton.next_power_of_2(num_experts) // 64, 8))


def moe_gate_softmax_topk(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool, counter: torch.Tensor,
    *, block_ep: int | None = None, rank_topk: bool | None = None, prefetch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """softmax top-k of ``x @ gate_weight.T`` (rounded to x's dtype): (weights fp32 [T, k], ids int32 [T, k]).

    ``counter`` is int32 [kernels/moe_gate_dot.GATE_COUNTERS] (or [1] up to MAX_ROWS rows) on x's device, zero before the first
    call; the kernel leaves it zero. One launch; x [T, H] with T <= MAX_ROWS, or 16-bit x with
    T <= DOT_MAX_ROWS (``moe_gate_dot_softmax_topk``). ``block_ep`` (gate rows per program, a power of two,
    at least 16 past MAX_ROWS) and ``rank_topk`` (the ranking tail, one row only) override the shape's choice
    (tests, benchmarks). ``prefetch``: the experts' weight the tensor-core launch asks L2 for (kernels/l2_prefetch.py);
    up to MAX_ROWS rows too few experts are touched for that to pay, and the FMA launch asks for nothing.
    """
    if x.dim() == 2 and x.shape[0] > MAX_ROWS:
        if rank_topk:
            raise ValueError(f"rank_topk takes 1 row of at most {RANK_TOPK_MAX_EXPERTS} experts, got T={x.shape[0]}")
        return moe_gate_dot_softmax_topk(x, gate_weight, top_k, renormalize, counter, block_ep=block_ep,
                                         prefetch=prefetch)
    weights, ids, _, _ = _launch(x, gate_weight, top_k, renormalize, counter, None, block_ep, rank_topk)
    return weights, ids


def moe_add_norm_gate_softmax_topk(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counter: torch.Tensor,
    *,
    block_ep: int | None = None,
    rank_topk: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The post-attention residual add and RMSNorm, the router gate and softmax top-k in one launch.

    Returns (weights fp32 [T, k], ids int32 [T, k], rms_norm(x + residual) [T, H], x + residual [T, H]):
    the routing, the experts' input and the next residual, as ``kernels/norm.fused_add_rms_norm`` and
    ``moe_gate_softmax_topk`` would give them in two launches. Both [T, H] outputs are new tensors: the
    programs read ``residual`` whole while others write, so it cannot be updated in place.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)}")
    if norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"norm weight shape {tuple(norm_weight.shape)} does not match hidden size {x.shape[-1]}")
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    norm = (residual, norm_weight.contiguous(), float(eps))
    return _launch(x, gate_weight, top_k, renormalize, counter, norm, block_ep, rank_topk)


def _launch(x, gate_weight, top_k, renormalize, counter, norm, block_ep=None, rank_topk=None):
    t, h, e = checked_gate_args(x, gate_weight, top_k, MAX_ROWS)
    check_counter(counter, 1, x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    if norm is None:
        residual, norm_weight, eps = x, x, 0.0  # unused by the kernel
        normed = summed = None
        out_a = out_b = x
    else:
        residual, norm_weight, eps = norm
        normed = torch.empty(t, h, dtype=x.dtype, device=x.device)  # rows H apart, as the kernel writes them
        summed = torch.empty(t, h, dtype=x.dtype, device=x.device)
        out_a, out_b = normed, summed
    block_t, block_e = triton.next_power_of_2(t), triton.next_power_of_2(e)
    if block_ep is None:
        block_ep = experts_per_program(e)
    elif block_ep <= 0 or block_ep & (block_ep - 1):
        raise ValueError(f"block_ep={block_ep} must be a power of two >= 1")
    rank_ok = t == 1 and block_e <= RANK_TOPK_MAX_EXPERTS
    if rank_topk is None:
        # measured on the H200 at qwen3-30b-a3b's router (results/decode_latency.json): the ranking tail
        # is the faster one for the plain gate (5.15 against 5.22-5.35 us), the argmax rounds once the
        # add + norm share the launch (5.74-5.97 against 6.23 us)
        rank_topk = rank_ok and norm is None
    elif rank_topk and not rank_ok:
        raise ValueError(f"rank_topk takes 1 row of at most {RANK_TOPK_MAX_EXPERTS} experts, got T={t}, E={e}")
    block_h = max(64, min(triton.next_power_of_2(h), TILE_ELEMS // (block_t * block_ep)))
    moe_gate_softmax_topk_kernel[(triton.cdiv(e, block_ep),)](
        x, residual, norm_weight, out_a, out_b, gate_weight, logits, counter, weights, ids,
        t, x.stride(0), residual.stride(0), gate_weight.stride(0), eps,
        E=e, H=h, TOP_K=top_k, RENORMALIZE=renormalize, NORM=norm is not None,
        BLOCK_T=block_t, BLOCK_EP=block_ep, BLOCK_H=block_h,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        EVEN_H=h % block_h == 0, ONE_TILE=h <= block_h, W_IN_LOOP=norm is None or h > block_h,
        RANK_TOPK=rank_topk, SELECT=0, num_warps=4, **pdl_args(x.device, "moe_gate_softmax_topk_kernel"),
    )  # fmt: skip
    return weights, ids, normed, summed


def moe_add_norm_gate_reference(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor,
    top_k: int, renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The unfused chain: residual add + RMSNorm, the gate projection rounded to x's dtype, softmax top-k."""
    normed, summed = fused_add_rms_norm_reference(x, residual, norm_weight, eps)
    weights, ids = softmax_topk_reference(torch.nn.functional.linear(normed, gate_weight), top_k, renormalize)
    return weights, ids, normed, summed
