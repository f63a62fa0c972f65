"""PyTorch references for DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): the indexer and sparse MLA.

A layer with an indexer scores every earlier position of its sequence with a small multi-head "lightning"
indexer, keeps the ``k`` best positions per query token, and runs MLA (absorbed form) over those latent
rows only. kernels/dsa.py holds the Triton kernels with the same signatures; tests compare the two.

Caches are paged as the engine's latent cache is: a token's slot is ``block_id * block_size + offset``
and block 0 is the dummy block that padding rows read and write.

- latent cache: ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`` (model dtype or fp8 e4m3,
  scale 1.0, as layers/kv_layout.py stores MLA latents);
- index key cache: ``[num_blocks, block_size, D]`` in the model dtype, or the FP8 form
  ``[num_blocks, block_size, D + 4]`` uint8: D e4m3 bytes, then the token's fp32 scale (amax / 448) as
  4 bytes. A cache's dtype (uint8 or not) says which form it is; ``index_cache_shape`` makes either.

Rows (T = tokens of the step, in sequence order) carry their sequence and absolute position
(``token_rows``); rows past the real tokens, which CUDA-graph padding adds, point at the last sequence
and position 0, so whatever they read exists and their outputs are finite and ignored.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 4  # the FP8 form's per-token fp32 scale
# the scale's floor, as kernels/fp8_quant.py has it: an all-zero key quantizes to zeros, never 0/0
MIN_SCALE = 1e-12


def index_cache_shape(
    num_blocks: int, block_size: int, head_dim: int, fp8: bool
) -> tuple[tuple[int, ...], torch.dtype | None]:
    """The index key cache's shape, and its dtype for the FP8 form (``None``: the model dtype)."""
    if fp8:
        return (num_blocks, block_size, head_dim + SCALE_BYTES), torch.uint8
    return (num_blocks, block_size, head_dim), None


def is_fp8_index_cache(index_cache: torch.Tensor) -> bool:
    return index_cache.dtype == torch.uint8


def index_head_dim(index_cache: torch.Tensor) -> int:
    return index_cache.shape[-1] - (SCALE_BYTES if is_fp8_index_cache(index_cache) else 0)


def quantize_index_keys(k: torch.Tensor) -> torch.Tensor:
    """``k [T, D]`` -> ``[T, D + 4]`` uint8 rows of the FP8 form: e4m3 of ``k / scale``, then the fp32 scale."""
    kf = k.float()
    scale = (kf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (kf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_index_rows(rows: torch.Tensor) -> torch.Tensor:
    """FP8-form rows ``[..., D + 4]`` uint8 -> fp32 keys ``[..., D]``."""
    d = rows.shape[-1] - SCALE_BYTES
    vals = rows[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[..., d:].contiguous().view(torch.float32)
    return vals * scale


def token_rows(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's sequence and absolute position (``seq_lens[b] - qlen_b + j``), on the device, no host sync.

    Rows at or past ``query_start_loc[B]`` (padding) get the last sequence and position 0.
    """
    device = query_start_loc.device
    num_seqs = seq_lens.shape[0]
    qsl = query_start_loc.long()
    t = torch.arange(num_tokens, device=device)
    seq = torch.searchsorted(qsl[1:].contiguous(), t, right=True).clamp_(max=num_seqs - 1)
    qlen = qsl[seq + 1] - qsl[seq]
    pos = seq_lens.long()[seq] - qlen + (t - qsl[seq])
    pad = t >= qsl[num_seqs]
    seq = torch.where(pad, num_seqs - 1, seq)
    pos = torch.where(pad, 0, pos).clamp_(min=0)
    return seq.to(torch.int32), pos.to(torch.int32)


def write_index_cache(k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k [T, D]`` at ``slot_mapping`` (quantized for the FP8 form)."""
    flat = index_cache.view(-1, index_cache.shape[-1])
    rows = quantize_index_keys(k) if is_fp8_index_cache(index_cache) else k.to(index_cache.dtype)
    flat[slot_mapping.long()] = rows


def _slots(block_tables: torch.Tensor, row_seq: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of positions ``pos [T, N]`` (any value; those past the block table map to the dummy block)."""
    pos = pos.long().clamp(min=0)
    col = pos // block_size
    inside = col < block_tables.shape[1]
    blocks = block_tables.long()[row_seq.long()[:, None], col.clamp(max=block_tables.shape[1] - 1)]
    return torch.where(inside, blocks, 0) * block_size + pos % block_size


def read_index_keys(index_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """fp32 keys at ``slots`` (any shape) -> ``[*slots.shape, D]``."""
    rows = index_cache.view(-1, index_cache.shape[-1])[slots.long()]
    return dequantize_index_rows(rows) if is_fp8_index_cache(index_cache) else rows.float()


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_tables: torch.Tensor,
    row_seq: torch.Tensor, row_pos: torch.Tensor, max_len: int,
) -> torch.Tensor:  # fmt: skip
    """``score[t, j] = sum_h weights[t, h] * relu(q[t, h] . k_j)`` for ``j <= row_pos[t]``, else -inf.

    ``q [T, Hi, D]``, ``weights [T, Hi]`` fp32 with every scale folded in; ``[T, max_len]`` fp32 out.
    """
    block_size = index_cache.shape[1]
    pos = torch.arange(max_len, device=q.device)
    keys = read_index_keys(index_cache, _slots(block_tables, row_seq, pos.expand(q.shape[0], -1), block_size))
    dots = torch.einsum("thd,tjd->thj", q.float(), keys).relu_()
    scores = torch.einsum("th,thj->tj", weights.float(), dots)
    return scores.masked_fill(pos[None, :] > row_pos.long()[:, None], float("-inf"))


def topk_indices(scores: torch.Tensor, row_pos: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of the ``k`` largest scores among ``0..row_pos[t]``; ties go to the lower position;
    ``-1`` fills the slots left when a row has fewer than ``k`` positions. ``[T, k]`` int32."""
    t, length = scores.shape
    pos = torch.arange(length, device=scores.device)
    valid = pos[None, :] <= row_pos.long()[:, None]
    keyed = scores.float().masked_fill(~valid, float("-inf"))
    # a stable sort keeps equal scores in position order, so the lower position is taken first
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices[:, :k]
    picked = torch.where(torch.gather(valid, 1, order), order, -1)
    out = torch.full((t, k), -1, dtype=torch.int32, device=scores.device)
    out[:, : picked.shape[1]] = picked.to(torch.int32)
    return out


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_tables: torch.Tensor,
    row_seq: torch.Tensor, row_pos: torch.Tensor, max_len: int, k: int,
) -> torch.Tensor:  # fmt: skip
    """``topk_indices(indexer_scores(...), row_pos, k)``."""
    return topk_indices(indexer_scores(q, weights, index_cache, block_tables, row_seq, row_pos, max_len), row_pos, k)


def sparse_mla(
    q_lat: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
    row_seq: torch.Tensor, idx: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Absorbed-form MLA of each row over its selected positions ``idx [T, K]`` only (``-1`` skipped).

    ``q_lat [T, H, r]``, ``q_rope [T, H, dr]``; logits ``scale * (q_lat . c_j + q_rope . k_rope_j)``,
    softmax over the selected set, output ``sum_j p_j c_j`` in q_lat's dtype (fp32 math). A row with
    nothing selected gives zeros.
    """
    rank = q_lat.shape[-1]
    block_size = latent_cache.shape[1]
    selected = idx >= 0
    rows = latent_cache.view(-1, latent_cache.shape[-1])[_slots(block_tables, row_seq, idx, block_size)].float()
    # an unselected entry reads the dummy block, whose bytes may be anything: zero them so 0 * NaN cannot leak
    rows = rows.masked_fill(~selected[..., None], 0.0)
    latent, k_rope = rows[..., :rank], rows[..., rank:]
    logits = torch.einsum("thr,tkr->thk", q_lat.float(), latent) + torch.einsum("thd,tkd->thk", q_rope.float(), k_rope)
    logits = (logits * scale).masked_fill(~selected[:, None, :], float("-inf"))
    probs = torch.nan_to_num(logits.softmax(-1), nan=0.0)
    return torch.einsum("thk,tkr->thr", probs, latent).to(q_lat.dtype)
