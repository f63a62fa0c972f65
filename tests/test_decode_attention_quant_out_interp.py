"""Decode attention writing its output quantized for an FP8 o_proj (``out_scale``), on CPU through Triton's
interpreter: the fp8 values and scales must be exactly those per_token_group_quant makes from the unquantized
output with one group per head (the split kernel rounds to q's dtype first, as the unquantized store does), in
the direct store and the in-kernel merge, over bf16 and fp8 caches, with row-major and column-major scales."""

from __future__ import annotations

import pytest
import torch

# first: importing the kernel tests puts Triton under the interpreter when there is no GPU
from tests.test_kernels_interp import DEVICE, paged_setup, randn

HEADS, KV_HEADS, D = 8, 2, 32

from graphserve.kernels.decode_attention import decode_attention  # noqa: E402
from graphserve.kernels.fp8_quant import FP8_DTYPE, per_token_group_quant  # noqa: E402


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
    gen = torch.Generator().manual_seed(21)
    heads, kv_heads, d = HEADS, KV_HEADS, D
    cache, tables, lens = paged_setup(seq_lens, kv_heads, d, 16, gen)
    if fp8_cache:
        cache = cache.to(FP8_DTYPE)
    b = len(seq_lens)
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
