"""The FP8 kernels against their PyTorch references, through Triton's interpreter.

Tiny shapes whose M, N and K are not multiples of the tiles; fresh random inputs; outputs poisoned
with NaN first. Both sides compute from the same fp8 operands, so they differ only by fp32
summation order (the matmuls) or not at all (quantization). The bf16, model-shape and CUDA-graph
versions live in tests/gpu/test_fp8.py.
"""

from __future__ import annotations

import torch
from interp_setup import use_interpreter
from paged_utils import shuffled_tables

use_interpreter()

import pytest  # noqa: E402

from graphserve.kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from graphserve.kernels.extend_attention import extend_attention, extend_attention_reference  # noqa: E402
from graphserve.kernels.fp8_gemm import w8a8_matmul, w8a8_matmul_reference  # noqa: E402
from graphserve.kernels.fp8_gemv import fp8_gemv  # noqa: E402
from graphserve.kernels.fp8_quant import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    dequantize_blocks,
    per_token_group_quant,
    per_token_group_quant_reference,
    quantize_weight_blocks,
    quantize_weight_channels,
)
from graphserve.kernels.fp8_reference import fp8_gemv_reference  # noqa: E402
from graphserve.kernels.kv_write import kv_write, kv_write_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("m,k,group", [(3, 80, 32), (5, 64, 64), (2, 40, 40)])
def test_token_group_quant_matches_reference(m: int, k: int, group: int) -> None:
    x = _randn(m, k, seed=m + k) * 3.0
    x[0, :group] = 0.0  # an all-zero group quantizes to zeros with a finite scale
    q, s = per_token_group_quant(x, group)
    q_ref, s_ref = per_token_group_quant_reference(x, group)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    got, want = q.float(), q_ref.float()
    if DEVICE.type == "cpu":
        # Triton 3.6's interpreter drops the carry when rounding to e4m3 crosses a power of two
        # (126.3 -> 64 instead of 128); compiled kernels convert in hardware. Only those elements
        # may differ here, and only by that factor of two.
        carry = (got != want) & (want.abs().log2() == want.abs().log2().round()) & (got == want / 2)
        got = torch.where(carry, want, got)
    # x / scale can land on a rounding tie; the two sides may then round one ulp (2^-3) apart
    torch.testing.assert_close(got, want, rtol=0.07, atol=0)
    assert s[0, 0] > 0 and q[0, :group].float().abs().max() == 0
    assert q.float().abs().max() <= FP8_MAX
    # and the round trip is e4m3-accurate: 3 mantissa bits, relative step 2^-3 at most
    back = dequantize_blocks(q_ref, s_ref, 1, group)
    assert ((back - x).abs() <= x.abs() * 0.0625 + s.repeat_interleave(group, 1)[:, :k] * 2**-9).all()


@pytest.mark.parametrize("m,n,k,group_n,group_k", [(5, 40, 96, 32, 32), (17, 70, 64, 32, 32), (3, 24, 48, 1, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_matmul_matches_reference(m: int, n: int, k: int, group_n: int, group_k: int, bias: bool) -> None:
    a_q, a_s = per_token_group_quant(_randn(m, k, seed=1), group_k)
    w = _randn(n, k, seed=2) * 0.05
    w_q, w_s = quantize_weight_blocks(w, group_n, group_k) if group_n > 1 else quantize_weight_channels(w)
    w_s = w_s.reshape(w_s.shape[0], -1)
    b = _randn(n, seed=3) if bias else None
    out = w8a8_matmul(a_q, a_s, w_q, w_s, group_n, group_k, torch.float32, b)
    ref = w8a8_matmul_reference(a_q, a_s, w_q, w_s, group_n, group_k, torch.float32, b)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("m,n,k,group_n,group_k", [(1, 40, 64, 32, 32), (6, 33, 96, 16, 32), (4, 20, 48, 1, 48)])
def test_fp8_gemv_matches_reference(m: int, n: int, k: int, group_n: int, group_k: int) -> None:
    x = _randn(m, k, seed=4)
    w = _randn(n, k, seed=5) * 0.05
    w_q, w_s = quantize_weight_blocks(w, group_n, group_k) if group_n > 1 else quantize_weight_channels(w)
    w_s = w_s.reshape(w_s.shape[0], -1)
    out = fp8_gemv(x, w_q, w_s, group_n, group_k, bias=_randn(n, seed=6))
    ref = fp8_gemv_reference(x, w_q, w_s, group_n, group_k, bias=_randn(n, seed=6))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_block_quantization_round_trip() -> None:
    """Partial edge tiles get their own scale; dequantizing is e4m3-accurate per tile."""
    w = _randn(70, 50, seed=7)
    q, s = quantize_weight_blocks(w, 32, 32)
    assert s.shape == (3, 2) and q.dtype == torch.float8_e4m3fn
    back = dequantize_blocks(q, s, 32, 32)
    tile_scale = s.repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)[:, :50]
    assert ((back - w).abs() <= w.abs() * 0.0625 + tile_scale * 2**-9).all()


# ---- FP8 KV cache: the attention kernels widen fp8 K/V as they load them -------------------------


def _fp8_paged(seq_lens: list[int], kv_heads: int, head_dim: int, page: int, seed: int):
    """An fp8 cache of random K/V and block tables handing out shuffled blocks (never block 0)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, tables = shuffled_tables(seq_lens, page, gen)
    cache = (torch.randn(2, num_blocks, page, kv_heads, head_dim, generator=gen) * 2).to(FP8_DTYPE).to(DEVICE)
    return cache, tables.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def test_kv_write_into_an_fp8_cache():
    # values already on the e4m3 grid, so the cast is exact on every backend (see the carry note above)
    k, v = (_randn(5, 2, 32, seed=s).to(FP8_DTYPE).float() for s in (11, 12))
    cache = torch.zeros(2, 6, 16, 2, 32, dtype=FP8_DTYPE, device=DEVICE)
    ref = cache.clone()
    slots = torch.tensor([17, 3, 95, 40, 0], device=DEVICE)
    kv_write(k, v, cache, slots)
    kv_write_reference(k, v, ref, slots)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    flat = cache.view(2, -1, 2, 32)
    assert torch.equal(flat[0, slots].float(), k) and torch.equal(flat[1, slots].float(), v)


@pytest.mark.parametrize("seq_lens,splits", [([5, 40, 17], None), ([150, 9], 3)])
def test_decode_attention_reads_an_fp8_cache(seq_lens: list[int], splits: int | None):
    cache, tables, lens = _fp8_paged(seq_lens, 2, 32, 16, seed=13)
    q = _randn(len(seq_lens), 4, 32, seed=14)
    out = decode_attention(q, cache, tables, lens, 32**-0.5, num_splits=splits)
    torch.testing.assert_close(out, decode_attention_reference(q, cache, tables, lens, 32**-0.5),
                               rtol=1e-4, atol=1e-5)


def test_extend_attention_reads_an_fp8_cache():
    seq_lens = [20, 37]  # a whole prefill of 20, then 5 new tokens after 32 cached
    cache, tables, lens = _fp8_paged(seq_lens, 2, 32, 16, seed=15)
    starts = torch.tensor([0, 20, 25], dtype=torch.int32, device=DEVICE)
    q = _randn(25, 4, 32, seed=16)
    out = extend_attention(q, cache, tables, lens, starts, 20, 0.25)
    torch.testing.assert_close(out, extend_attention_reference(q, cache, tables, lens, starts, 0.25),
                               rtol=1e-4, atol=1e-5)


def test_every_fp8_kv_write_saturates_where_the_pytorch_write_does():
    """K/V past e4m3's largest finite value (448) are stored as +-448 by the Triton writes (kv_write, the fused
    rotary prologue, decode attention's new-token write), as by the PyTorch reference: clamped before the cast,
    so compiled and interpreted kernels agree (the interpreter's bare cast wraps such values)."""
    from graphserve.kernels.decode_attention import NewToken, decode_attention_qkv
    from graphserve.kernels.qk_rope_kv import qk_norm_rope_kv_write

    heads, kv_heads, d = 4, 2, 32
    k = torch.tensor([1000.0, -600.0, 449.5, 3.0]).repeat(kv_heads * d // 4).view(1, kv_heads, d).to(DEVICE)
    cache, ref = (torch.zeros(2, 4, 16, kv_heads, d, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2))
    slots = torch.tensor([21], device=DEVICE)
    kv_write(k, -k, cache, slots)
    kv_write_reference(k, -k, ref, slots)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    assert cache.view(2, -1, kv_heads, d)[0, 21, 0, :4].float().tolist() == [448.0, -448.0, 448.0, 3.0]
    # rotary at position 0 is the identity, so K and V reach the cache as the qkv row holds them
    qkv = torch.cat((torch.ones(1, heads * d, device=DEVICE), k.view(1, -1), -k.view(1, -1)), dim=1)
    cos = torch.ones(8, d // 2, device=DEVICE)
    sin = torch.zeros(8, d // 2, device=DEVICE)
    positions = torch.zeros(1, dtype=torch.long, device=DEVICE)
    fused = torch.zeros_like(ref)
    qk_norm_rope_kv_write(qkv, positions, cos, sin, fused, slots, heads, kv_heads, d)
    assert torch.equal(fused.view(torch.uint8), ref.view(torch.uint8))
    new = torch.zeros_like(ref)
    tables = torch.tensor([[1]], dtype=torch.int32, device=DEVICE)  # position 0: block 1, offset 0 = slot 16
    token = NewToken(qkv, heads, positions, cos, sin, torch.tensor([16], device=DEVICE))
    out = decode_attention_qkv(token, new, tables, torch.tensor([1], dtype=torch.int32, device=DEVICE), d**-0.5)
    written = new.view(2, -1, kv_heads, d)[:, 16]
    assert torch.equal(written.view(torch.uint8), ref.view(2, -1, kv_heads, d)[:, 21].view(torch.uint8))
    assert torch.isfinite(out).all()
