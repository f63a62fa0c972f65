"""Paged attention in plain PyTorch: the CPU backend, and the reference the Triton kernels are tested against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from graphserve.layers.attention_backend import AttentionBackend
from graphserve.layers.kv_layout import to_cache_dtype

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch

__all__ = ["AttentionBackend", "TorchAttentionBackend", "batched_decode_attention", "reference_paged_attention",
           "write_kv_cache"]


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [T, Hkv, D]`` at flat slots ``slot_mapping [T]`` of ``kv_cache [2, blocks, block_size, Hkv, D]``."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    k, v = to_cache_dtype(k, flat.dtype), to_cache_dtype(v, flat.dtype)  # fp8: scale 1.0, saturating at +-448
    if flat.dtype.itemsize == 1:  # index_copy_ has no fp8 kernel: move the bytes
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention over a paged KV cache, one sequence at a time, in float32.

    q ``[T, H, D]`` holds the new tokens of each sequence back to back (``query_lens``);
    ``k_cache``/``v_cache`` are ``[num_blocks, block_size, Hkv, D]`` and already contain the new
    tokens' K/V; sequence i's context is its first ``seq_lens[i]`` cache positions, read through
    ``block_tables[i]``. New token j of sequence i sits at position ``seq_lens[i] - query_lens[i] + j``
    and sees positions up to and including its own. Returns ``[T, H, D]`` in q's dtype.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)  # rows past sum(query_lens) are padding and stay zero
    start = 0
    for i, (qlen, ctx) in enumerate(zip(query_lens, seq_lens)):
        if qlen == 0:
            continue
        blocks = block_tables[i, : (ctx + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        # [1, H, len, D]; KV heads repeated so query head h reads KV head h // group.
        qi = q[start : start + qlen].float().transpose(0, 1).unsqueeze(0)
        ki = k.float().repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        vi = v.float().repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        # The new tokens are the last qlen of the context: row j may see keys 0 .. ctx - qlen + j.
        q_pos = torch.arange(ctx - qlen, ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start : start + qlen] = o[0].transpose(0, 1).to(q.dtype)
        start += qlen
    return out


def batched_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query token per sequence, every sequence at once (float32).

    Each row gathers its whole block table (padding entries point at the dummy block) and masks
    positions at or past its length, so a decode step costs a few batched ops instead of a
    Python loop over sequences — on CPU that loop, not the math, dominated decode steps.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    tables = block_tables.long()
    k = k_cache[tables].flatten(1, 2).float()  # [B, L, Hkv, D]
    v = v_cache[tables].flatten(1, 2).float()
    visible = torch.arange(k.shape[1], device=q.device)[None, :] < seq_lens.to(q.device)[:, None]  # [B, L]
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgl,blkd->bkgd", scores.softmax(dim=-1), v)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    """Eager paged attention for CPU runs and as a correctness baseline on GPU."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        kv_cache = batch.kv_caches[layer_idx]
        write_kv_cache(k, v, kv_cache, batch.slot_mapping)
        if batch.mode == "decode":
            return batched_decode_attention(q, kv_cache[0], kv_cache[1], batch.block_tables, batch.seq_lens, scale)
        query_lens = batch.query_lens_cpu or torch.diff(batch.query_start_loc).tolist()
        seq_lens = batch.seq_lens_cpu or batch.seq_lens.tolist()
        return reference_paged_attention(q, kv_cache[0], kv_cache[1], batch.block_tables, query_lens, seq_lens, scale)
