"""Decode attention with the attention prologue inside it (kernels/decode_attention.decode_attention_qkv)
against the two launches it replaces: kernels/qk_rope_kv.py's prologue, then decode attention on q.

CPU through Triton's interpreter. The cache must end the same (K normed and rotated, V copied, at the
step's slots only; K within 1e-6, the norm's sum of squares taken in another order) and the output within
1e-5 in fp32 (the new token's score is a sum of fp32 products where the two launches take it from a dot
over the cache), 1e-2 over an fp8 cache with bf16 rows (fp16 widening, bf16 output). Splits of every
kind: one (direct store), several merged in the kernel or by the separate merge, splits the context does
not reach, a one-token context, and a padding row of length 0.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_utils import relative_error

# first: importing the kernel tests puts Triton under the interpreter when there is no GPU
from test_kernels_interp import DEVICE, paged_setup, randn, slots_of

FP8 = torch.float8_e4m3fn
PAGE = 16

from graphserve.kernels.decode_attention import (  # noqa: E402
    NewToken,
    decode_attention,
    decode_attention_qkv,
    decode_attention_reference,
)
from graphserve.kernels.qk_rope_kv import qk_norm_rope_kv_write  # noqa: E402
from graphserve.kernels.rotary import rotary_cos_sin  # noqa: E402


def step_inputs(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, norms: bool, seed: int):
    """A cache holding each context but its last token, the step's qkv rows (a column slice of a wider
    buffer), each row's position (its last) and slot (where that position lives in its block table)."""
    gen = torch.Generator().manual_seed(seed)
    cache, tables, lens = paged_setup(seq_lens, num_kv_heads, head_dim, PAGE, gen)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (randn(len(seq_lens), width + 8, gen=gen) * 2)[:, 3 : 3 + width]
    positions = torch.tensor([max(n - 1, 0) for n in seq_lens], device=DEVICE)
    slots = torch.tensor([slots_of(tables, i, range(n - 1, n), PAGE)[0] if n else 0 for i, n in enumerate(seq_lens)],
                         device=DEVICE)  # fmt: skip
    cos, sin = rotary_cos_sin(max(seq_lens) + 1, head_dim, base=500.0, device=DEVICE)
    weights = {}
    if norms:
        weights = {"q_norm_weight": 1 + 0.3 * randn(head_dim, gen=gen), "k_norm_weight": 1 + 0.3 * randn(head_dim, gen=gen),
                   "eps": 1e-6}  # fmt: skip
    return NewToken(qkv, num_heads, positions, cos, sin, slots, **weights), cache, tables, lens


def separate(new: NewToken, num_heads: int, cache: torch.Tensor, tables, lens, scale: float, **kwargs):
    """The two launches: the prologue writes K/V and returns q; decode attention reads it all from the cache."""
    q = qk_norm_rope_kv_write(new.qkv, new.positions, new.cos, new.sin, cache, new.slot_mapping, num_heads,
                              cache.shape[3], cache.shape[4], new.q_norm_weight, new.k_norm_weight, new.eps)  # fmt: skip
    return q, decode_attention(q, cache, tables, lens, scale, **kwargs)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "norms", "seq_lens", "num_splits", "fused_merge"),
    [
        (4, 2, 32, True, [5, 40, 17], 1, True),  # per-head norms (Qwen3), one split: the direct store
        (6, 2, 16, False, [1, 33], None, True),  # Llama-like (a group of 3), a one-token context
        (8, 2, 32, True, [150, 70, 9], 3, True),  # splits merged in the kernel: full, partial and unused
        (8, 2, 32, False, [150, 70, 9], 3, False),  # the same through the separate merge launch
        (4, 1, 32, True, [200, 0], 4, True),  # one kv head; a padding row of length 0 (slot 0, writes nothing)
        (4, 2, 32, False, [64, 65, 128], 2, True),  # the new token first in its split, alone in its split, last
        (4, 2, 32, True, [300, 130, 64], 1, True),  # several steps a program
        (8, 2, 32, False, [400, 200, 3], 2, True),  # several steps; a full, a half-used and an empty second split
    ],
)
def test_prologue_in_decode_matches_the_two_launches(num_heads, num_kv_heads, head_dim, norms, seq_lens, num_splits,
                                                     fused_merge):  # fmt: skip
    new, cache, tables, lens = step_inputs(seq_lens, num_heads, num_kv_heads, head_dim, norms, seed=len(seq_lens))
    before = cache.clone()
    ref_cache = cache.clone()
    scale = head_dim**-0.5
    kwargs = {"num_splits": num_splits, "fused_merge": fused_merge, "min_split_len": 64}
    q, ref = separate(new, num_heads, ref_cache, tables, lens, scale, **kwargs)
    out = decode_attention_qkv(new, cache, tables, lens, scale, **kwargs)
    assert not out.isnan().any()
    assert relative_error(out, ref) < 1e-5
    assert relative_error(out, decode_attention_reference(q, ref_cache, tables, lens, scale)) < 1e-5
    flat, ref_flat, old = (c.view(2, -1, num_kv_heads, head_dim) for c in (cache, ref_cache, before))
    written = torch.tensor([s for s, n in zip(new.slot_mapping.tolist(), seq_lens) if n], device=DEVICE)
    assert relative_error(flat[0, written], ref_flat[0, written]) < 1e-6  # K: normed and rotated
    assert torch.equal(flat[1, written], ref_flat[1, written])  # V: copied as is
    assert not torch.equal(flat[:, written], old[:, written])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[new.slot_mapping] = False
    assert torch.equal(flat[:, untouched], old[:, untouched])


@pytest.mark.parametrize("num_splits", [3, 1])  # one step a program; five steps in the longer one
def test_prologue_in_decode_over_an_fp8_cache_with_bf16_rows(num_splits):
    """bf16 qkv rows and an fp8 cache (the K/V cast as the prologue casts them, the context widened to fp16): the
    cache bit for bit, the output within bf16's rounding. (The engine runs the prologue's own launch over an fp8
    cache, layers/attention_triton.prologue_in_decode, unless a ``decode_prologue(True)`` scope asks for this.)"""
    seq_lens = [300, 33]
    new, cache, tables, lens = step_inputs(seq_lens, 8, 2, 32, True, seed=21)
    new = NewToken(new.qkv.to(torch.bfloat16), 8, new.positions, new.cos, new.sin, new.slot_mapping,
                   new.q_norm_weight.to(torch.bfloat16), new.k_norm_weight.to(torch.bfloat16), new.eps)  # fmt: skip
    cache = cache.to(FP8)
    ref_cache = cache.clone()
    _, ref = separate(new, 8, ref_cache, tables, lens, 0.2, num_splits=num_splits, min_split_len=64)
    out = decode_attention_qkv(new, cache, tables, lens, 0.2, num_splits=num_splits, min_split_len=64)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, ref) < 1e-2
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))


def test_prologue_in_decode_with_a_quantized_output():
    """The output quantized per head for an FP8 o_proj (``out_scale``): dequantized, it matches the two launches'."""
    seq_lens = [90, 20]
    new, cache, tables, lens = step_inputs(seq_lens, 4, 2, 32, False, seed=22)
    ref_cache = cache.clone()
    _, ref = separate(new, 4, ref_cache, tables, lens, 0.3, num_splits=2, min_split_len=64)
    out = torch.empty(2, 4, 32, dtype=FP8, device=DEVICE)
    scales = torch.empty(2, 4, dtype=torch.float32, device=DEVICE)
    decode_attention_qkv(new, cache, tables, lens, 0.3, num_splits=2, min_split_len=64, out=out, out_scale=scales)
    assert relative_error(out.float() * scales[:, :, None], ref) < 0.05  # e4m3: 3 mantissa bits


def test_prologue_in_decode_refuses_mismatched_rows():
    new, cache, tables, lens = step_inputs([20, 30], 4, 2, 32, False, seed=23)
    with pytest.raises(ValueError, match=r"slot_mapping must be \[2\] \(one per qkv row\), got \(1,\)"):
        decode_attention_qkv(NewToken(new.qkv, 4, new.positions, new.cos, new.sin, new.slot_mapping[:1]), cache,
                             tables, lens, 0.2)  # fmt: skip
    with pytest.raises(ValueError, match=r"qkv must be \[T, 320\] = \[T, \(6 \+ 2 \* 2\) \* 32\]"):
        decode_attention_qkv(dataclasses.replace(new, num_heads=6), cache, tables, lens, 0.2)
    with pytest.raises(ValueError, match=r"seq_lens must be \[2\]"):
        decode_attention_qkv(new, cache, tables, lens[:1], 0.2)


def test_decode_steps_take_the_prologue_inside_for_heads_without_qk_norms_over_a_16_bit_cache():
    """The backend's rule (measured: layers/attention_triton.py): inside decode attention without per-head q/k norms
    over a bf16/fp16/fp32 cache; as its own launch with them, or over an fp8 cache; a ``decode_prologue`` scope
    decides instead."""
    from graphserve.layers.attention_triton import decode_prologue, prologue_in_decode

    plain, cache, _, _ = step_inputs([8], 4, 2, 32, False, seed=24)
    normed, _, _, _ = step_inputs([8], 4, 2, 32, True, seed=25)
    fp8 = cache.to(FP8)
    assert prologue_in_decode(plain, cache) and not prologue_in_decode(normed, cache)
    assert not prologue_in_decode(plain, fp8) and not prologue_in_decode(normed, fp8)
    for fused in (True, False):
        with decode_prologue(fused):
            for c in (cache, fp8):
                assert prologue_in_decode(plain, c) is fused and prologue_in_decode(normed, c) is fused
