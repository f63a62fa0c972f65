"""Sliding windows and attention sinks in the CPU backend and the model-facing Attention layer, against a dense
reference that builds every sequence's whole K/V and masks position by position."""

from __future__ import annotations

import pytest
import torch

from graphserve.layers.attention import (
    Attention,
    TorchAttentionBackend,
    batched_decode_attention,
    reference_paged_attention,
)
from graphserve.layers.forward_batch import ForwardBatch


def dense_attention(q, k, v, q_pos, scale, window, sinks):
    """q [Q, H, D] at positions q_pos, k/v [L, Hkv, D] at positions 0..L-1: float64, one query and head at a time,
    with the window and sink written out as the contract states them."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, p in enumerate(q_pos):
        keys = [j for j in range(k.shape[0]) if j <= p and (window is None or j > p - window)]
        for h in range(heads):
            kh = h // (heads // kv_heads)
            s = torch.stack([(q[i, h].double() * k[j, kh].double()).sum() * scale for j in keys])
            m = s.max() if sinks is None else torch.maximum(s.max(), sinks[h].double())
            e = (s - m).exp()
            denom = e.sum() + (0.0 if sinks is None else (sinks[h].double() - m).exp())
            out[i, h] = ((e / denom)[:, None] * torch.stack([v[j, kh].double() for j in keys])).sum(0)
    return out


def paged(seq_kv, block_size, num_blocks, gen):
    """Scatter each sequence's K/V [L, Hkv, D] over shuffled blocks: (k_cache, v_cache, block_tables)."""
    kv_heads, dim = seq_kv[0][0].shape[1:]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)  # garbage where no token lives
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    width = max(-(-k.shape[0] // block_size) for k, _ in seq_kv)
    tables = torch.zeros(len(seq_kv), width, dtype=torch.int32)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    for i, (k, v) in enumerate(seq_kv):
        for b in range(-(-k.shape[0] // block_size)):
            blk = order.pop()
            tables[i, b] = blk
            n = min(block_size, k.shape[0] - b * block_size)
            rows = slice(b * block_size, b * block_size + n)
            k_cache[blk, :n], v_cache[blk, :n] = k[rows], v[rows]
    return k_cache, v_cache, tables


def rel(got, want):
    return float((got.double() - want).norm() / want.norm())


CASES = [(None, False), (5, False), (1, False), (None, True), (6, True), (64, True)]


@pytest.mark.parametrize(("window", "with_sinks"), CASES)
def test_paged_reference_extend_matches_dense(window, with_sinks):
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block_size = 6, 2, 8, 4
    seq_lens, query_lens = [13, 9, 5], [4, 9, 1]  # an extend over a cached prefix, a prefill, a decode row
    seq_kv = [(torch.randn(n, kv_heads, dim, generator=gen), torch.randn(n, kv_heads, dim, generator=gen))
              for n in seq_lens]
    k_cache, v_cache, tables = paged(seq_kv, block_size, 16, gen)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 2 if with_sinks else None
    got = reference_paged_attention(q, k_cache, v_cache, tables, query_lens, seq_lens, 0.3, window, sinks)
    start = 0
    for (k, v), n, qlen in zip(seq_kv, seq_lens, query_lens):
        want = dense_attention(q[start : start + qlen], k, v, range(n - qlen, n), 0.3, window, sinks)
        assert rel(got[start : start + qlen], want) < 1e-5
        start += qlen


@pytest.mark.parametrize(("window", "with_sinks"), CASES)
def test_batched_decode_matches_dense(window, with_sinks):
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block_size = 8, 2, 8, 4
    seq_lens = [1, 7, 13, 16]
    seq_kv = [(torch.randn(n, kv_heads, dim, generator=gen), torch.randn(n, kv_heads, dim, generator=gen))
              for n in seq_lens]
    k_cache, v_cache, tables = paged(seq_kv, block_size, 20, gen)
    q = torch.randn(len(seq_lens), heads, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 2 if with_sinks else None
    got = batched_decode_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens), 0.3, window, sinks)
    for i, ((k, v), n) in enumerate(zip(seq_kv, seq_lens)):
        assert rel(got[i : i + 1], dense_attention(q[i : i + 1], k, v, [n - 1], 0.3, window, sinks)) < 1e-5


def test_window_one_sees_only_itself_and_a_sink_scales_it_down():
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache = torch.randn(4, 4, 1, 8, generator=gen), torch.randn(4, 4, 1, 8, generator=gen)
    tables = torch.tensor([[2, 3]], dtype=torch.int32)
    q = torch.randn(1, 2, 8, generator=gen)
    own = v_cache[3, 1, 0]  # position 5 of the sequence
    out = batched_decode_attention(q, k_cache, v_cache, tables, torch.tensor([6]), 0.5, window=1)
    assert torch.allclose(out[0], own.expand(2, 8), rtol=1e-6)
    # with one key left, the sink takes exp(sink) / (exp(sink) + exp(s)) of the weight
    sinks = torch.tensor([0.0, 1.0])
    out = batched_decode_attention(q, k_cache, v_cache, tables, torch.tensor([6]), 0.5, window=1, sinks=sinks)
    s = (q[0] @ k_cache[3, 1, 0]) * 0.5
    weight = torch.sigmoid(s - sinks)
    assert torch.allclose(out[0], weight[:, None] * own, rtol=1e-5)


def make_batch(kv_cache, tables, query_lens, seq_lens, mode):
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    block_size = kv_cache.shape[2]
    slots, positions = [], []
    for i, (qlen, n) in enumerate(zip(query_lens, seq_lens)):
        for p in range(n - qlen, n):
            positions.append(p)
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(len(slots), dtype=torch.int64), positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots), query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables, logits_indices=qsl[1:].long() - 1, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), kv_caches=[kv_cache], attn_backend=TorchAttentionBackend(),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["mixed", "decode"])
def test_attention_layer_writes_kv_and_attends_through_its_window_and_sinks(mode):
    """The layer declares window and sinks once; the backend writes this step's K/V and attends over cache + new."""
    gen = torch.Generator().manual_seed(9)
    heads, kv_heads, dim, block_size, window = 4, 2, 8, 4, 5
    seq_lens = [11, 6]
    query_lens = [1, 1] if mode == "decode" else [3, 6]
    seq_kv = [(torch.randn(n, kv_heads, dim, generator=gen), torch.randn(n, kv_heads, dim, generator=gen))
              for n in seq_lens]
    k_cache, v_cache, tables = paged(seq_kv, block_size, 12, gen)
    kv_cache = torch.stack([k_cache, v_cache])
    new_k = torch.cat([k[n - q :] for (k, _), n, q in zip(seq_kv, seq_lens, query_lens)])
    new_v = torch.cat([v[n - q :] for (_, v), n, q in zip(seq_kv, seq_lens, query_lens)])
    batch = make_batch(kv_cache, tables, query_lens, seq_lens, mode)
    kv_cache.view(2, -1, kv_heads, dim)[:, batch.slot_mapping] = torch.randn(2, len(new_k), kv_heads, dim)  # stale
    layer = Attention(0, heads, 0.4, window=window, sinks=True)
    layer.load_weight("sinks", layer.sinks, torch.randn(heads, generator=gen), None)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    got = layer(q, new_k, new_v, batch)
    start = 0
    for (k, v), n, qlen in zip(seq_kv, seq_lens, query_lens):
        want = dense_attention(q[start : start + qlen], k, v, range(n - qlen, n), 0.4, window, layer.sinks.data)
        assert rel(got[start : start + qlen], want) < 1e-5
        start += qlen


def test_attention_layer_slices_sinks_by_rank_and_refuses_bad_declarations():
    full = torch.arange(8, dtype=torch.float32)
    layer = Attention(3, 4, 1.0, sinks=True, tp_rank=1, tp_size=2)
    layer.load_weight("sinks", layer.sinks, full, None)
    assert layer.sinks.dtype == torch.float32 and layer.sinks.tolist() == [4.0, 5.0, 6.0, 7.0]
    with pytest.raises(ValueError, match=r"shape \(4,\), expected \(8,\)"):
        layer.load_weight("sinks", layer.sinks, full[:4], None)
    assert Attention(0, 4, 1.0).sinks is None
    # the model is cast to bf16 as a whole; the sinks stay float32, on meta and once materialised alike
    with torch.device("meta"):
        cast = Attention(0, 4, 1.0, sinks=True).to(torch.bfloat16)
    assert cast.sinks.dtype == torch.float32 and cast.to_empty(device="cpu").sinks.dtype == torch.float32
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"layer 2: sliding_window={bad!r}, it must be an integer >= 1"):
            Attention(2, 4, 1.0, window=bad)
