"""Paged attention in plain PyTorch: the CPU backend, and the reference the Triton kernels are tested against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.kernels.paged_kv import to_cache_dtype
from graphserve.layers.attention_backend import AttentionBackend

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch

__all__ = ["Attention", "AttentionBackend", "TorchAttentionBackend", "batched_decode_attention",
           "reference_paged_attention", "softmax_with_sinks", "window_mask", "write_kv_cache"]


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [T, Hkv, D]`` at flat slots ``slot_mapping [T]`` of ``kv_cache [2, blocks, block_size, Hkv, D]``."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    k, v = to_cache_dtype(k, flat.dtype), to_cache_dtype(v, flat.dtype)  # fp8: scale 1.0, saturating at +-448
    if flat.dtype.itemsize == 1:  # index_copy_ has no fp8 kernel: move the bytes
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool [Q, K]: which keys each query sees. Causal, and with a window the query at position p sees
    p - window < j <= p: the window counts the query itself. This is transformers' sliding_window_overlay
    (masking_utils: ``kv_idx > q_idx - sliding_window``), the mask Mistral, Qwen2 and gpt-oss train with."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 ``scores``, each row's sink logit (``sinks``, broadcastable to
    ``scores[..., :1]``) joining the denominator only: p_j = exp(s_j - m) / (exp(sink - m) + sum_i exp(s_i - m)),
    m the max over the scores and the sink. This is gpt-oss (transformers models/gpt_oss eager_attention_forward
    appends the sink as one more column and drops it after the softmax)."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention over a paged KV cache, one sequence at a time, in float32.

    q ``[T, H, D]`` holds the new tokens of each sequence back to back (``query_lens``);
    ``k_cache``/``v_cache`` are ``[num_blocks, block_size, Hkv, D]`` and already contain the new
    tokens' K/V; sequence i's context is its first ``seq_lens[i]`` cache positions, read through
    ``block_tables[i]``. New token j of sequence i sits at position ``seq_lens[i] - query_lens[i] + j``
    and sees positions up to and including its own (the last ``window`` of them with a window; ``sinks [H]``
    join each head's softmax denominator). Returns ``[T, H, D]`` in q's dtype.
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
        mask = window_mask(q_pos, k_pos, window)
        if sinks is None:
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        else:
            scores = (qi @ ki.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
            o = softmax_with_sinks(scores, sinks.view(1, -1, 1, 1)) @ vi
        out[start : start + qlen] = o[0].transpose(0, 1).to(q.dtype)
        start += qlen
    return out


def batched_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence, every sequence at once (float32); ``window`` and ``sinks`` as in
    ``reference_paged_attention``.

    Each row gathers its whole block table (padding entries point at the dummy block) and masks
    positions at or past its length, so a decode step costs a few batched ops instead of a
    Python loop over sequences — on CPU that loop, not the math, dominated decode steps. With a window each row
    gathers only the blocks its window touches, from the first one on, as the Triton kernel reads them (those
    before may have gone back to the pool).
    """
    batch, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    tables = block_tables.long()
    lens = seq_lens.to(q.device).long()[:, None]
    first = torch.zeros_like(lens)  # each row's first gathered position
    if window is not None:
        span = min(tables.shape[1], -(-(window - 1) // page) + 1)  # blocks a window touches at most
        start = ((lens - window).clamp(min=0) // page).clamp(max=tables.shape[1] - span)
        tables = tables.gather(1, start + torch.arange(span, device=q.device))
        first = start * page
    k = k_cache[tables].flatten(1, 2).float()  # [B, L, Hkv, D]
    v = v_cache[tables].flatten(1, 2).float()
    pos = first + torch.arange(k.shape[1], device=q.device)[None, :]
    visible = pos < lens  # [B, L]
    if window is not None:
        visible &= pos >= lens - window
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(1, num_kv_heads, group, 1))
    out = torch.einsum("bkgl,blkd->bkgd", probs, v)
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
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kv_cache = batch.kv_caches[layer_idx]
        write_kv_cache(k, v, kv_cache, batch.slot_mapping)
        if batch.mode == "decode":
            return batched_decode_attention(q, kv_cache[0], kv_cache[1], batch.block_tables, batch.seq_lens, scale,
                                            window, sinks)  # fmt: skip
        query_lens = batch.query_lens_cpu or torch.diff(batch.query_start_loc).tolist()
        seq_lens = batch.seq_lens_cpu or batch.seq_lens.tolist()
        return reference_paged_attention(q, kv_cache[0], kv_cache[1], batch.block_tables, query_lens, seq_lens, scale,
                                         window, sinks)  # fmt: skip


class Attention(nn.Module):
    """One layer's attention over the paged cache as the model declares it, once: its query heads on this rank,
    scale, window and sinks. It hands them to the step's backend (``batch.attn_backend``) on every call.

    ``window``: the query at position p sees keys p - window < j <= p (None: full causal). ``sinks``: whether the
    layer has a learned per-head sink logit (gpt-oss); then ``self.sinks`` is a float32 parameter over this rank's
    heads, loaded from a checkpoint tensor over all ``num_heads * tp_size`` heads (``load_weight`` takes the rank's
    slice).
    """

    def __init__(
        self, layer_idx: int, num_heads: int, scale: float, *, window: int | None = None, sinks: bool = False,
        tp_rank: int = 0, tp_size: int = 1,
    ) -> None:  # fmt: skip
        super().__init__()
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"layer {layer_idx}: sliding_window={window!r}, it must be an integer >= 1 (or None)")
        self.layer_idx, self.num_heads, self.scale, self.window = layer_idx, num_heads, scale, window
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False) if sinks else None

    def load_weight(self, name: str, param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
        if shard is not None:
            raise ValueError(f"Attention takes no shard {shard!r}")
        total = self.num_heads * self.tp_size
        if name != "sinks" or tuple(tensor.shape) != (total,):
            raise ValueError(f"shape {tuple(tensor.shape)}, expected ({total},): one sink logit per attention head")
        param.data.copy_(tensor[self.tp_rank * self.num_heads : (self.tp_rank + 1) * self.num_heads])

    def _apply(self, fn, recurse=True):
        # the model is cast to its dtype as a whole (models/loader.py); the sinks stay float32, as the kernels read
        # them, so no step converts them again
        super()._apply(fn, recurse)
        if self.sinks is not None and self.sinks.dtype != torch.float32 and self.sinks.is_floating_point():
            self.sinks.data = self.sinks.data.float()
        return self

    def _sinks(self) -> torch.Tensor | None:
        return None if self.sinks is None else self.sinks.float()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (rotated): writes K/V into the cache, returns [T, H, D]."""
        return batch.attn_backend.forward(q, k, v, self.layer_idx, batch, self.scale, window=self.window,
                                          sinks=self._sinks())  # fmt: skip

    def attend(self, new, batch: ForwardBatch) -> torch.Tensor:
        """From the qkv projection's output (backends with ``fused_prologue``; kernels/decode_attention.NewToken)."""
        return batch.attn_backend.attend(new, self.layer_idx, batch, self.scale, window=self.window,
                                         sinks=self._sinks())  # fmt: skip

    def attend_quantized(self, new, batch: ForwardBatch, **layout) -> tuple[torch.Tensor, torch.Tensor] | None:
        return batch.attn_backend.attend_quantized(new, self.layer_idx, batch, self.scale, window=self.window,
                                                   sinks=self._sinks(), **layout)  # fmt: skip

    def leaves_room(self, batch: ForwardBatch) -> bool:
        return batch.attn_backend.leaves_room(batch, self.layer_idx)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, heads={self.num_heads}, window={self.window}, sinks={self.sinks is not None}"
