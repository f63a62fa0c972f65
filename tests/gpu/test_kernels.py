"""Triton kernels on the GPU in bf16 and fp16 at model shapes, against their PyTorch references.

Shapes follow Llama-3-8B (32 query heads, 8 kv heads, head_dim 128, hidden 4096, intermediate
14336) with contexts up to 8k and batches up to 256. The decode kernel is also captured in a CUDA
graph and replayed on new lengths and block tables, and must match an eager call bit for bit.
The fused attention prologue runs at Qwen3-0.6B (16/8 heads, q/k norms) and Llama-3-8B (32/8) shapes, as its
own launch and inside decode attention (over bf16 and fp8 caches, eager and replayed in a CUDA graph).
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import rel_err

from graphserve.kernels.activation import silu_and_mul, silu_and_mul_reference
from graphserve.kernels.decode_attention import (
    NewToken,
    decode_attention,
    decode_attention_qkv,
    decode_attention_reference,
)
from graphserve.kernels.extend_attention import extend_attention, extend_attention_reference
from graphserve.kernels.kv_write import kv_write, kv_write_reference
from graphserve.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_reference, rms_norm, rms_norm_reference
from graphserve.kernels.qk_rope_kv import qk_norm_rope_kv_write, qk_norm_rope_kv_write_reference
from graphserve.kernels.rotary import apply_rotary, apply_rotary_reference, rotary_cos_sin
from graphserve.layers.attention import TorchAttentionBackend
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.layers.forward_batch import ForwardBatch

DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}
PAGE = 16


def paged(seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    """Random cache plus block tables handing out shuffled blocks (block 0 stays the dummy block)."""
    per_seq = [(n + PAGE - 1) // PAGE for n in seq_lens]
    num_blocks = sum(per_seq) + 8
    cache = torch.randn(2, num_blocks, PAGE, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    order = torch.randperm(num_blocks - 1, device="cuda", generator=gen).int() + 1
    tables = torch.zeros(len(seq_lens), max(per_seq) + 2, dtype=torch.int32, device="cuda")
    used = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = order[used : used + nb]
        used += nb
    return cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


def lengths(batch: int, max_ctx: int, gen: torch.Generator) -> list[int]:
    """Varied context lengths in [1, max_ctx], the longest always present."""
    lens = torch.randint(1, max_ctx + 1, (batch,), device="cuda", generator=gen).tolist()
    lens[0] = max_ctx
    return lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_kv_write(dtype, num_tokens, gen):
    cache, _, _ = paged([num_tokens + 40], 8, 128, dtype, gen)
    k = torch.randn(num_tokens, 8, 128, device="cuda", generator=gen).to(dtype)
    v = torch.randn(num_tokens, 8, 128, device="cuda", generator=gen).to(dtype)
    slots = torch.randperm(cache[0].numel() // (8 * 128), device="cuda", generator=gen)[:num_tokens]
    ref = cache.clone()
    kv_write(k, v, cache, slots)
    kv_write_reference(k, v, ref, slots)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("batch", "max_ctx", "num_heads", "num_kv_heads", "head_dim"),
    [
        (1, 8192, 32, 8, 128),  # one long sequence: many splits
        (4, 4000, 32, 8, 128),
        (64, 2048, 32, 8, 128),
        (256, 1024, 32, 8, 128),  # large batch: one split, direct store
        (16, 3000, 16, 16, 64),  # MHA, head_dim 64
        (8, 5000, 28, 4, 128),  # group of 7 query heads per kv head
    ],
)
def test_decode_attention(dtype, batch, max_ctx, num_heads, num_kv_heads, head_dim, gen):
    cache, tables, lens = paged(lengths(batch, max_ctx, gen), num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(batch, num_heads, head_dim, device="cuda", generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    decode_attention(q, cache, tables, lens, scale, out=out)
    ref = decode_attention_reference(q, cache, tables, lens, scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 2, 7, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 8), (32, 4)])  # Llama-3-8B, Qwen3-30B-A3B
def test_decode_attention_any_split_count_agrees(num_splits, num_heads, num_kv_heads, gen):
    """Every split count, merged in the split kernel and by the separate merge launch."""
    cache, tables, lens = paged(lengths(6, 3000, gen), num_kv_heads, 128, torch.bfloat16, gen)
    q = torch.randn(6, num_heads, 128, device="cuda", generator=gen).to(torch.bfloat16)
    ref = decode_attention_reference(q, cache, tables, lens, 128**-0.5)
    counters = torch.zeros(6 * num_kv_heads, dtype=torch.int32, device="cuda")
    fused = decode_attention(q, cache, tables, lens, 128**-0.5, num_splits=num_splits, counters=counters)
    launched = decode_attention(q, cache, tables, lens, 128**-0.5, num_splits=num_splits, fused_merge=False)
    assert rel_err(fused, ref) < TOL[torch.bfloat16]
    assert rel_err(fused, launched) < 1e-2  # the same partials, merged in another order
    assert not counters.any()


@pytest.mark.parametrize("min_split_len", [64, 128, 256])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 8), (32, 4)])  # Llama-3-8B, Qwen3-30B-A3B
def test_decode_attention_split_lengths_agree(min_split_len, num_heads, num_kv_heads, gen):
    """Batch 1 and 3 in an 8k-token table (32 and 22 or 11 splits launched): short contexts use a few, long ones all."""
    cache, tables, lens = paged([1025, 300, 8000], num_kv_heads, 128, torch.bfloat16, gen)
    q = torch.randn(3, num_heads, 128, device="cuda", generator=gen).to(torch.bfloat16)
    ref = decode_attention_reference(q, cache, tables, lens, 128**-0.5)
    for batch in (1, 3):
        out = decode_attention(q[:batch], cache, tables[:batch], lens[:batch], 128**-0.5, min_split_len=min_split_len)
        assert rel_err(out, ref[:batch]) < TOL[torch.bfloat16]


@pytest.mark.parametrize(("batch", "num_kv_heads"), [(1, 8), (8, 8), (64, 8), (1, 4), (3, 4)])
def test_decode_attention_cuda_graph_replay_matches_eager(batch, num_kv_heads, gen):
    dtype, hq, hkv, d = torch.bfloat16, 32, num_kv_heads, 128
    cache, tables, lens = paged(lengths(batch, 8192, gen), hkv, d, dtype, gen)
    q = torch.randn(batch, hq, d, device="cuda", generator=gen).to(dtype)
    out = torch.empty_like(q)
    backend = TritonAttentionBackend()
    ws, counters = backend.reserve(hq, hkv, d, torch.device("cuda"))
    decode_attention(q, cache, tables, lens, d**-0.5, out=out, workspace=ws, counters=counters)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, cache, tables, lens, d**-0.5, out=out, workspace=ws, counters=counters)
    # new inputs written into the captured buffers: other lengths, other blocks, other queries
    new_cache, new_tables, new_lens = paged(lengths(batch, 8192, gen), hkv, d, dtype, gen)
    n = min(cache.shape[1], new_cache.shape[1])
    cache[:, :n].copy_(new_cache[:, :n])
    tables.copy_(new_tables.clamp(max=n - 1)[:, : tables.shape[1]])
    lens.copy_(new_lens.clamp(max=(tables.shape[1] - 2) * PAGE))
    q.copy_(torch.randn(batch, hq, d, device="cuda", generator=gen).to(dtype))
    out.fill_(float("nan"))
    for _ in range(3):  # the in-kernel merge's counters must come back to zero after every replay
        graph.replay()
    torch.cuda.synchronize()
    assert not counters.any()
    eager = decode_attention(q, cache, tables, lens, d**-0.5, workspace=ws, counters=counters)
    assert torch.equal(out, eager)
    assert rel_err(out, decode_attention_reference(q, cache, tables, lens, d**-0.5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "num_heads", "num_kv_heads", "head_dim"),
    [
        ([1000, 517, 2048, 33], [1000, 517, 2048, 33], 32, 8, 128),  # prefill, varlen
        ([4096, 8192, 700], [512, 100, 700], 32, 8, 128),  # extend over cached prefixes up to 8k
        ([300, 2049, 65, 1200], [1, 2049, 1, 77], 32, 8, 128),  # mixed decode and prefill rows
        ([1500, 999], [1500, 400], 16, 16, 64),  # MHA, head_dim 64
    ],
)
def test_extend_attention(dtype, seq_lens, query_lens, num_heads, num_kv_heads, head_dim, gen):
    cache, tables, lens = paged(seq_lens, num_kv_heads, head_dim, dtype, gen)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(query_lens), num_heads, head_dim, device="cuda", generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    extend_attention(q, cache, tables, lens, starts, max(query_lens), scale, out=out)
    ref = extend_attention_reference(q, cache, tables, lens, starts, scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 4096), (4096, 4096), (333, 5120)])
def test_norms(dtype, num_tokens, hidden, gen):
    x = (torch.randn(num_tokens, hidden, device="cuda", generator=gen) * 4).to(dtype)
    res = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)
    assert rel_err(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)) < TOL[dtype]
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_res = fused_add_rms_norm_reference(x, res, w, 1e-5)
    assert rel_err(normed, ref_normed) < TOL[dtype]
    assert torch.equal(new_res, ref_res)  # one rounding of x + residual, same as PyTorch's add


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "num_heads", "num_kv_heads", "head_dim"), [(7, 32, 8, 128), (4096, 16, 8, 64)])
def test_rotary(dtype, num_tokens, num_heads, num_kv_heads, head_dim, gen):
    cos, sin = rotary_cos_sin(8192, head_dim, base=500000.0, device="cuda")
    q = torch.randn(num_tokens, num_heads, head_dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda", generator=gen)
    ref_q, ref_k = apply_rotary_reference(q, k, positions, cos, sin)
    apply_rotary(q, k, positions, cos, sin)
    assert rel_err(q, ref_q) < TOL[dtype] and rel_err(k, ref_k) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "inter"), [(1, 14336), (2048, 14336), (100, 3000)])
def test_silu_and_mul(dtype, num_tokens, inter, gen):
    x = (torch.randn(num_tokens, 2 * inter, device="cuda", generator=gen) * 3).to(dtype)
    out = torch.full((num_tokens, inter), float("nan"), device="cuda", dtype=dtype)
    silu_and_mul(x, out=out)
    assert not out.isnan().any()
    assert rel_err(out, silu_and_mul_reference(x)) < TOL[dtype]


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_triton_backend_matches_torch_backend(mode, gen):
    dtype, hq, hkv, d = torch.bfloat16, 32, 8, 128
    seq_lens = [700, 1900, 64]
    q_lens = [700, 300, 64] if mode == "prefill" else [1, 1, 1]
    cache, tables, lens = paged(seq_lens, hkv, d, dtype, gen)
    slots = []
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        slots += [int(tables[i, p // PAGE]) * PAGE + p % PAGE for p in range(n - ql, n)]
    total = sum(q_lens)
    q, k, v = (torch.randn(total, h, d, device="cuda", generator=gen).to(dtype) for h in (hq, hkv, hkv))
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    outs, caches = [], [cache.clone(), cache.clone()]
    for backend, c in zip((TritonAttentionBackend(), TorchAttentionBackend()), caches):
        batch = ForwardBatch(
            mode=mode,
            input_ids=torch.zeros(total, dtype=torch.int64, device="cuda"),
            positions=torch.zeros(total, dtype=torch.int64, device="cuda"),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
            query_start_loc=starts,
            seq_lens=lens,
            block_tables=tables,
            logits_indices=starts[1:].long() - 1,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            kv_caches=[c],
        )
        outs.append(backend.forward(q, k, v, 0, batch, d**-0.5))
    assert torch.equal(caches[0], caches[1])
    assert rel_err(outs[0], outs[1]) < TOL[dtype]


def prologue_inputs(num_tokens: int, num_heads: int, num_kv_heads: int, norms: bool, gen: torch.Generator):
    """bf16 qkv rows strided inside a wider buffer, positions up to 8k, shuffled slots, random norm weights."""
    dtype, d = torch.bfloat16, 128
    width = (num_heads + 2 * num_kv_heads) * d
    qkv = (torch.randn(num_tokens, width + 64, device="cuda", generator=gen) * 3).to(dtype)[:, :width]
    cos, sin = rotary_cos_sin(8192, d, base=1000000.0, device="cuda")
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda", generator=gen)
    cache, _, _ = paged([num_tokens + 40], num_kv_heads, d, dtype, gen)
    slots = torch.randperm(cache[0].numel() // (num_kv_heads * d), device="cuda", generator=gen)[:num_tokens]
    weights = {}
    if norms:
        weights = {
            name: (1 + 0.2 * torch.randn(d, device="cuda", generator=gen)).to(dtype)
            for name in ("q_norm_weight", "k_norm_weight")
        }
    return qkv, positions, cos, sin, cache, slots, weights


PROLOGUE_SHAPES = [(16, 8, True), (32, 8, False)]  # qwen3-0.6b (q/k norms), llama3-8b (none); head_dim 128


@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "norms"), PROLOGUE_SHAPES, ids=["qwen3-0.6b", "llama3-8b"])
def test_qk_norm_rope_kv_write(num_heads, num_kv_heads, norms, num_tokens, gen):
    qkv, positions, cos, sin, cache, slots, weights = prologue_inputs(num_tokens, num_heads, num_kv_heads, norms, gen)
    before, ref_cache = cache.clone(), cache.clone()
    args = (num_heads, num_kv_heads, 128)
    q = qk_norm_rope_kv_write(qkv, positions, cos, sin, cache, slots, *args, **weights, eps=1e-6)
    ref_q = qk_norm_rope_kv_write_reference(qkv, positions, cos, sin, ref_cache, slots, *args, **weights, eps=1e-6)
    assert rel_err(q, ref_q) < TOL[torch.bfloat16]
    flat, ref_flat, old = (c.view(2, -1, num_kv_heads, 128) for c in (cache, ref_cache, before))
    assert torch.equal(flat[1], ref_flat[1])  # V is copied, no arithmetic
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(flat[0, untouched], old[0, untouched])
    # K takes the same roundings as the reference (norm, weight, rotary), but fp32 sums in another
    # order can flip one of them: allow at most 2 bf16 ulps at the head's largest magnitude
    # (2**-6 of its absmax) on under 1% of the elements; the rest must be bit-equal.
    k, ref_k = flat[0, slots].float(), ref_flat[0, slots].float()
    diff = (k - ref_k).abs()
    assert (diff <= 2**-6 * ref_k.abs().amax(-1, keepdim=True)).all()
    assert (diff > 0).float().mean().item() < 0.01


def test_qk_norm_rope_kv_write_cuda_graph_replay_matches_eager(gen):
    num_heads, num_kv_heads, num_tokens = 16, 8, 8
    qkv, positions, cos, sin, cache, slots, weights = prologue_inputs(num_tokens, num_heads, num_kv_heads, True, gen)
    args = (num_heads, num_kv_heads, 128)
    q_out = torch.empty(num_tokens, num_heads, 128, dtype=qkv.dtype, device="cuda")
    qk_norm_rope_kv_write(qkv, positions, cos, sin, cache, slots, *args, **weights, q_out=q_out)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qk_norm_rope_kv_write(qkv, positions, cos, sin, cache, slots, *args, **weights, q_out=q_out)
    new_qkv, new_pos, _, _, _, _, _ = prologue_inputs(num_tokens, num_heads, num_kv_heads, True, gen)
    qkv.copy_(new_qkv)
    positions.copy_(new_pos)
    slots.copy_(torch.randperm(cache[0].numel() // (num_kv_heads * 128), device="cuda", generator=gen)[:num_tokens])
    q_out.fill_(float("nan"))
    eager_cache = cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    eager_q = qk_norm_rope_kv_write(qkv, positions, cos, sin, eager_cache, slots, *args, **weights)
    assert torch.equal(q_out, eager_q)
    assert torch.equal(cache, eager_cache)


def prologue_step(batch: int, num_heads: int, num_kv_heads: int, norms: bool, cache_dtype: torch.dtype, gen):
    """A decode step at model shapes: contexts up to 4096 in a paged cache, each sequence's last position the step's
    token (its slot from the block table), the qkv rows a column slice of a wider bf16 buffer."""
    d = 128
    seq_lens = lengths(batch, 4096, gen)
    cache, tables, lens = paged(seq_lens, num_kv_heads, d, torch.bfloat16, gen)
    cache = cache.to(cache_dtype)
    width = (num_heads + 2 * num_kv_heads) * d
    qkv = (torch.randn(batch, width + 64, device="cuda", generator=gen) * 3).to(torch.bfloat16)[:, :width]
    cos, sin = rotary_cos_sin(8192, d, base=500000.0, device="cuda")
    last = lens.long() - 1
    slots = tables.long().gather(1, (last // PAGE)[:, None])[:, 0] * PAGE + last % PAGE
    weights = {}
    if norms:
        weights = {name: (1 + 0.2 * torch.randn(d, device="cuda", generator=gen)).to(torch.bfloat16)
                   for name in ("q_norm_weight", "k_norm_weight")}  # fmt: skip
    return NewToken(qkv, num_heads, last, cos, sin, slots, **weights, eps=1e-6), cache, tables, lens


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "norms"), PROLOGUE_SHAPES, ids=["qwen3-0.6b", "llama3-8b"])
def test_decode_attention_qkv_matches_the_two_launches(num_heads, num_kv_heads, norms, batch, cache_dtype, gen):
    """The prologue inside decode attention against the prologue launch then decode attention: the output within
    bf16's tolerance, V bit for bit, K with the prologue test's allowance (fp32 sums in another order may flip
    one rounding), nothing else in the cache touched."""
    new, cache, tables, lens = prologue_step(batch, num_heads, num_kv_heads, norms, cache_dtype, gen)
    before, ref_cache = cache.clone(), cache.clone()
    q = qk_norm_rope_kv_write(new.qkv, new.positions, new.cos, new.sin, ref_cache, new.slot_mapping, num_heads,
                              num_kv_heads, 128, new.q_norm_weight, new.k_norm_weight, new.eps)  # fmt: skip
    ref = decode_attention(q, ref_cache, tables, lens, 128**-0.5)
    out = decode_attention_qkv(new, cache, tables, lens, 128**-0.5)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert rel_err(out, decode_attention_reference(q, ref_cache, tables, lens, 128**-0.5)) < TOL[torch.bfloat16]
    flat, ref_flat, old = (c.view(2, -1, num_kv_heads, 128).float() for c in (cache, ref_cache, before))
    assert torch.equal(flat[1], ref_flat[1])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device="cuda")
    untouched[new.slot_mapping] = False
    assert torch.equal(flat[0, untouched], old[0, untouched])
    k, ref_k = flat[0, new.slot_mapping], ref_flat[0, new.slot_mapping]
    diff = (k - ref_k).abs()
    ulps = 2**-6 if cache_dtype == torch.bfloat16 else 2**-2  # e4m3: 3 mantissa bits
    assert (diff <= ulps * ref_k.abs().amax(-1, keepdim=True)).all()
    assert (diff > 0).float().mean().item() < 0.01


@pytest.mark.parametrize("batch", [1, 64])
def test_decode_attention_qkv_cuda_graph_replay_matches_eager(batch, gen):
    """Captured once, replayed on new rows, positions, lengths and slots: output and cache equal an eager call's."""
    new, cache, tables, lens = prologue_step(batch, 16, 8, True, torch.bfloat16, gen)
    backend = TritonAttentionBackend()
    ws, counters = backend.reserve(16, 8, 128, torch.device("cuda"))
    out = torch.empty(batch, 16, 128, dtype=torch.bfloat16, device="cuda")
    kw = {"out": out, "workspace": ws, "counters": counters}
    decode_attention_qkv(new, cache.clone(), tables, lens, 128**-0.5, **kw)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention_qkv(new, cache, tables, lens, 128**-0.5, **kw)
    fresh, _, _, new_lens = prologue_step(batch, 16, 8, True, torch.bfloat16, gen)
    # no longer than each sequence's own blocks: past them a table holds the dummy block, which every sequence
    # would then write and read at once
    lens.copy_(torch.minimum(new_lens, lens))
    last = lens.long() - 1
    new.qkv.copy_(fresh.qkv)
    new.positions.copy_(last)
    new.slot_mapping.copy_(tables.long().gather(1, (last // PAGE)[:, None])[:, 0] * PAGE + last % PAGE)
    eager_cache = cache.clone()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert not counters.any()
    eager = decode_attention_qkv(new, eager_cache, tables, lens, 128**-0.5, workspace=ws, counters=counters)
    assert torch.equal(out, eager)
    assert torch.equal(cache, eager_cache)
