"""Decode attention writing its output quantized for an FP8 o_proj (``out_scale``), on CPU through Triton's
interpreter: the fp8 values and scales must be exactly those per_token_group_quant makes from the unquantized
output with one group per head (the split kernel rounds to q's dtype first, as the unquantized store does), in
the direct store and the in-kernel merge, over bf16 and fp8 caches, with row-major and column-major scales; and with
one scale per sequence (``out_scale`` [B, 1]) those of per_token_group_quant over the whole row, the kv heads' programs
meeting on a counter that the call leaves at zero."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

# first: importing the kernel tests puts Triton under the interpreter when there is no GPU
from test_decode_prologue_interp import step_inputs
from test_kernels_interp import DEVICE, paged_setup, randn

HEADS, KV_HEADS, D = 8, 2, 32

from graphserve.kernels.decode_attention import decode_attention, decode_attention_qkv  # noqa: E402
from graphserve.kernels.fp8_quant import FP8_DTYPE, per_token_group_quant  # noqa: E402


def cached_contexts(seq_lens: list[int], fp8_cache: bool, seed: int):
    """(generator, cache, block tables, lengths) of random contexts, the cache cast to fp8 for ``fp8_cache``."""
    gen = torch.Generator().manual_seed(seed)
    cache, tables, lens = paged_setup(seq_lens, KV_HEADS, D, 16, gen)
    return gen, cache.to(FP8_DTYPE) if fp8_cache else cache, tables, lens


@pytest.mark.parametrize(
    ("seq_lens", "num_splits", "fp8_cache", "column_major"),
    [
        ([5, 40, 17], 1, False, False),  # one split: the direct store quantizes
        ([150, 70, 9], 3, False, True),  # three splits: the last program's merge quantizes
        ([150, 0, 90], 3, True, False),  # an fp8 cache; a padding row of length 0 (zeros, smallest scale)
        ([33, 64], 1, True, True),
    ],
)
def test_quantized_output_equals_quantizing_the_output(seq_lens, num_splits, fp8_cache, column_major):
    gen, cache, tables, lens = cached_contexts(seq_lens, fp8_cache, seed=21)
    heads, d, b = HEADS, D, len(seq_lens)
    q = randn(b, heads, d, gen=gen).to(torch.bfloat16)
    plain = decode_attention(q, cache, tables, lens, d**-0.5, num_splits=num_splits)
    want_q, want_s = per_token_group_quant(plain.reshape(b, heads * d), d)

    out = torch.empty(b, heads * d, dtype=FP8_DTYPE, device=DEVICE)
    scales = torch.full((heads, b) if column_major else (b, heads), float("nan"), device=DEVICE)
    scales = scales.t() if column_major else scales
    decode_attention(q, cache, tables, lens, d**-0.5, num_splits=num_splits, out=out.view(b, heads, d),
                     out_scale=scales)  # fmt: skip
    assert torch.equal(out.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, want_s)


@pytest.mark.parametrize(
    ("seq_lens", "num_splits", "fp8_cache", "prologue"),
    [
        ([5, 40, 17], 1, False, False),  # one split: the kv heads' direct stores meet in the scratch row
        ([150, 70, 9], 3, False, False),  # three splits: each kv head's merging program stores, the last quantizes
        ([150, 0, 90], 3, True, False),  # an fp8 cache; a padding row of length 0 (zeros, smallest scale)
        ([70, 130, 3], 2, False, True),  # the attention prologue inside the kernel (decode_attention_qkv)
    ],
)
def test_one_scale_per_sequence_equals_quantizing_each_row(seq_lens, num_splits, fp8_cache, prologue):
    heads, d, b = HEADS, D, len(seq_lens)
    if prologue:
        new, cache, tables, lens = step_inputs(seq_lens, heads, KV_HEADS, d, True, seed=5)
        run = functools.partial(decode_attention_qkv, dataclasses.replace(new, qkv=new.qkv.to(torch.bfloat16)))
    else:
        gen, cache, tables, lens = cached_contexts(seq_lens, fp8_cache, seed=23)
        run = functools.partial(decode_attention, randn(b, heads, d, gen=gen).to(torch.bfloat16))
    plain = run(cache.clone(), tables, lens, d**-0.5, num_splits=num_splits)
    want_q, want_s = per_token_group_quant(plain.reshape(b, heads * d), heads * d)

    counters = torch.zeros(b + 2, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the counters come back to zero: a second call (the next layer, a replay) on the same ones
        out = torch.empty(b, heads * d, dtype=FP8_DTYPE, device=DEVICE)
        scales = torch.full((b, 1), float("nan"), device=DEVICE)
        run(cache.clone(), tables, lens, d**-0.5, num_splits=num_splits, out=out.view(b, heads, d), out_scale=scales,
            row_counters=counters)  # fmt: skip
        assert torch.equal(out.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scales, want_s)
        assert not counters.any()


def test_backend_writes_o_proj_input_per_token_where_it_can(monkeypatch):
    """TritonAttentionBackend.attend_quantized asked for the whole row as one group (a per-channel o_proj's
    per-token input): fp8 and scales equal to quantizing its unquantized decode output per row, its own row counters
    left at zero; None where the step has more sequences than it holds counters for, or for a group that is neither
    a head nor the row (the caller then runs the quantization launch)."""
    from test_kernels_interp import _batch, slots_of

    from graphserve.layers import attention_triton

    gen, cache, tables, lens = cached_contexts([40, 90, 17], False, seed=24)
    b, row = 3, HEADS * D
    slots = [slots_of(tables, i, range(n - 1, n), 16)[0] for i, n in enumerate(lens.tolist())]
    batch = _batch("decode", [1] * b, lens.tolist(), tables, cache, slots)
    q = randn(b, HEADS, D, gen=gen).to(torch.bfloat16)
    backend = attention_triton.TritonAttentionBackend()
    want_q, want_s = per_token_group_quant(backend.attend(q, 0, batch, D**-0.5).reshape(b, row), row)
    layout = {"pad_rows_to": 1, "scales_column_major": False}
    got_q, got_s = backend.attend_quantized(q, 0, batch, D**-0.5, group_size=row, **layout)
    assert got_s.shape == (b, 1)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_s, want_s)
    assert not backend.row_counters(DEVICE).any()
    assert backend.attend_quantized(q, 0, batch, D**-0.5, group_size=2 * D, **layout) is None
    monkeypatch.setattr(attention_triton, "ROW_COUNTERS", b - 1)
    assert backend.attend_quantized(q, 0, batch, D**-0.5, group_size=row, **layout) is None


def test_output_scale_groups_limits():
    """The one rule for which groups decode attention writes quantized (attend_quantized and benchmarks.fp8_route
    both ask it): a head's, or the row's within the kernel's width and the row counters; nothing else."""
    from graphserve.kernels.decode_attention import MAX_QUANT_ROW
    from graphserve.layers.attention_triton import ROW_COUNTERS, output_scale_groups

    assert output_scale_groups(32, 128, 128, 10**6) == 32  # one a head, at any batch
    assert output_scale_groups(32, 128, 4096, ROW_COUNTERS) == 1  # one a row, up to the counters
    assert output_scale_groups(32, 128, 4096, ROW_COUNTERS + 1) is None
    heads = MAX_QUANT_ROW // 128
    assert output_scale_groups(heads, 128, heads * 128, 1) == 1
    assert output_scale_groups(2 * heads, 128, 2 * heads * 128, 1) is None  # wider than the kernel quantizes a row
    assert output_scale_groups(1, 128, 128, 1) == 1  # a single head: its head's group
    assert output_scale_groups(32, 128, 256, 1) is None  # two heads a group: neither a head nor the row


def test_quantized_output_refusals_name_the_operand():
    gen = torch.Generator().manual_seed(22)
    cache, tables, lens = paged_setup([20, 30], 2, 32, 16, gen)
    q = randn(2, 4, 32, gen=gen).to(torch.bfloat16)
    scales = torch.empty(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"needs out fp8 \[>= 2, 4, 32\]"):
        decode_attention(q, cache, tables, lens, 0.2, out=torch.empty_like(q), out_scale=scales)
    out = torch.empty(2, 4, 32, dtype=FP8_DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match=r"out_scale must be float32 \[>= 2, 4\]"):
        decode_attention(q, cache, tables, lens, 0.2, out=out, out_scale=scales[:, :3])
    with pytest.raises(ValueError, match="fused_merge=True"):
        decode_attention(q, cache, tables, lens, 0.2, num_splits=2, out=out, out_scale=scales, fused_merge=False)
    row_scale = torch.empty(2, 1, device=DEVICE)
    with pytest.raises(ValueError, match=r"row_counters hold 1 torch.int32 on .*, need 2 contiguous int32"):
        decode_attention(q, cache, tables, lens, 0.2, out=out, out_scale=row_scale,
                         row_counters=torch.zeros(1, dtype=torch.int32, device=DEVICE))  # fmt: skip
    with pytest.raises(ValueError, match=r"row_counters hold 2 torch.int32 on .* \(stride \(2,\)\), need 2 contiguous"):
        decode_attention(q, cache, tables, lens, 0.2, out=out, out_scale=row_scale,
                         row_counters=torch.zeros(4, dtype=torch.int32, device=DEVICE)[::2])  # fmt: skip
    with pytest.raises(ValueError, match=r"row_workspace holds 10 torch.bfloat16 on .*, needs 256 contiguous"):
        decode_attention(q, cache, tables, lens, 0.2, out=out, out_scale=row_scale,
                         row_workspace=torch.empty(10, dtype=torch.bfloat16, device=DEVICE))  # fmt: skip
    with pytest.raises(ValueError, match=r"row_workspace holds 256 torch.bfloat16 on meta, needs 256 contiguous"):
        decode_attention(q, cache, tables, lens, 0.2, out=out, out_scale=row_scale,
                         row_workspace=torch.empty(256, dtype=torch.bfloat16, device="meta"))  # fmt: skip
    spread = torch.empty(2, 4, 64, dtype=FP8_DTYPE, device=DEVICE)[:, :, :32]
    with pytest.raises(ValueError, match=r"needs out's heads side by side \(stride 32 along heads\), got strides \(256, 64, 1\)"):
        decode_attention(q, cache, tables, lens, 0.2, out=spread, out_scale=row_scale)
