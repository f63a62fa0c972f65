"""The DSA references (kernels/dsa_reference.py) against plain dense, unpaged computations.

Each sequence's keys and latents are kept contiguous here and written into paged caches through shuffled
block tables; the references read the pages, the checks below loop over the contiguous copies. Scores are
made with many exact ties, rows are shorter and longer than k, and padding rows ride along.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import relative_error
from paged_utils import shuffled_tables, token_slots

from graphserve.kernels import dsa_reference as ref
from graphserve.layers.mla_reference import absorbed_attention_reference

D, HI, RANK, ROPE, HEADS = 16, 3, 12, 4, 2


def paged_setup(seq_lens: list[int], page: int, gen: torch.Generator, extra_cols: int = 1):
    """Block tables over shuffled blocks (never the dummy block 0) and each sequence's slots."""
    num_blocks, tables = shuffled_tables(seq_lens, page, gen, extra_cols=extra_cols)
    slots = token_slots(tables, seq_lens, page)
    return num_blocks, tables, slots


def rows_of(query_lens: list[int], seq_lens: list[int], padding: int):
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq, pos = ref.token_rows(qsl, torch.tensor(seq_lens, dtype=torch.int32), sum(query_lens) + padding)
    return seq, pos


def test_token_rows_extend_decode_and_padding():
    query_lens, seq_lens = [3, 1, 0, 2], [5, 9, 4, 2]
    seq, pos = rows_of(query_lens, seq_lens, padding=3)
    want_seq, want_pos = [], []
    for b, (q, n) in enumerate(zip(query_lens, seq_lens)):
        want_seq += [b] * q
        want_pos += list(range(n - q, n))
    want_seq += [len(seq_lens) - 1] * 3
    want_pos += [0] * 3
    assert seq.tolist() == want_seq and pos.tolist() == want_pos
    assert seq.dtype == torch.int32 and pos.dtype == torch.int32


def test_write_index_cache_plain_and_fp8():
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(6, D, generator=gen) * torch.tensor([0.01, 1.0, 30.0, 1.0, 2.0, 1.0])[:, None]
    k[3] = 0.0  # an all-zero key must stay finite
    slots = torch.tensor([5, 17, 2, 9, 0, 11])
    shape, _ = ref.index_cache_shape(3, 8, D, fp8=False)
    plain = torch.full(shape, float("nan"))
    ref.write_index_cache(k, plain, slots)
    assert torch.equal(ref.read_index_keys(plain, slots), k)

    shape, dtype = ref.index_cache_shape(3, 8, D, fp8=True)
    assert shape == (3, 8, D + 4) and dtype == torch.uint8
    fp8 = torch.randint(0, 255, shape, dtype=torch.uint8, generator=gen)
    ref.write_index_cache(k, fp8, slots)
    back = ref.read_index_keys(fp8, slots)
    assert torch.isfinite(back).all() and torch.equal(back[3], k[3])
    scale = fp8.view(-1, D + 4)[slots, D:].contiguous().view(torch.float32).squeeze(-1)
    torch.testing.assert_close(scale, (k.abs().amax(-1) / 448.0).clamp_min(ref.MIN_SCALE))
    # e4m3 keeps 3 mantissa bits: within half a unit (1/16) of each element's magnitude, amax exactly
    live = [0, 1, 2, 4, 5]
    err = (back[live] - k[live]).abs()
    assert (err <= k[live].abs() / 16 + 1e-6 * k[live].abs().amax(-1, keepdim=True)).all()
    amax_at = k[live].abs().argmax(-1)
    assert torch.equal(back[live].gather(1, amax_at[:, None]), k[live].gather(1, amax_at[:, None]))


def dense_scores(q, weights, keys_per_seq, seq, pos, max_len):
    out = torch.full((q.shape[0], max_len), float("-inf"))
    for t in range(q.shape[0]):
        keys = keys_per_seq[int(seq[t])]
        for j in range(int(pos[t]) + 1):
            out[t, j] = sum(float(weights[t, h]) * max(float(q[t, h] @ keys[j]), 0.0) for h in range(q.shape[1]))
    return out


@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_scores_match_dense(fp8):
    gen = torch.Generator().manual_seed(2)
    query_lens, seq_lens, page = [1, 4, 1], [7, 13, 1], 4
    num_blocks, tables, slots = paged_setup(seq_lens, page, gen)
    keys = [torch.randn(n, D, generator=gen) for n in seq_lens]
    shape, dtype = ref.index_cache_shape(num_blocks, page, D, fp8)
    cache = torch.full(shape, 255 if fp8 else float("nan"), dtype=dtype or torch.float32)
    cache.view(-1, shape[-1])[0] = 0  # the dummy block holds whatever padding rows wrote
    for k, s in zip(keys, slots):
        ref.write_index_cache(k, cache, s)
    if fp8:  # the dense side sees the stored keys, so only the indexing is compared
        keys = [ref.read_index_keys(cache, s) for s in slots]
    seq, pos = rows_of(query_lens, seq_lens, padding=2)
    t = seq.shape[0]
    q = torch.randn(t, HI, D, generator=gen)
    weights = torch.randn(t, HI, generator=gen)
    max_len = max(seq_lens) + 3
    got = ref.indexer_scores(q, weights, cache, tables, seq, pos, max_len)
    want = dense_scores(q, weights, keys, seq, pos, max_len)
    assert got.shape == (t, max_len) and got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert relative_error(got[finite], want[finite]) < 1e-5


def brute_topk(scores: torch.Tensor, pos: torch.Tensor, k: int) -> list[set[int]]:
    out = []
    for t in range(scores.shape[0]):
        order = sorted(range(int(pos[t]) + 1), key=lambda j: (-float(scores[t, j]), j))
        out.append(set(order[:k]))
    return out


def test_topk_ties_short_rows_and_padding():
    gen = torch.Generator().manual_seed(3)
    k, length = 6, 20
    pos = torch.tensor([19, 2, 5, 9, 0, 13], dtype=torch.int32)  # rows shorter than k, exactly k, longer
    # few distinct values: most selections are decided by the lower-position rule
    scores = torch.randint(-2, 3, (pos.shape[0], length), generator=gen).float()
    scores[:, 15:] = torch.where(torch.arange(15, length) > pos[:, None], float("-inf"), scores[:, 15:])
    got = ref.topk_indices(scores, pos, k)
    assert got.shape == (pos.shape[0], k) and got.dtype == torch.int32
    for t, want in enumerate(brute_topk(scores, pos, k)):
        row = got[t].tolist()
        kept = [j for j in row if j >= 0]
        assert set(kept) == want and len(kept) == len(want)
        assert row.count(-1) == k - len(want)
    # k beyond the row length: every position, then -1
    wide = ref.topk_indices(scores[:, :4], torch.tensor([3, 1, 3, 3, 0, 3], dtype=torch.int32), 7)
    assert sorted(j for j in wide[1].tolist() if j >= 0) == [0, 1] and wide[1].tolist().count(-1) == 5


def dense_sparse_mla(q_lat, q_rope, latents, seq, idx, scale):
    out = torch.zeros_like(q_lat)
    for t in range(q_lat.shape[0]):
        chosen = [j for j in idx[t].tolist() if j >= 0]
        rows = latents[int(seq[t])][chosen]
        logits = (q_lat[t] @ rows[:, :RANK].T + q_rope[t] @ rows[:, RANK:].T) * scale
        out[t] = logits.softmax(-1) @ rows[:, :RANK]
    return out


def test_sparse_mla_matches_dense_selection_and_full_attention():
    gen = torch.Generator().manual_seed(4)
    query_lens, seq_lens, page, k = [1, 5, 1], [11, 9, 3], 4, 6
    num_blocks, tables, slots = paged_setup(seq_lens, page, gen)
    latents = [torch.randn(n, RANK + ROPE, generator=gen) for n in seq_lens]
    cache = torch.full((num_blocks, page, 1, RANK + ROPE), float("nan"))
    for lat, s in zip(latents, slots):
        cache.view(-1, RANK + ROPE)[s] = lat
    seq, pos = rows_of(query_lens, seq_lens, padding=2)
    t = seq.shape[0]
    cache.view(-1, RANK + ROPE)[tables[-1, 0].long() * page] = latents[-1][0]  # position 0 of the padded rows' seq
    q_lat = torch.randn(t, HEADS, RANK, generator=gen)
    q_rope = torch.randn(t, HEADS, ROPE, generator=gen)
    scores = torch.randn(t, max(seq_lens), generator=gen)
    idx = ref.topk_indices(scores, pos, k)
    idx = idx[:, torch.randperm(k, generator=gen)]  # the order inside a row carries no meaning
    got = ref.sparse_mla(q_lat, q_rope, cache, tables, seq, idx, 0.3)
    want = dense_sparse_mla(q_lat, q_rope, latents, seq, idx, 0.3)
    assert torch.isfinite(got).all()
    assert relative_error(got, want) < 1e-5
    # selecting every position is dense causal MLA
    everything = ref.topk_indices(scores, pos, max(seq_lens))
    real = sum(query_lens)
    full = ref.sparse_mla(q_lat, q_rope, cache, tables, seq, everything, 0.3)[:real]
    dense = absorbed_attention_reference(q_lat[:real], q_rope[:real], cache, tables, query_lens, seq_lens, 0.3)
    assert relative_error(full, dense) < 1e-5


def test_indexer_topk_is_scores_then_topk():
    gen = torch.Generator().manual_seed(5)
    seq_lens, page, k = [10, 3], 4, 4
    num_blocks, tables, slots = paged_setup(seq_lens, page, gen)
    cache = torch.zeros(num_blocks, page, D, dtype=torch.bfloat16)
    for n, s in zip(seq_lens, slots):
        ref.write_index_cache(torch.randn(n, D, generator=gen), cache, s)
    seq, pos = rows_of([1, 1], seq_lens, padding=1)
    q = torch.randn(3, HI, D, generator=gen).bfloat16()
    weights = torch.rand(3, HI, generator=gen)
    scores = ref.indexer_scores(q, weights, cache, tables, seq, pos, 12)
    got = ref.indexer_topk(q, weights, cache, tables, seq, pos, 12, k)
    for t, want in enumerate(brute_topk(scores, pos, k)):
        assert {j for j in got[t].tolist() if j >= 0} == want
