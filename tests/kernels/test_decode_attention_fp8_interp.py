"""Decode attention over an fp8 (e4m3) KV cache against the fp32 reference, on CPU through Triton's
interpreter: the default fp16 widening (q clamped to fp16 and the probabilities in fp16) with bf16 q,
as a model runs it, and the widening to q's own dtype kept for comparison; one split (direct store)
and several (merged in the kernel).

Tolerances: the reference reads the same fp8 values, widened exactly. The fp16 path rounds q and the
probabilities to 11 significant bits and the output to bf16 (2^-9 relative): 1e-2 normwise. The
fp32 path (q in fp32, IEEE dots) differs by summation order: 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import relative_error

# first: importing the kernel tests puts Triton under the interpreter when there is no GPU
from test_kernels_interp import DEVICE, paged_setup, randn

FP8 = torch.float8_e4m3fn

from graphserve.kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402


@pytest.mark.parametrize(("seq_lens", "num_splits"), [([5, 40, 17], 1), ([150, 70, 9], 3)])
def test_fp8_cache_fp16_widening_matches_reference(seq_lens: list[int], num_splits: int) -> None:
    gen = torch.Generator().manual_seed(11)
    cache, tables, lens = paged_setup(seq_lens, 2, 32, 16, gen)
    cache = cache.to(FP8)
    q = randn(len(seq_lens), 8, 32, gen=gen).to(torch.bfloat16)
    out = decode_attention(q, cache, tables, lens, 32**-0.5, num_splits=num_splits)
    assert out.dtype == torch.bfloat16 and out.device.type == DEVICE.type
    assert relative_error(out, decode_attention_reference(q, cache, tables, lens, 32**-0.5)) < 1e-2


def test_fp8_cache_widened_to_q_dtype_matches_reference() -> None:
    gen = torch.Generator().manual_seed(12)
    cache, tables, lens = paged_setup([90, 33], 2, 32, 16, gen)
    cache = cache.to(FP8)
    q = randn(2, 4, 32, gen=gen)
    out = decode_attention(q, cache, tables, lens, 0.2, num_splits=2, fp8_widen=torch.bfloat16)
    assert relative_error(out, decode_attention_reference(q, cache, tables, lens, 0.2)) < 1e-4


def test_fp8_widen_dtype_is_checked() -> None:
    gen = torch.Generator().manual_seed(13)
    cache, tables, lens = paged_setup([20], 1, 32, 16, gen)
    q = randn(1, 2, 32, gen=gen)
    with pytest.raises(ValueError, match="fp8_widen=torch.float32"):
        decode_attention(q, cache.to(FP8), tables, lens, 0.2, fp8_widen=torch.float32)


@pytest.mark.parametrize("batch", [4, 32])
def test_fp8_cache_at_its_own_launch_shapes(batch: int) -> None:
    """The launch shape and split count an fp8 cache picks with 8 kv heads (kernels/decode_attention.choose_tile):
    128-token steps at batch 4 (32 (sequence, kv head) pairs), the 2-warp 64-token tile at 3 splits at batch 32 (256
    pairs); contexts from 1 token to past a 128-token step, merged in the kernel."""
    from graphserve.kernels.decode_attention import DEFAULT_TILE, choose_num_splits, choose_tile

    gen = torch.Generator().manual_seed(14)
    seq_lens = [int(x) for x in torch.randint(1, 300, (batch,), generator=gen)]
    cache, tables, lens = paged_setup(seq_lens, 8, 32, 16, gen)
    cache = cache.to(FP8)
    assert choose_tile(batch, 8, True) != DEFAULT_TILE
    assert choose_num_splits(batch, 8, tables.shape[1] * 16, 132, True) > 1
    q = randn(batch, 16, 32, gen=gen).to(torch.bfloat16)
    out = decode_attention(q, cache, tables, lens, 32**-0.5)
    assert relative_error(out, decode_attention_reference(q, cache, tables, lens, 32**-0.5)) < 1e-2
