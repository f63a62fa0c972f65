"""Sliding windows and sinks in the Triton attention kernels, against their PyTorch references, on CPU through
Triton's interpreter (fp32, tiny shapes, fresh random inputs).

Every cache position wholly before a query's window (and the dummy block 0, where a released block's table entry
points) holds NaN: a kernel that read one, even to mask it, would put NaN in its output."""

from __future__ import annotations

import pytest
import torch
from model_utils import relative_error

# first: importing the kernel tests puts Triton under the interpreter when there is no GPU
from test_kernels_interp import DEVICE, _batch, paged_setup, randn, slots_of

PAGE = 16

from graphserve.kernels.decode_attention import (  # noqa: E402
    DecodeTile,
    NewToken,
    decode_attention,
    decode_attention_qkv,
    decode_attention_reference,
)
from graphserve.kernels.extend_attention import extend_attention, extend_attention_reference  # noqa: E402
from graphserve.kernels.qk_rope_kv import qk_norm_rope_kv_write  # noqa: E402
from graphserve.kernels.rotary import rotary_cos_sin  # noqa: E402
from graphserve.layers.attention import TorchAttentionBackend  # noqa: E402
from graphserve.layers.attention_triton import TritonAttentionBackend  # noqa: E402

# 16-token steps: a window of a few dozen tokens takes several steps and splits
TILE = DecodeTile(16, 4, 1)


def poison_before(cache, tables, seq_lens, first_seen, page=PAGE):
    """NaN at every position of sequence i before ``first_seen[i]``; blocks wholly before it released (their table
    entries at the dummy block 0, itself NaN)."""
    cache[:, 0] = float("nan")
    for i, lo in enumerate(first_seen):
        for p in range(lo):
            cache[:, int(tables[i, p // page]), p % page] = float("nan")
        tables[i, : lo // page] = 0


def sinks_of(heads, gen):
    return randn(heads, gen=gen) * 2


@pytest.mark.parametrize(
    ("seq_lens", "window", "num_splits", "fused_merge", "with_sinks"),
    [
        ([70, 33, 5], 24, 1, True, True),  # the direct store; a window mid-block; a context shorter than it
        ([150, 90, 17], 40, 3, True, True),  # splits of the window merged in the kernel, one unused
        ([150, 90, 17], 40, 3, False, True),  # the same through the separate merge launch
        ([130, 64, 0], 64, 2, True, False),  # a window of whole blocks, no sinks; a padding row of length 0
        ([200, 9], None, 2, True, True),  # sinks alone
    ],
)
def test_decode_attention_reads_only_the_window(seq_lens, window, num_splits, fused_merge, with_sinks):
    gen = torch.Generator().manual_seed(len(seq_lens) + num_splits)
    heads, kv_heads, dim = 8, 2, 32
    cache, tables, lens = paged_setup(seq_lens, kv_heads, dim, PAGE, gen)
    ref_cache, ref_tables = cache.clone(), tables.clone()
    poison_before(cache, tables, seq_lens, [0 if window is None else max(0, n - window) for n in seq_lens])
    q = randn(len(seq_lens), heads, dim, gen=gen)
    sinks = sinks_of(heads, gen) if with_sinks else None
    out = decode_attention(q, cache, tables, lens, 0.3, num_splits=num_splits, fused_merge=fused_merge,
                           tile=TILE, window=window, sinks=sinks)  # fmt: skip
    real = [i for i, n in enumerate(seq_lens) if n]
    ref = decode_attention_reference(q[real], ref_cache, ref_tables[real], lens[real], 0.3, window, sinks)
    assert not out[real].isnan().any()
    assert relative_error(out[real], ref) < 1e-5
    if len(real) < len(seq_lens):  # a padding row's output is zero, sinks or not
        assert torch.equal(out[len(real)], torch.zeros_like(out[0]))


def test_window_and_sinks_against_the_dense_formula():
    """The kernel references against the contract written out: p_j = exp(s_j - m) / (exp(sink - m) + sum_i
    exp(s_i - m)) over p - window < j <= p."""
    gen = torch.Generator().manual_seed(2)
    cache, tables, lens = paged_setup([23], 1, 16, PAGE, gen)
    q, sinks, window = randn(1, 2, 16, gen=gen), sinks_of(2, gen), 7
    k, v = cache[0, tables[0, :2].long()].reshape(-1, 16)[:23], cache[1, tables[0, :2].long()].reshape(-1, 16)[:23]
    s = (q[0] @ k[23 - window :].T) * 0.5  # [heads, window]
    m = torch.maximum(s.max(1).values, sinks)
    p = (s - m[:, None]).exp() / ((sinks - m).exp() + (s - m[:, None]).exp().sum(1))[:, None]
    want = p @ v[23 - window :]
    assert relative_error(decode_attention_reference(q, cache, tables, lens, 0.5, window, sinks)[0], want) < 1e-6
    starts = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    got = extend_attention_reference(q, cache, tables, lens, starts, 0.5, window, sinks)
    assert relative_error(got[0], want) < 1e-6


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "window", "with_sinks"),
    [
        ([40, 75, 9], [40, 30, 9], 12, True),  # whole prompts and an extend over a cached prefix, 32-row tiles
        ([100, 20], [70, 1], 33, True),  # 64-row tiles whose later rows see none of the first keys read
        ([50, 18], [17, 18], 1, False),  # each token sees itself only
        ([60], [60], None, True),  # sinks alone
    ],
)
def test_extend_attention_reads_only_the_windows(seq_lens, query_lens, window, with_sinks):
    gen = torch.Generator().manual_seed(sum(seq_lens))
    heads, kv_heads, dim = 4, 2, 32
    cache, tables, lens = paged_setup(seq_lens, kv_heads, dim, PAGE, gen)
    ref_cache, ref_tables = cache.clone(), tables.clone()
    # the first new token's window starts earliest
    poison_before(cache, tables, seq_lens,
                  [0 if window is None else max(0, n - ql - window + 1) for n, ql in zip(seq_lens, query_lens)])
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = randn(int(starts[-1]), heads, dim, gen=gen)
    sinks = sinks_of(heads, gen) if with_sinks else None
    out = torch.full_like(q, float("nan"))
    extend_attention(q, cache, tables, lens, starts, max(query_lens), 0.25, out=out, window=window, sinks=sinks)
    ref = extend_attention_reference(q, ref_cache, ref_tables, lens, starts, 0.25, window, sinks)
    assert not out.isnan().any()
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize(("num_splits", "with_sinks"), [(1, True), (3, True), (2, False)])
def test_prologue_in_decode_with_window_and_sinks(num_splits, with_sinks):
    """The fused-prologue decode (``decode_attention_qkv``): the new token, taken from registers, is always inside
    its window; the output matches the prologue's own launch then the reference."""
    gen = torch.Generator().manual_seed(30 + num_splits)
    heads, kv_heads, dim, window = 4, 2, 32, 20
    seq_lens = [90, 45, 7]
    cache, tables, lens = paged_setup(seq_lens, kv_heads, dim, PAGE, gen)
    width = (heads + 2 * kv_heads) * dim
    qkv = randn(len(seq_lens), width, gen=gen)
    positions = torch.tensor([n - 1 for n in seq_lens], device=DEVICE)
    slots = torch.tensor([slots_of(tables, i, range(n - 1, n), PAGE)[0] for i, n in enumerate(seq_lens)],
                         device=DEVICE)  # fmt: skip
    cos, sin = rotary_cos_sin(max(seq_lens) + 1, dim, base=500.0, device=DEVICE)
    new = NewToken(qkv, heads, positions, cos, sin, slots)
    ref_cache, ref_tables = cache.clone(), tables.clone()
    q = qk_norm_rope_kv_write(qkv, positions, cos, sin, ref_cache, slots, heads, kv_heads, dim, None, None, 0.0)
    poison_before(cache, tables, seq_lens, [max(0, n - window) for n in seq_lens])
    sinks = sinks_of(heads, gen) if with_sinks else None
    out = decode_attention_qkv(new, cache, tables, lens, 0.3, num_splits=num_splits, tile=TILE, window=window,
                               sinks=sinks)  # fmt: skip
    ref = decode_attention_reference(q, ref_cache, ref_tables, lens, 0.3, window, sinks)
    assert not out.isnan().any()
    assert relative_error(out, ref) < 1e-5
    flat, ref_flat = cache.view(2, -1, kv_heads, dim), ref_cache.view(2, -1, kv_heads, dim)
    assert relative_error(flat[:, slots], ref_flat[:, slots]) < 1e-6  # this step's K/V written


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_triton_backend_matches_torch_backend_with_window_and_sinks(mode):
    gen = torch.Generator().manual_seed(40)
    page, hkv, hq, d, window = 16, 2, 4, 32, 19
    seq_lens = [21, 50]
    q_lens = [21, 14] if mode == "prefill" else [1, 1]
    cache, tables, _ = paged_setup(seq_lens, hkv, d, page, gen)
    slots = []
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        slots += slots_of(tables, i, range(n - ql, n), page)
    q, k, v = (randn(sum(q_lens), h, d, gen=gen) for h in (hq, hkv, hkv))
    sinks = sinks_of(hq, gen)
    caches = [cache.clone(), cache.clone()]
    outs = [backend.forward(q, k, v, 0, _batch(mode, q_lens, seq_lens, tables, c, slots), 0.3, window=window,
                            sinks=sinks)
            for backend, c in zip((TritonAttentionBackend(), TorchAttentionBackend()), caches)]  # fmt: skip
    assert torch.equal(caches[0], caches[1])
    assert relative_error(outs[0], outs[1]) < 1e-5
    # the window binds: without it the answer differs
    plain = TorchAttentionBackend().forward(q, k, v, 0, _batch(mode, q_lens, seq_lens, tables, cache.clone(), slots),
                                            0.3, sinks=sinks)  # fmt: skip
    assert relative_error(plain, outs[1]) > 1e-2


def test_kernels_refuse_bad_windows_and_sinks():
    gen = torch.Generator().manual_seed(50)
    cache, tables, lens = paged_setup([20], 2, 32, PAGE, gen)
    q = randn(1, 4, 32, gen=gen)
    with pytest.raises(ValueError, match=r"window=0 must be an integer in 1 \.\. 2\*\*31 - 1"):
        decode_attention(q, cache, tables, lens, 0.3, window=0)
    with pytest.raises(ValueError, match=r"sinks must be contiguous float32 \[4\]"):
        decode_attention(q, cache, tables, lens, 0.3, sinks=torch.zeros(2, device=DEVICE))
    starts = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"sinks must be contiguous float32 \[4\]"):
        extend_attention(q, cache, tables, lens, starts, 1, 0.3, sinks=torch.zeros(4, dtype=torch.float64,
                                                                                  device=DEVICE))  # fmt: skip


@pytest.mark.parametrize(("num_splits", "per_row"), [(1, False), (3, False), (3, True)])
def test_quantized_output_with_window_and_sinks_equals_quantizing_the_output(num_splits, per_row):
    """The output written in fp8 for an FP8 o_proj (one scale per head, or per sequence) is, bit for bit, the
    quantization of the unquantized windowed output with sinks."""
    from graphserve.kernels.fp8_quant import FP8_DTYPE, per_token_group_quant

    gen = torch.Generator().manual_seed(60 + num_splits)
    heads, kv_heads, dim, window = 8, 2, 32, 30
    seq_lens = [120, 64, 11]
    cache, tables, lens = paged_setup(seq_lens, kv_heads, dim, PAGE, gen)
    poison_before(cache, tables, seq_lens, [max(0, n - window) for n in seq_lens])
    q = randn(len(seq_lens), heads, dim, gen=gen).to(torch.bfloat16)
    sinks, b = sinks_of(heads, gen), len(seq_lens)
    kw = {"num_splits": num_splits, "tile": TILE, "window": window, "sinks": sinks}
    plain = decode_attention(q, cache, tables, lens, dim**-0.5, **kw)
    assert not plain.isnan().any()
    want_q, want_s = per_token_group_quant(plain.reshape(b, heads * dim), heads * dim if per_row else dim)
    out = torch.empty(b, heads, dim, dtype=FP8_DTYPE, device=DEVICE)
    scales = torch.empty(b, 1 if per_row else heads, device=DEVICE)
    decode_attention(q, cache, tables, lens, dim**-0.5, out=out, out_scale=scales, **kw)
    assert torch.equal(out.view(b, -1).view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, want_s)
