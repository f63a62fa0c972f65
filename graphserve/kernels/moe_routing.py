"""Softmax top-k routing in one launch: fp32 router logits [T, E] -> (weights fp32 [T, k], ids int32 [T, k]).

transformers computes softmax in fp32, takes torch.topk of the probabilities and optionally divides
by their sum; separately that is four or five launches per layer on a decode step. Here each
program takes ``BLOCK_T`` rows whole (E <= a few hundred fits in registers), finds the k largest by
k rounds of argmax (the first index wins a tie, as torch.topk does on CPU) and writes weights and
ids once. Reference: kernels/moe_reference.softmax_topk_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 1024


@triton.jit
def moe_softmax_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, T, stride_t,
    E: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < T
    mask = row_mask[:, None] & (cols[None, :] < E)
    logits = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=float("-inf"))
    logits = logits.to(tl.float32)
    row_max = tl.max(logits, axis=1)
    row_max = tl.where(row_mask, row_max, 0.0)  # rows past T are all -inf: keep them NaN-free
    p = tl.exp(logits - row_max[:, None])
    p = p / tl.where(row_mask, tl.sum(p, axis=1), 1.0)[:, None]
    p = tl.where(mask, p, -1.0)  # padded experts can never be chosen
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for s in tl.static_range(TOP_K):
        best = tl.argmax(p, axis=1, tie_break_left=True)
        best_p = tl.max(p, axis=1)
        top_w = tl.where(slots[None, :] == s, best_p[:, None], top_w)
        top_i = tl.where(slots[None, :] == s, best[:, None].to(tl.int32), top_i)
        p = tl.where(cols[None, :] == best[:, None], -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    offs = rows[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + offs, top_w, mask=out_mask)
    tl.store(ids_ptr + offs, top_i, mask=out_mask)


def moe_softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, *, block_t: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int32 [T, k]) of the k most probable experts of each row."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got {tuple(logits.shape)}")
    t, e = logits.shape
    if not 0 < e <= MAX_EXPERTS:
        raise ValueError(f"num_experts={e} must be in 1..{MAX_EXPERTS} for the routing kernel")
    if not 0 < top_k <= e:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={e}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    # about 4K logits per program: a decode batch is one or a few programs, a prefill chunk spreads
    block_t = block_t or max(1, min(triton.next_power_of_2(t), 4096 // block_e))
    moe_softmax_topk_kernel[(triton.cdiv(t, block_t),)](
        logits, weights, ids, t, logits.stride(0),
        E=e, TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4 if block_e * block_t >= 2048 else 1,
    )  # fmt: skip
    return weights, ids
