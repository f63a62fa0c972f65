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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.moe_routing import MAX_EXPERTS, _softmax_topk_store

MAX_ROWS = 8  # beyond this the gate's weight reuse favours a real matmul (and one program's x tile grows)
TILE_ELEMS = 64 * 32 * 4  # products per K step of one program: 64 per thread at 4 warps


@triton.jit
def moe_gate_softmax_topk_kernel(
    x_ptr, gate_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr, T, stride_xt, stride_ge,
    E: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_EP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    experts = tl.program_id(0) * BLOCK_EP + tl.arange(0, BLOCK_EP)
    # experts past E re-read expert E-1 so the weight loads need no row mask; never stored
    g_rows = tl.minimum(experts, E - 1).to(tl.int64)
    rows = tl.arange(0, BLOCK_T)
    row_mask = rows < T
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_T, BLOCK_EP), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + offs_h
        if H % BLOCK_H == 0:
            w = tl.load(gate_ptr + g_rows[:, None] * stride_ge + cols[None, :])
            x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :], mask=row_mask[:, None], other=0.0)
        else:
            h_mask = cols < H
            w = tl.load(gate_ptr + g_rows[:, None] * stride_ge + cols[None, :], mask=h_mask[None, :], other=0.0)
            x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :], mask=row_mask[:, None] & h_mask[None, :],
                        other=0.0)  # fmt: skip
        acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
    # rounded where the separate gate projection would write its output
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    out_mask = row_mask[:, None] & (experts < E)[None, :]
    tl.store(logits_ptr + rows[:, None] * E + experts[None, :], logits, mask=out_mask)
    tl.debug_barrier()  # every thread's logits are written before the block counts itself done
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        cols = tl.arange(0, BLOCK_E)
        mask = row_mask[:, None] & (cols[None, :] < E)
        # .cg: from L2, where the other programs' stores are, never from a stale L1 line
        all_logits = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=mask, other=float("-inf"),
                             cache_modifier=".cg")  # fmt: skip
        _softmax_topk_store(all_logits, rows, row_mask, cols, weights_ptr, ids_ptr,
                            E, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_K)  # fmt: skip
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


def gate_fusable(x: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    """Whether ``moe_gate_softmax_topk`` takes this call: decode-sized rows of matching dtype (the caller
    has chosen the kernel path)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
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
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool, counter: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax top-k of ``x @ gate_weight.T`` (rounded to x's dtype): (weights fp32 [T, k], ids int32 [T, k]).

    ``counter`` is an int32 scalar on x's device, zero before the first call; the kernel leaves it zero.
    One launch; x [T, H] with T <= MAX_ROWS.
    """
    if x.dim() != 2 or gate_weight.dim() != 2 or gate_weight.shape[1] != x.shape[1]:
        raise ValueError(f"need x [T, H] and gate weight [E, H], got {tuple(x.shape)} and {tuple(gate_weight.shape)}")
    t, h = x.shape
    e = gate_weight.shape[0]
    if not 0 < t <= MAX_ROWS:
        raise ValueError(f"fused gate takes 1..{MAX_ROWS} rows, got {t}; use the gate projection and moe_softmax_topk")
    if not 0 < e <= MAX_EXPERTS:
        raise ValueError(f"num_experts={e} must be in 1..{MAX_EXPERTS} for the routing kernel")
    if not 0 < top_k <= e:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={e}")
    if x.dtype != gate_weight.dtype or gate_weight.stride(1) != 1:
        raise ValueError(f"x {x.dtype} and gate weight {gate_weight.dtype} must match, the weight contiguous along H")
    if counter.dtype != torch.int32 or counter.numel() != 1 or counter.device != x.device:
        raise ValueError(f"counter must be one int32 on {x.device}, got {counter.dtype} {tuple(counter.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    block_t, block_ep = triton.next_power_of_2(t), experts_per_program(e)
    block_h = max(64, min(triton.next_power_of_2(h), TILE_ELEMS // (block_t * block_ep)))
    moe_gate_softmax_topk_kernel[(triton.cdiv(e, block_ep),)](
        x, gate_weight, logits, counter, weights, ids, t, x.stride(0), gate_weight.stride(0),
        E=e, H=h, TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_EP=block_ep, BLOCK_H=block_h,
        BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k), num_warps=4,
    )  # fmt: skip
    return weights, ids
