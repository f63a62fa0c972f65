"""Multi-head latent attention over a paged latent cache, in plain PyTorch.

The cache of one layer is ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``: per
token the RMS-normed compressed KV (the "latent", ``c``) followed by the rotated rope key. With
``W_UK [H, nope, r]`` and ``W_UV [H, v, r]`` the per-head slices of ``kv_b_proj``:

- expanded form: ``k_h = [W_UK_h c, k_rope]``, ``v_h = W_UV_h c``, then ordinary attention;
- absorbed form: ``q_h · k_h = (W_UK_h^T q_nope_h) · c + q_rope_h · k_rope``, so with
  ``q_lat_h = W_UK_h^T q_nope_h`` every head attends over the one shared 576-wide cache row and its
  output ``o_lat_h = Σ p c`` goes back through ``W_UV_h``.

The CPU backend uses the expanded form for prefill/extend (the reference: what transformers
computes) and the absorbed form for decode (a few batched ops per step); the absorbed functions
here are also the references of the Triton kernels (kernels/mla_attention.py).

An fp8 cache (``--kv-cache-dtype fp8_e4m3``, layers/kv_layout.py) is written saturating at +-448 and
read widened; its rows move as bytes, since ``index_copy_`` and indexing have no kernel for every fp8
dtype on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``cache[blocks]`` in the cache's dtype, an fp8 cache gathered as bytes."""
    if cache.dtype.itemsize == 1:
        return cache.view(torch.uint8)[blocks].view(cache.dtype)
    return cache[blocks]


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cache rows of one sequence, ``[length, r + d]``."""
    page = cache.shape[1]
    blocks = block_table[: (length + page - 1) // page].long()
    return gather_blocks(cache, blocks).reshape(-1, cache.shape[-1])[:length]


def expanded_attention(
    q: torch.Tensor, cache: torch.Tensor, w_kv_b: torch.Tensor, block_tables: torch.Tensor,
    query_lens: list[int], seq_lens: list[int], nope: int, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of ``q [T, H, nope + rope]`` (rope part rotated) with K/V expanded from the cache.

    ``w_kv_b`` ``[H, nope + v, r]``. Sequence i's new tokens are the last ``query_lens[i]`` of its
    ``seq_lens[i]`` cached positions. Returns ``[T, H, v]`` in q's dtype (math in float32).
    """
    num_heads, rank = w_kv_b.shape[0], w_kv_b.shape[2]
    v_dim = w_kv_b.shape[1] - nope
    out = q.new_zeros(q.shape[0], num_heads, v_dim)
    start = 0
    for i, (qlen, ctx) in enumerate(zip(query_lens, seq_lens)):
        if qlen == 0:
            continue
        rows = gather_context(cache, block_tables[i], ctx).float()
        latent, k_rope = rows[:, :rank], rows[:, rank:]
        kv = torch.einsum("lr,hcr->hlc", latent, w_kv_b.float())  # [H, ctx, nope + v]
        k = torch.cat((kv[..., :nope], k_rope[None].expand(num_heads, -1, -1)), dim=-1)
        v = kv[..., nope:]
        qi = q[start : start + qlen].float().transpose(0, 1)  # [H, qlen, nope + rope]
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - qlen, ctx)[:, None]
        o = F.scaled_dot_product_attention(qi[None], k[None], v[None], attn_mask=mask.to(q.device), scale=scale)
        out[start : start + qlen] = o[0].transpose(0, 1).to(q.dtype)
        start += qlen
    return out


def absorbed_attention_reference(
    q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
    query_lens: list[int], seq_lens: list[int], scale: float,
) -> torch.Tensor:  # fmt: skip
    """Causal attention in latent space: ``q_lat [T, H, r]``, ``q_rope [T, H, d]`` -> ``o_lat [T, H, r]``.

    Scores ``q_lat · c + q_rope · k_rope``; values are the latents ``c``. Float32 math, q_lat's dtype out.
    """
    rank = q_lat.shape[-1]
    out = torch.zeros_like(q_lat)
    start = 0
    for i, (qlen, ctx) in enumerate(zip(query_lens, seq_lens)):
        if qlen == 0:
            continue
        rows = gather_context(cache, block_tables[i], ctx).float()
        latent, k_rope = rows[:, :rank], rows[:, rank:]
        ql, qr = q_lat[start : start + qlen].float(), q_rope[start : start + qlen].float()
        scores = (torch.einsum("thr,lr->thl", ql, latent) + torch.einsum("thd,ld->thl", qr, k_rope)) * scale
        visible = torch.arange(ctx, device=q_lat.device)[None, :] <= torch.arange(ctx - qlen, ctx, device=q_lat.device)[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[start : start + qlen] = torch.einsum("thl,lr->thr", scores.softmax(-1), latent).to(q_lat.dtype)
        start += qlen
    return out


def absorbed_decode_batched(
    q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Decode (one query token per sequence) in latent space for the whole batch at once (float32).

    Each row gathers its whole block table (padding entries point at the dummy block) and masks
    positions at or past its length: a few batched ops per step instead of a loop over sequences.
    """
    rank = q_lat.shape[-1]
    rows = gather_blocks(cache, block_tables.long()).flatten(1, 3).float()  # [B, L, r + d]
    latent, k_rope = rows[..., :rank], rows[..., rank:]
    visible = torch.arange(rows.shape[1], device=q_lat.device)[None, :] < seq_lens.to(q_lat.device)[:, None]
    scores = torch.einsum("bhr,blr->bhl", q_lat.float(), latent) + torch.einsum("bhd,bld->bhl", q_rope.float(), k_rope)
    scores = (scores * scale).masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("bhl,blr->bhr", scores.softmax(-1), latent).to(q_lat.dtype)
