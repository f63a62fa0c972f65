"""MLA prefill/extend in the expanded form on the GPU, and the split of a step's sequences between it
and the absorbed decode kernel.

A chunk of ``n`` new tokens on a context of ``L`` cached positions: ``kv_b_proj`` up-projects the
``L`` latents to per-head keys and values (``[H, L, nope + v]``), the shared rope key is appended to
every head's keys, and SDPA runs causal attention aligned to the end of the context. Its cost is one
GEMM over the context plus a standard attention, both on tensor cores at full size; the absorbed
kernel instead re-reads the 576-wide latent rows for every two query tokens at 1088 MACs per score.
On the H200 (benchmarks/results/mla.json at 1343f04, one chunk on a 4096-token prefix, bf16, this
module's own function against the absorbed kernel plus its absorption matmuls) the expanded form took
0.73 / 0.87 / 1.76 / 6.11 ms at chunks of 16 / 64 / 512 / 2048 tokens with 16 heads, against
0.91 / 0.90 / 1.78 / 7.45 ms absorbed, and 10.3 against 12.2 ms at 512 tokens with V3's 128 heads:
faster at every chunk size measured, by 1.02-1.25x. An earlier run of a bare expanded reference (no
head grouping, one SDPA call) took 0.46 ms at 64 tokens and 0.39 ms at 512: the grouping and copies
here cost more than the form saves at small chunks, which is where this path has room.

Single-token rows of a mixed step (a decode beside a prefill) stay absorbed: for them the
up-projection of the whole context would cost ``L x r x H x (nope + v)`` MACs for one query, so they
go, gathered into one batch, through the split-KV decode kernel.

The up-projected K/V are a transient of ``L x H x (2 nope + rope + v)`` elements per sequence;
heads are processed in groups so it stays under ``WORKSPACE_BYTES`` (V3's 128 heads at 16k context
would otherwise take 1.4 GB in bf16).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from graphserve.kernels.mla_attention import mla_attention
from graphserve.layers.mla_reference import gather_context

if TYPE_CHECKING:
    from graphserve.kernels.mla_config import MLATile
    from graphserve.layers.mla_types import LatentAttentionLayer

WORKSPACE_BYTES = 256 << 20


def context_rows(cache: torch.Tensor, block_row: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``length`` cache rows of one sequence as ``[length, r + d]`` in ``dtype`` (fp8 widened)."""
    return gather_context(cache, block_row, length).to(dtype)


def heads_per_pass(num_heads: int, context: int, nope: int, qk_dim: int, v_dim: int, itemsize: int) -> int:
    """How many heads' K/V fit the workspace at once (at least one)."""
    per_head = context * (nope + v_dim + qk_dim) * itemsize  # kv_b_proj's output, then the keys
    return max(1, min(num_heads, WORKSPACE_BYTES // max(per_head, 1)))


def expanded_extend(
    q: torch.Tensor, cache: torch.Tensor, w_kv_b: torch.Tensor, block_tables: torch.Tensor,
    query_lens: list[int], seq_lens: list[int], nope: int, scale: float, out: torch.Tensor, min_query_len: int = 1,
) -> None:  # fmt: skip
    """Causal attention of ``q [T, H, nope + rope]`` (rope part rotated) into ``out [T, H, v]``, K/V
    expanded from the cache through ``w_kv_b [H, nope + v, r]``, in q's dtype. Sequence i's new tokens
    are the last ``query_lens[i]`` of its ``seq_lens[i]`` positions; the rows of sequences with fewer
    than ``min_query_len`` new tokens are left as they are."""
    num_heads, rank = w_kv_b.shape[0], w_kv_b.shape[2]
    v_dim = w_kv_b.shape[1] - nope
    start = 0
    for i, (qlen, ctx) in enumerate(zip(query_lens, seq_lens)):
        if qlen < max(min_query_len, 1):
            start += qlen
            continue
        rows = context_rows(cache, block_tables[i], ctx, q.dtype)
        latent, k_rope = rows[:, :rank], rows[:, rank:]
        # a prefill with no prefix is plain causal (SDPA's flash path); a chunk on a prefix sees every
        # cached position and the causal part of its own tokens
        mask = None
        if qlen != ctx:
            mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
        group = heads_per_pass(num_heads, ctx, nope, q.shape[-1], v_dim, q.element_size())
        for h0 in range(0, num_heads, group):
            h1 = min(h0 + group, num_heads)
            kv = torch.matmul(latent, w_kv_b[h0:h1].transpose(1, 2))  # [g, ctx, nope + v]
            k = torch.cat((kv[..., :nope], k_rope.expand(h1 - h0, -1, -1)), dim=-1)
            qi = q[start : start + qlen, h0:h1].transpose(0, 1)
            o = F.scaled_dot_product_attention(qi, k, kv[..., nope:], attn_mask=mask, is_causal=mask is None,
                                               scale=scale)  # fmt: skip
            out[start : start + qlen, h0:h1] = o.transpose(0, 1)
        start += qlen


def absorbed_rows(layer: LatentAttentionLayer, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, seqs: list[int], tokens: list[int], out: torch.Tensor,
                  tile: MLATile | None) -> None:  # fmt: skip
    """The single-token rows ``tokens`` (of sequences ``seqs``) through the absorbed decode kernel, into ``out``."""
    device = q.device
    tok = torch.tensor(tokens, device=device)
    seq = torch.tensor(seqs, device=device)
    rows = q[tok]  # [S, H, nope + rope], contiguous
    q_lat = layer.absorb_query(rows[..., : layer.nope])  # [H, S, r]
    o_lat = torch.empty_like(q_lat)
    qsl = torch.arange(len(tokens) + 1, dtype=torch.int32, device=device)
    mla_attention(q_lat.transpose(0, 1), rows[..., layer.nope :], cache, block_tables[seq], seq_lens[seq], qsl,
                  layer.scale, max_query_len=1, out=o_lat.transpose(0, 1), tile=tile)  # fmt: skip
    out[tok] = layer.unabsorb_output(o_lat)
