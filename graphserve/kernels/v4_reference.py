"""DeepSeek-V4's compression and attention maths in plain PyTorch: the reference of kernels/v4_compress.py and
kernels/v4_attention.py, and the path the layer (models/deepseek_v4_attention.py) runs on the CPU.

Compression. A compressed layer pools each group of ``m`` consecutive tokens (``m`` = the layer type's
``compress_rates``) into one entry: ``entry_w = rmsnorm(sum_j softmax_j(gate_j + bias_j) * kv_j)``, rotated at
position ``w * m`` by the compressed branches' rope. CSA's kv and gate carry two series per token (``[Ca | Cb]``):
entry ``w`` pools the ``Ca`` halves of group ``w - 1`` with the ``Cb`` halves of group ``w`` (2m slots; group 0 has
no ``Ca`` side), and its lightning indexer pools its own keys the same way at ``index_head_dim``. This is
transformers' ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` / ``DeepseekV4Indexer``.

Cache: one compact page per block and compressed layer (layers/kv_layout.CompactCache), by the block tables like
every other cache. A page starts with the layer's compressor checkpoint: fp32 online-softmax accumulators (per
channel the log-sum-exp of the gate logits folded so far and their softmax-weighted kv, two floats a channel) of
the groups still open after the last token written into the
block; then its entry rows, one per ``m`` tokens of the block (one where a block holds fewer): entry ``w`` (and in
CSA its indexer key) sits in the block holding its group's last token ``(w + 1) * m - 1``, at row ``(that token %
block_size) // m``. Open accumulators: HCA's group ``g`` (``cur``); CSA's ``cur`` (entry ``g``: the ``Ca`` halves of
group ``g - 1`` and the ``Cb`` halves of group ``g`` so far) and ``next`` (entry ``g + 1``: the ``Ca`` halves of group
``g`` so far). A step folds its own tokens' projections (never stored) into the checkpoint of the block holding the
position before its first one, writes the entry of each group one of its tokens closes, and a checkpoint where a
block ends and at its last token. So the state of a sequence is its blocks' checkpoints (a few KB each) rather than
every token's projections, and a block, once full, holds the state at its end: the prefix cache shares it with the
block, and chunked prefill, decode and preemption see one function of the tokens. An entry is written in the step
its group completes, the partial group staying in the checkpoint until then.

Attention. A query at position ``p`` attends, with its head's sink logit in the denominator, over the latents of
positions ``p - window + 1 .. p`` and the entries of the groups it has seen (``(p + 1) // m`` of them): every one
(HCA) or those its indexer chose (CSA, ``sum_h w_h * relu(q_h . key_w)`` top ``index_topk``). Values are the keys.
"""

from __future__ import annotations

import torch


def rope_trailing(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, sign: float = 1.0
                  ) -> torch.Tensor:  # fmt: skip
    """``x [T, ..., D]`` with its last ``2 * len(inv_freq)`` dims rotated as interleaved pairs at ``positions [T]``
    (transformers' V4 ``apply_rotary_pos_emb``); ``sign=-1`` rotates back (the attention output's rope part)."""
    rd = 2 * inv_freq.shape[0]
    freqs = positions.float()[:, None] * inv_freq.to(x.device)[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = freqs.cos().view(shape), (sign * freqs.sin()).view(shape)
    rope = x[..., -rd:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)


def rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers/norm.rms_norm's CPU maths, kept here so the reference stays plain PyTorch on a GPU too."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def pool_groups(kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None, prev_gate: torch.Tensor | None,
                has_prev: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                inv_freq: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One compressed entry per group: ``kv, gate [N, m, W]`` (gate with its position bias added) of the group;
    with overlap (CSA, ``W = 2d``) also the previous group's ``prev_kv, prev_gate [N, m, W]``, used where
    ``has_prev [N]``. Returns ``[N, d]`` normed and rotated at ``positions [N]`` (the groups' first tokens)."""
    if prev_kv is not None:
        d = kv.shape[-1] // 2
        gate_a = prev_gate[..., :d].masked_fill(~has_prev[:, None, None], float("-inf"))
        kv = torch.cat([prev_kv[..., :d] * has_prev[:, None, None], kv[..., d:]], dim=1)
        gate = torch.cat([gate_a, gate[..., d:]], dim=1)
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    return rope_trailing(rms_normed(pooled, norm_weight, eps), positions, inv_freq)


def token_slots(block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int
                ) -> torch.Tensor:  # fmt: skip
    """Flat cache slots of ``positions [N, K]`` (clamped at 0) of the sequences ``rows [N]`` of the block tables."""
    pos = positions.clamp(min=0)
    return block_tables[rows[:, None], pos // block_size].long() * block_size + pos % block_size


class CompressorBranch:
    """One series (the attention's, or CSA's indexer's) of a compressed layer: its ``kv`` and ``gate`` projections
    are ``width`` wide (``series * dim``), its entry sits at ``[entry_at, entry_at + dim)`` of an entry row, its
    accumulators (``cur``, and ``next`` with overlap; each ``[log-sum-exp, weighted mean]`` of ``dim``) at ``ckpt_at``
    of the page's fp32 checkpoint."""

    def __init__(self, width: int, dim: int, overlap: bool, entry_at: int, ckpt_at: int) -> None:
        self.width, self.dim, self.overlap, self.entry_at, self.ckpt_at = width, dim, overlap, entry_at, ckpt_at

    @property
    def ckpt_floats(self) -> int:
        return (2 if self.overlap else 1) * 2 * self.dim


def checkpoints(pages: torch.Tensor, state_floats: int) -> torch.Tensor:
    """``[num_blocks, state_floats]`` fp32: the checkpoint at the head of each page ``pages [num_blocks, page]``."""
    return pages.view(torch.float32)[:, :state_floats]


def entry_rows(pages: torch.Tensor, state_floats: int, entry_width: int) -> torch.Tensor:
    """``[num_blocks, rows, entry_width]``: the entry rows after each page's checkpoint."""
    head = state_floats * 4 // pages.dtype.itemsize
    return pages[:, head:].unflatten(1, (-1, entry_width))


def entry_index(block_tables: torch.Tensor, seqs: torch.Tensor, n: torch.Tensor, rate: int, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(block, row) of entries ``n [N, K]`` (clamped at 0) of the sequences ``seqs [N]``: the block holding the
    group's last token, at row ``(token % block_size) // rate`` (0 where a block holds fewer than ``rate``)."""
    tok = n.long().clamp(min=0) * rate + rate - 1
    return block_tables[seqs.long()[:, None], tok // block_size].long(), (tok % block_size) // rate


def step_starts(positions: torch.Tensor, query_start_loc: torch.Tensor, row_seq: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(each row's sequence's first position in the step, whether the row is its sequence's last, whether it is a
    real row): padding rows past ``query_start_loc[-1]`` are no sequence's."""
    t = positions.shape[0]
    rows = torch.arange(t, device=positions.device)
    seq = row_seq.long()
    first = query_start_loc.long()[seq]
    real = rows < query_start_loc[-1].long()
    return positions.long() - (rows - first), real & (rows + 1 == query_start_loc.long()[seq + 1]), real


def start_checkpoints(ckpt: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
                      query_start_loc: torch.Tensor, block_size: int) -> torch.Tensor:  # fmt: skip
    """``[B, state_floats]`` fp32: each sequence's checkpoint before the step (the page of the block holding the
    position before its first new token). Gathered before the step writes any, so no row reads a checkpoint another
    row of the step is writing. Garbage where the step starts at position 0 (no row reads it then)."""
    b = query_start_loc.shape[0] - 1
    first = query_start_loc[:-1].long().clamp(max=max(positions.shape[0] - 1, 0))
    prev = (positions.long()[first] - 1).clamp(min=0) if positions.shape[0] else first
    blocks = block_tables[torch.arange(b, device=block_tables.device), prev // block_size].long()
    return ckpt[blocks]


def _fold(m: torch.Tensor, total: torch.Tensor, a: torch.Tensor, logits: torch.Tensor, values: torch.Tensor,
          ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Online softmax over tokens, per channel: the accumulators ``[N, d]`` after the tokens ``[N, K, d]`` where
    ``ok [N, K]``."""
    logits = logits.masked_fill(~ok[..., None], float("-inf"))
    new = torch.maximum(m, logits.amax(dim=1))
    safe = torch.where(new == float("-inf"), torch.zeros_like(new), new)
    alpha, p = torch.exp(m - safe), torch.exp(logits - safe[:, None])
    return new, total * alpha + p.sum(dim=1), a * alpha + (p * torch.where(ok[..., None], values, 0.0)).sum(dim=1)


def _stored(m: torch.Tensor, total: torch.Tensor, a: torch.Tensor) -> list[torch.Tensor]:
    """An accumulator as the checkpoint keeps it: (log-sum-exp, weighted mean), (-inf, 0) where empty."""
    some = total > 0
    return [m + torch.log(torch.where(some, total, 1.0)).masked_fill(~some, float("-inf")),
            torch.where(some, a / torch.where(some, total, 1.0), 0.0)]


def compress_groups(pages: torch.Tensor, branch: CompressorBranch, kv: torch.Tensor, gate: torch.Tensor,
                    init: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor,
                    query_start_loc: torch.Tensor, rate: int, bias: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, inv_freq: torch.Tensor, block_size: int, state_floats: int,
                    entry_width: int) -> None:  # fmt: skip
    """Fold the step's projections ``kv, gate [T, width]`` into the open groups, from ``init`` (start_checkpoints),
    write the entry of every group a row closes (``(position + 1) % rate == 0``) and the checkpoint of every block
    a row ends, or the sequence's step does."""
    p = positions.long()
    s0, last, real = step_starts(positions, query_start_loc, row_seq)
    closes = real & ((p + 1) % rate == 0)
    writes = last | (real & (p % block_size == block_size - 1))
    act = (closes | writes).nonzero().flatten()
    if act.numel() == 0:
        return
    p, s0, seq = p[act], s0[act], row_seq.long()[act]
    d, ckpt_at = branch.dim, branch.ckpt_at
    g, big_g, has = p // rate, torch.div(s0 - 1, rate, rounding_mode="floor"), s0 > 0
    span = torch.arange(rate, device=p.device)
    ckpt_in = init.float()[seq]

    def acc(at: int, use: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(max, sum, weighted sum) from a stored (log-sum-exp, weighted mean): max = lse, sum = 1 (0 if empty)."""
        lse, mean = ckpt_in[:, at:at + d], ckpt_in[:, at + d:at + 2 * d]
        use = (use & has)[:, None] & (lse > float("-inf"))
        return (torch.where(use, lse, float("-inf")), use.float().expand_as(lse), torch.where(use, mean, 0.0))

    def tokens(group: torch.Tensor, col: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, values, which count) of group ``group``'s tokens from ``s0`` to ``p``, columns from ``col``."""
        q = group[:, None] * rate + span
        ok = (q >= s0[:, None]) & (q <= p[:, None]) & (q >= 0)
        rows = (act[:, None] - (p[:, None] - q)).clamp(0, kv.shape[0] - 1)
        logits = gate[rows, col:col + d].float() + bias[:, col:col + d].float()
        return logits, kv[rows, col:col + d].float(), ok

    own = d if branch.overlap else 0
    if branch.overlap:
        cur = acc(ckpt_at, g == big_g)
        nxt = acc(ckpt_at + 2 * d, g == big_g + 1)
        cur = tuple(torch.where((g == big_g)[:, None], x, y) for x, y in zip(cur, nxt))
        cur = _fold(*cur, *tokens(g - 1, 0))
        nxt = _fold(*acc(ckpt_at + 2 * d, g == big_g), *tokens(g, 0))
    else:
        cur = acc(ckpt_at, g == big_g)
    cur = _fold(*cur, *tokens(g, own))
    done = closes[act]
    if bool(done.any()):
        _, total, a = (x[done] for x in cur)
        first = (g[done] * rate).long()
        entry = rope_trailing(rms_normed(a / total, norm_weight, eps), first, inv_freq)
        tok = p[done]
        block = block_tables[seq[done], tok // block_size].long()
        rows = entry_rows(pages, state_floats, entry_width)
        rows[block, (tok % block_size) // rate, branch.entry_at:branch.entry_at + d] = entry.to(pages.dtype)
    put = writes[act]
    if bool(put.any()):
        state = torch.cat(_stored(*cur) + (_stored(*nxt) if branch.overlap else []), dim=-1)[put]
        tok = p[put]
        block = block_tables[seq[put], tok // block_size].long()
        ckpt = checkpoints(pages, state_floats)
        ckpt[block, ckpt_at:ckpt_at + branch.ckpt_floats] = state


def entries(pages: torch.Tensor, block_tables: torch.Tensor, seqs: torch.Tensor, n: torch.Tensor, rate: int,
            block_size: int, state_floats: int, entry_width: int, at: int, dim: int) -> torch.Tensor:  # fmt: skip
    """fp32 ``[N, K, dim]``: columns ``[at, at + dim)`` of entries ``n [N, K]`` (clamped at 0) of ``seqs [N]``."""
    block, row = entry_index(block_tables, seqs, n, rate, block_size)
    return entry_rows(pages, state_floats, entry_width)[block, row, at:at + dim].float()


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``[T, n]`` fp32: ``sum_h weights[t, h] * relu(q[t, h] . keys[t, w])`` for entries ``w < visible[t]``, else
    -inf. ``q [T, Hi, Di]``, ``weights [T, Hi]`` with every scale folded in, ``keys [T, n, Di]``."""
    dots = torch.einsum("thd,tkd->thk", q.float(), keys.float()).relu_()
    scores = torch.einsum("th,thk->tk", weights.float(), dots)
    n = keys.shape[1]
    return scores.masked_fill(torch.arange(n, device=q.device)[None, :] >= visible[:, None], float("-inf"))


def latent_slots(slots: torch.Tensor, latent_page: torch.Tensor | None, block_size: int) -> torch.Tensor:
    """Block slots ``block * block_size + offset`` as slots of the latents' pages (layers/kv_layout.py: the block's
    ``latent_page`` entry; ``None``: the identity map)."""
    if latent_page is None:
        return slots
    slots = slots.long()
    return latent_page.long()[slots // block_size] * block_size + slots % block_size


def window_keys(latents: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor,
                window: int, block_size: int, latent_page: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(fp32 ``[T, window, D]`` latents of positions ``p - window + 1 .. p``, ``[T, window]`` which exist), the
    latents paged through ``latent_page [num_blocks]`` (None: by block id)."""
    pos = positions.long()
    window_pos = pos[:, None] - torch.arange(window - 1, -1, -1, device=pos.device)
    slots = latent_slots(token_slots(block_tables, row_seq.long(), window_pos, block_size), latent_page, block_size)
    return latents[slots].float(), window_pos >= 0


def attend(q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, sinks: torch.Tensor, scale: float
           ) -> torch.Tensor:  # fmt: skip
    """fp32 ``[T, H, D]``: each query ``q [T, H, D]`` over its keys ``[T, K, D]`` (values = keys) where ``seen
    [T, K]``, each head's sink logit ``sinks [H]`` in the denominator only (transformers' eager attention with
    sinks: one more column that takes its share of the softmax and carries no value)."""
    scores = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys)


def v4_attention(q: torch.Tensor, latents: torch.Tensor, pages: torch.Tensor | None, entry_at: int,
                 block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor, sinks: torch.Tensor,
                 scale: float, window: int, rate: int, block_size: int, idx: torch.Tensor | None = None,
                 state_floats: int = 0, entry_width: int = 0, latent_page: torch.Tensor | None = None
                 ) -> torch.Tensor:  # fmt: skip
    """fp32 ``[T, H, D]``: each row's window over ``latents [slots, D]`` (paged through ``latent_page``) and, with ``rate`` > 0, the compressed
    entries of the compact ``pages`` (column ``entry_at`` of ``entry_width``-wide rows after ``state_floats`` of
    checkpoint): every visible one, or the entry indices ``idx [T, K]`` chose (-1: none). Reads the largest visible
    count back to the host: a reference, not a graph path."""
    keys, seen = window_keys(latents, block_tables, row_seq, positions, window, block_size, latent_page)
    if pages is not None and rate > 0:
        visible = (positions.long() + 1) // rate
        n = int(visible.max()) if idx is None else 0
        if idx is not None:
            picked = idx.long()
            ent_seen = (picked >= 0) & (picked < visible[:, None])
        elif n > 0:
            picked = torch.arange(n, device=q.device).expand(q.shape[0], -1)
            ent_seen = picked < visible[:, None]
        if idx is not None or n > 0:
            d = latents.shape[-1]
            ents = entries(pages, block_tables, row_seq, picked, rate, block_size, state_floats, entry_width, entry_at,
                           d)  # fmt: skip
            keys, seen = torch.cat([keys, ents], dim=1), torch.cat([seen, ent_seen], dim=1)
    return attend(q, keys, seen, sinks, scale)
