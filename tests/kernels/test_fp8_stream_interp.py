"""The FP8 streaming gemv (both inner products, block and per-channel scales, tiles wider and narrower
than a scale block), the padded / column-major activation quantization, and the routing table, on
CPU through Triton's interpreter. Fresh random inputs at tiny shapes whose N and K are not multiples
of the tiles; outputs compared with the dequantize-then-matmul references.

Tolerances: the FMA path and the references multiply the same fp8 weights and fp32 scales in fp32,
so they differ by summation order only (1e-5). The dot path rounds the scaled x to bf16 before the
tensor cores, as its docstring says: 2^-9 relative per element, 1e-2 normwise leaves room and a
wrong scale block or a missed tile gives errors of order 1.
"""

from __future__ import annotations

import dataclasses
import json

import torch
from interp_setup import use_interpreter
from model_utils import relative_error

use_interpreter()

import pytest  # noqa: E402

from graphserve.kernels import fp8_config  # noqa: E402
from graphserve.kernels.activation import silu_and_mul  # noqa: E402
from graphserve.kernels.fp8_config import (  # noqa: E402
    Fp8Rule,
    Route,
    StreamConfig,
    choose_route,
    default_stream_config,
    tile_cap,
)
from graphserve.kernels.fp8_gemm import w8a8_matmul, w8a8_matmul_reference  # noqa: E402
from graphserve.kernels.fp8_gemv import (  # noqa: E402
    fp8_gemv,
    fp8_gemv_a8,
    fp8_norm_gemv,
    fp8_silu_mul_gemv,
)
from graphserve.kernels.fp8_quant import (  # noqa: E402
    dequantize_blocks,
    norm_group_quant,
    norm_group_quant_keep,
    per_token_group_quant,
    per_token_group_quant_reference,
    quantize_weight_blocks,
    quantize_weight_channels,
    silu_mul_group_quant,
)
from graphserve.kernels.fp8_reference import (  # noqa: E402
    fp8_gemv_reference,
    fp8_norm_gemv_reference,
    fp8_silu_mul_gemv_reference,
)
from graphserve.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_reference, rms_norm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FMA = StreamConfig(block_n=8, block_k=64, num_warps=4, num_stages=2, use_dot=False)
FMA_WIDE = StreamConfig(block_n=4, block_k=128, num_warps=4, num_stages=2, use_dot=False)
DOT = StreamConfig(block_n=16, block_k=64, num_warps=4, num_stages=2, use_dot=True)
# Triton 3.6's interpreter returns garbage from tl.dot on bf16 operands (fp16 ones are right); the
# dot path is the same code for both 16-bit types, so the interpreter checks it in fp16
DOT_DTYPE = torch.float16 if DEVICE.type == "cpu" else torch.bfloat16


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _weight(n: int, k: int, group_n: int, group_k: int, seed: int):
    w = _randn(n, k, seed=seed) * 0.05
    if group_n == 1 and group_k >= k:
        q, s = quantize_weight_channels(w)
        return q, s.reshape(-1, 1)
    return quantize_weight_blocks(w, group_n, group_k)


# (m, n, k, group_n, group_k): scale blocks shorter than a tile along K (32 < 64), longer (128 > 64),
# as short as the smallest (16), K with a tail, per-channel scales
CASES = [(1, 40, 96, 16, 32), (3, 37, 200, 32, 128), (5, 33, 160, 16, 16), (2, 24, 72, 1, 72)]


@pytest.mark.parametrize("m,n,k,group_n,group_k", CASES)
@pytest.mark.parametrize("cfg", [FMA, FMA_WIDE], ids=["fma", "fma_wide"])
def test_stream_fma_matches_reference(m, n, k, group_n, group_k, cfg) -> None:
    wq, ws = _weight(n, k, group_n, group_k, seed=m + n)
    if cfg.block_n > tile_cap(group_n, group_k, k):
        cfg = StreamConfig(tile_cap(group_n, group_k, k), cfg.block_k, 4, 2, False)
    x = _randn(m, k, seed=k)
    bias = _randn(n, seed=7)
    out = fp8_gemv(x, wq, ws, group_n, group_k, bias, config=cfg)
    torch.testing.assert_close(out, fp8_gemv_reference(x, wq, ws, group_n, group_k, bias), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("m,n,k,group_n,group_k,split", [
    (5, 40, 96, 16, 32, 1), (16, 37, 200, 32, 128, 1), (7, 24, 72, 1, 72, 1),
    (17, 40, 96, 16, 32, 1), (33, 37, 200, 32, 128, 2), (64, 24, 128, 1, 128, 2),  # 32- and 64-row dot tiles
])
def test_stream_dot_matches_reference(m, n, k, group_n, group_k, split) -> None:
    wq, ws = _weight(n, k, group_n, group_k, seed=m + n)
    x = _randn(m, k, seed=k).to(DOT_DTYPE)
    out = fp8_gemv(x, wq, ws, group_n, group_k, config=dataclasses.replace(DOT, split_k=split))
    assert out.dtype == DOT_DTYPE
    assert relative_error(out, fp8_gemv_reference(x.float(), wq, ws, group_n, group_k)) < 1e-2


def _quantized_x(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the FP8-dot path multiplies it: quantized per row and ``group`` columns, then dequantized."""
    q, scales = per_token_group_quant_reference(x, group)
    return dequantize_blocks(q, scales, 1, group)


@pytest.mark.parametrize("m,n,k,group_n,group_k,block_k,split", [
    (1, 40, 96, 16, 32, 32, 1),  # one row; K not a whole number of splits' tiles
    (5, 37, 200, 32, 64, 64, 2),  # N and K tails, split K
    (40, 24, 128, 16, 32, 32, 2),  # a 64-row tile
    (7, 24, 72, 1, 72, 32, 1),  # per-channel scales: groups of block_k, K tail
])
@pytest.mark.parametrize("block_n", [16, 64])  # 64: a tile across two or more scale blocks (8-32 rows tall)
def test_stream_fp8_dot_matches_the_quantized_reference(m, n, k, group_n, group_k, block_k, split, block_n) -> None:
    """The FP8-dot path against the reference on x quantized the same way. On the GPU they differ by
    summation order and the output's rounding (tests/gpu/test_fp8.py holds them to that); the interpreter
    rounds fp32 to e4m3 its own way (tests/kernels/test_fp8_interp.py: elements off by up to one binade), so here
    the bound is the size of x's quantization error, which a wrong scale or a missed K step exceeds."""
    wq, ws = _weight(n, k, group_n, group_k, seed=m + k)
    x = _randn(m, k, seed=n).to(DOT_DTYPE)
    cfg = StreamConfig(block_n, block_k, 4, 2, True, split_k=split, fp8_dot=True)
    out = fp8_gemv(x, wq, ws, group_n, group_k, config=cfg)
    want = fp8_gemv_reference(_quantized_x(x.float(), block_k), wq, ws, group_n, group_k)
    assert out.dtype == DOT_DTYPE
    assert relative_error(out, want) < 0.1
    assert relative_error(out, fp8_gemv_reference(x.float(), wq, ws, group_n, group_k)) < 0.1


@pytest.mark.parametrize("split,block_n", [(1, 16), (2, 16), (1, 64)])
def test_stream_fp8_dot_is_exact_where_x_quantizes_exactly(split, block_n) -> None:
    """x whose every row and K step holds e4m3 values times one power of two, with 448 (e4m3's largest) among
    them: the step's scale is that power of two and quantizing x loses nothing, whatever the rounding. The
    FP8-dot path must then give the unquantized reference up to summation order and the output's rounding,
    also in tiles 64 rows tall across four 16-row scale blocks."""
    m, n, k, group = 5, 40, 128, 32
    wq, ws = _weight(n, k, 16, group, seed=41)
    levels = (_randn(m, k, seed=42) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    levels[:, ::group] = 448.0
    x = (levels * 2.0**-6).to(DOT_DTYPE)
    cfg = StreamConfig(block_n, group, 4, 2, True, split_k=split, fp8_dot=True)
    out = fp8_gemv(x, wq, ws, 16, group, config=cfg)
    torch.testing.assert_close(out.float(), fp8_gemv_reference(x.float(), wq, ws, 16, group).float(),
                               rtol=2e-3, atol=2e-3)


def test_stream_fp8_dot_prologues_match_reference() -> None:
    m, n, k, group = 6, 40, 96, 32
    cfg = StreamConfig(16, group, 4, 2, True, fp8_dot=True)
    wq, ws = _weight(n, k, 16, group, seed=31)
    x, res, nw = _randn(m, k, seed=32).to(DOT_DTYPE), _randn(m, k, seed=33).to(DOT_DTYPE), _randn(k, seed=34).to(DOT_DTYPE)
    out, summed = fp8_norm_gemv(x, nw, 1e-6, wq, ws, 16, group, residual=res, config=cfg)
    h, want_sum = fused_add_rms_norm_reference(x, res, nw, 1e-6)
    want = fp8_gemv_reference(_quantized_x(h.float(), group), wq, ws, 16, group)
    assert relative_error(out, want) < 0.1  # the interpreter's e4m3 rounding (above)
    torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)
    gate_up = _randn(m, 2 * k, seed=35).to(DOT_DTYPE)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).to(DOT_DTYPE)
    want = fp8_gemv_reference(_quantized_x(act.float(), group), wq, ws, 16, group)
    assert relative_error(fp8_silu_mul_gemv(gate_up, wq, ws, 16, group, config=cfg), want) < 0.1


def test_stream_fp8_dot_refuses_a_step_across_scale_blocks() -> None:
    wq, ws = _weight(32, 128, 16, 32, seed=36)
    with pytest.raises(ValueError, match="block_k equal to the scale block's 32 \\(got 64\\)"):
        fp8_gemv(_randn(4, 128, seed=37), wq, ws, 16, 32, config=StreamConfig(16, 64, 4, 2, True, fp8_dot=True))


@pytest.mark.parametrize("m,n,k,group_n,group_k,block_k,split,block_n", [
    (1, 40, 96, 16, 32, 32, 1, 16),  # one row, N tail
    (5, 37, 200, 32, 64, 64, 2, 64),  # N and K tails, split K, a tile across scale blocks
    (40, 24, 128, 16, 32, 32, 2, 16),  # a 64-row tile
    (7, 24, 72, 1, 72, 32, 1, 16),  # per-channel scales: x in groups of block_k, K tail
])
@pytest.mark.parametrize("column_major", [False, True])
def test_stream_a8_matches_the_w8a8_reference(m, n, k, group_n, group_k, block_k, split, block_n, column_major) -> None:
    """The FP8 dot on x quantized before the call: both operands are the same fp8 values and fp32 scales as
    the W8A8 reference multiplies, so only summation order differs (fp32 out: 1e-5 relative)."""
    wq, ws = _weight(n, k, group_n, group_k, seed=m + k + 1)
    x = _randn(m, k, seed=n + 1)
    q, scales = per_token_group_quant(x, block_k, scales_column_major=column_major)
    cfg = StreamConfig(block_n, block_k, 4, 2, True, split_k=split, fp8_dot=True, a8=True)
    out = fp8_gemv_a8(q, scales, wq, ws, group_n, group_k, torch.float32, config=cfg)
    want = fp8_gemv_reference(dequantize_blocks(q, scales, 1, block_k), wq, ws, group_n, group_k)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,n,k,block_k,split,block_n", [
    (1, 40, 96, 32, 1, 16),  # one row, N tail
    (5, 37, 200, 64, 2, 64),  # N and K tails, split K
    (40, 24, 128, 32, 2, 16),  # a 64-row tile
    (64, 40, 1024, 256, 2, 32),  # a step of two 128-column blocks (the sweep's per-channel wide steps)
])
def test_stream_a8_per_token_x_takes_the_scales_after_one_dot_chain(m, n, k, block_k, split, block_n) -> None:
    """Per-channel weights with x quantized per token (``x_scale`` [M, 1]): the kernel accumulates every K
    step unscaled and multiplies both scales once; the W8A8 reference multiplies the same fp8 values and
    scales, so only summation order differs."""
    wq, ws = _weight(n, k, 1, k, seed=m + n)
    q, scales = per_token_group_quant(_randn(m, k, seed=k + 3), k)
    assert scales.shape == (m, 1)
    cfg = StreamConfig(block_n, block_k, 4, 2, True, split_k=split, fp8_dot=True, a8=True)
    out = fp8_gemv_a8(q, scales, wq, ws, 1, k, torch.float32, config=cfg)
    want = fp8_gemv_reference(dequantize_blocks(q, scales, 1, k), wq, ws, 1, k)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    # one scale a row is per-channel only: block scales vary along K and need x's groups to match them
    bq, bs = _weight(n, k, 16, block_k, seed=m)
    with pytest.raises(ValueError, match=r"one per row and \d+ columns\), got"):
        fp8_gemv_a8(q, scales, bq, bs, 16, block_k, torch.float32, config=cfg)


def test_per_channel_weights_route_their_decode_rows_to_the_per_token_fp8_dot() -> None:
    """Without a measured table, per-channel weights at 2-64 rows take the streaming FP8 dot on x quantized
    per token (one launch before, fused with the norm or SiLU·mul), one row the widening FMA tiles; block
    scales keep the widening tiles up to 8 rows and the W8A8 GEMMs above."""
    for m in (2, 8, 9, 32, 64):
        route = fp8_config.default_route(m, 4096, 14336, 1, 14336, False, 132)
        assert route.path == "stream" and route.config.a8 and route.config.fp8_dot and route.config.block_k == 128
        route.config.validate()
        block = fp8_config.default_route(m, 4096, 14336, 128, 128, False, 132)
        assert block.path == "w8a8" if m > 8 else not block.config.a8
    assert fp8_config.default_route(65, 4096, 4096, 1, 4096, False, 132).path == "w8a8"
    assert not fp8_config.default_route(1, 4096, 4096, 1, 4096, False, 132).config.use_dot


def test_stream_a8_refuses_what_it_cannot_run() -> None:
    wq, ws = _weight(32, 128, 16, 32, seed=38)
    q, s = per_token_group_quant(_randn(4, 128, seed=39), 32)
    a8 = StreamConfig(16, 32, 4, 2, True, fp8_dot=True, a8=True)
    with pytest.raises(ValueError, match="are for fp8 x"):
        fp8_gemv(_randn(4, 128, seed=39), wq, ws, 16, 32, config=a8)
    with pytest.raises(ValueError, match="are for bf16 x"):
        fp8_gemv_a8(q, s, wq, ws, 16, 32, torch.float32, config=dataclasses.replace(a8, a8=False))
    with pytest.raises(ValueError, match=r"x_scale \[>= 4, 4\] \(one per row and 32 columns\), got \(4, 2\)"):
        fp8_gemv_a8(q, s[:, :2], wq, ws, 16, 32, torch.float32, config=a8)
    with pytest.raises(ValueError, match="x one of"):
        fp8_gemv_a8(q.float(), s, wq, ws, 16, 32, torch.float32, config=a8)


@pytest.mark.parametrize("m,k,group,pad", [(3, 96, 32, 4), (5, 200, 64, 1), (2, 72, 72, 1)])
def test_prologue_quant_matches_the_separate_launches(m, k, group, pad) -> None:
    """SiLU·mul + quantization and (residual add +) RMSNorm + quantization in one launch, against the
    separate silu_and_mul / rms_norm / fused_add_rms_norm kernels then per_token_group_quant (whose own test
    is above): the prologue rounds as those kernels do, so both give the same fp8 values and scales, bit for
    bit; the residual sum is exact and padding rows are zero."""
    dtype = torch.bfloat16
    gate_up = _randn(m, 2 * k, seed=k + 1).to(dtype)
    cases = [(silu_mul_group_quant(gate_up, group, pad_rows_to=pad), silu_and_mul(gate_up), None, None)]
    x, res, nw = _randn(m, k, seed=k + 2).to(dtype), _randn(m, k, seed=k + 3).to(dtype), _randn(k, seed=k + 4).to(dtype)
    q, s, summed = norm_group_quant(x, nw, 1e-6, group, pad_rows_to=pad, scales_column_major=True)
    cases.append(((q, s), rms_norm(x, nw, 1e-6), summed, None))
    q, s, summed = norm_group_quant(x, nw, 1e-6, group, res, pad_rows_to=pad)
    h, want_sum = fused_add_rms_norm(x, res, nw, 1e-6)
    cases.append(((q, s), h, summed, want_sum))
    rows = -(-m // pad) * pad
    for (q, s), made, summed, want_sum in cases:
        q_ref, s_ref = per_token_group_quant(made, group, pad_rows_to=pad)
        assert q.shape == (rows, k) and s.shape == (rows, -(-k // group))
        torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
        torch.testing.assert_close(q.float(), q_ref.float(), rtol=0, atol=0)
        assert rows == m or q[m:].float().abs().max().item() == 0
        if want_sum is None:
            assert summed is None
        else:
            torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)


@pytest.mark.parametrize("m,k,group", [(3, 96, 32), (5, 200, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_quant_keeping_the_normed_rows_matches_the_separate_launches(m, k, group, with_residual) -> None:
    """norm_group_quant_keep: the normed rows it writes are rms_norm's / fused_add_rms_norm's bit for bit, and
    its fp8 values, scales and residual sum are norm_group_quant's."""
    dtype = torch.bfloat16
    x, res, nw = _randn(m, k, seed=k + 5).to(dtype), _randn(m, k, seed=k + 6).to(dtype), _randn(k, seed=k + 7).to(dtype)
    residual = res if with_residual else None
    normed, q, s, summed = norm_group_quant_keep(x, nw, 1e-6, group, residual)
    q_ref, s_ref, summed_ref = norm_group_quant(x, nw, 1e-6, group, residual)
    want = fused_add_rms_norm(x, res, nw, 1e-6)[0] if with_residual else rms_norm(x, nw, 1e-6)
    assert normed.dtype == dtype and normed.shape == (m, k)
    torch.testing.assert_close(normed, want, rtol=0, atol=0)
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=0, atol=0)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    if with_residual:
        torch.testing.assert_close(summed, summed_ref, rtol=0, atol=0)
    else:
        assert summed is None and summed_ref is None


@pytest.mark.parametrize("cfg", [FMA, DOT], ids=["fma", "dot"])
@pytest.mark.parametrize("group_n,group_k", [(16, 32), (1, 96)])
def test_stream_fused_prologues_match_reference(cfg, group_n, group_k) -> None:
    """SiLU·mul and (residual add +) RMSNorm computed in the loads, as kernels/gemv.py's fused kinds."""
    m, n, k = (3, 40, 96) if not cfg.use_dot else (6, 40, 96)
    dtype = DOT_DTYPE if cfg.use_dot else torch.float32
    tol = {"rtol": 1e-4, "atol": 1e-5} if not cfg.use_dot else {"rtol": 2e-2, "atol": 2e-2}
    wq, ws = _weight(n, k, group_n, group_k, seed=21)
    gate_up = _randn(m, 2 * k, seed=22).to(dtype)
    torch.testing.assert_close(fp8_silu_mul_gemv(gate_up, wq, ws, group_n, group_k, config=cfg).float(),
                               fp8_silu_mul_gemv_reference(gate_up, wq, ws, group_n, group_k).float(), **tol)
    x, res, nw = _randn(m, k, seed=23).to(dtype), _randn(m, k, seed=24).to(dtype), _randn(k, seed=25).to(dtype)
    for residual in (None, res):
        out, summed = fp8_norm_gemv(x, nw, 1e-6, wq, ws, group_n, group_k, residual=residual, config=cfg)
        want, want_sum = fp8_norm_gemv_reference(x, nw, 1e-6, wq, ws, group_n, group_k, residual=residual)
        torch.testing.assert_close(out.float(), want.float(), **tol)
        if residual is None:
            assert summed is None
        else:
            torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [FMA, DOT, dataclasses.replace(FMA, split_k=2), dataclasses.replace(DOT, split_k=2)],
                         ids=["fma", "dot", "fma-split2", "dot-split2"])
def test_stream_norm_prologue_rows_of_any_scale(cfg) -> None:
    """Rows whose RMS is far from 1 and differs row to row (random rows have RMS near 1, where a lost or
    misplaced rstd goes unseen), whole and split along K: the prologue equals norm-then-matmul."""
    m, n, k = (3, 40, 128) if not cfg.use_dot else (6, 40, 128)
    dtype = DOT_DTYPE if cfg.use_dot else torch.float32
    tol = {"rtol": 1e-4, "atol": 1e-5} if not cfg.use_dot else {"rtol": 2e-2, "atol": 2e-2}
    wq, ws = _weight(n, k, 16, 32, seed=41)
    row_scale = torch.tensor([30.0, 0.05, 4.0, 200.0, 0.5, 9.0][:m], device=DEVICE)[:, None]
    x = (_randn(m, k, seed=42) * row_scale).to(dtype)
    res = (_randn(m, k, seed=43) * row_scale).to(dtype)
    nw = (_randn(k, seed=44) + 1.0).to(dtype)
    for residual in (None, res):
        out, summed = fp8_norm_gemv(x, nw, 1e-6, wq, ws, 16, 32, residual=residual, config=cfg)
        want, want_sum = fp8_norm_gemv_reference(x, nw, 1e-6, wq, ws, 16, 32, residual=residual)
        torch.testing.assert_close(out.float(), want.float(), **tol)
        if residual is not None:
            torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)


def test_stream_default_config_matches_reference() -> None:
    wq, ws = _weight(50, 256, 16, 128, seed=3)
    x = _randn(4, 256, seed=4)
    torch.testing.assert_close(fp8_gemv(x, wq, ws, 16, 128), fp8_gemv_reference(x, wq, ws, 16, 128),
                               rtol=1e-4, atol=1e-5)


def test_stream_bad_inputs_name_the_limit() -> None:
    wq, ws = _weight(32, 64, 16, 32, seed=5)
    with pytest.raises(ValueError, match="at most 64 rows, got 65"):
        fp8_gemv(_randn(65, 64, seed=1), wq, ws, 16, 32)
    with pytest.raises(ValueError, match="17 rows take the dot path"):
        fp8_gemv(_randn(17, 64, seed=1), wq, ws, 16, 32, config=FMA)
    with pytest.raises(ValueError, match=r"w_scale has shape \(2, 2\), expected \(4, 2\)"):
        fp8_gemv(_randn(2, 64, seed=1), wq, ws, 8, 32)
    with pytest.raises(ValueError, match="block_n=32 spans two rows of 16-row scale blocks"):
        fp8_gemv(_randn(2, 64, seed=1), wq, ws, 16, 32, config=StreamConfig(32, 64, 4, 2, False))
    with pytest.raises(ValueError, match="w must be torch.float8_e4m3fn"):
        fp8_gemv(_randn(2, 64, seed=1), wq.float(), ws, 16, 32)


@pytest.mark.parametrize("m,k,group,pad", [(3, 80, 32, 4), (5, 64, 64, 1), (6, 300, 16, 4)])
def test_token_group_quant_padded_column_major(m, k, group, pad) -> None:
    x = _randn(m, k, seed=m * k) * 2.0
    q, s = per_token_group_quant(x, group, pad_rows_to=pad, scales_column_major=True)
    rows = -(-m // pad) * pad
    assert q.shape == (rows, k) and s.shape == (rows, -(-k // group)) and s.stride(0) == 1
    q_ref, s_ref = per_token_group_quant_reference(x, group)
    torch.testing.assert_close(s[:m], s_ref, rtol=1e-6, atol=0)
    # the interpreter's e4m3 rounding may drop a carry (tests/kernels/test_fp8_interp.py): compare dequantized
    back, want = q[:m].float() * s[:m].repeat_interleave(group, 1)[:, :k], q_ref.float() * s_ref.repeat_interleave(
        group, 1)[:, :k]
    assert relative_error(back, want) < 0.05
    assert q[m:].float().abs().max().item() == 0 if rows > m else True
    # the W8A8 GEMM reads column-major scales too
    wq, ws = quantize_weight_blocks(_randn(24, k, seed=9) * 0.05, 8, group)
    out = w8a8_matmul(q, s, wq, ws, 8, group, torch.float32)
    torch.testing.assert_close(out, w8a8_matmul_reference(q, s, wq, ws, 8, group, torch.float32), rtol=1e-4, atol=1e-5)


# ---- routing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("sms", [132, 78])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 17, 64])
def test_default_tiles_fill_the_gpu_and_respect_scale_blocks(sms, m) -> None:
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (2048, 4096), (5120, 2048)]:
        for group_n, group_k in [(128, 128), (1, k)]:
            cap = tile_cap(group_n, group_k, k)
            cfg = default_stream_config(m, n, k, cap, sms)
            assert cfg.num_programs(n) >= sms and cfg.block_n <= cap, (m, n, k, cfg)
            assert k % cfg.block_k == 0 and cfg.block_k % min(group_k, cfg.block_k) == 0, (m, n, k, cfg)
            assert not cfg.use_dot or (m > 2 and cfg.block_n >= 16)


def test_rule_routes_by_the_smallest_measured_count_and_falls_back(tmp_path, monkeypatch) -> None:
    cfg = StreamConfig(32, 512, 4, 3, True)
    data = {"device": "card", "shapes": [{"name": "x", "n": 4096, "k": 4096, "scales": "block128", "rows": [
        {"m": 1, "path": "stream", "config": vars(FMA)}, {"m": 8, "path": "stream", "config": vars(cfg)},
        {"m": 64, "path": "scaled_mm"}]}]}
    rule = Fp8Rule.from_json(data)
    assert rule.route(1, 4096, 4096, "block128") == Route("stream", FMA)
    assert rule.route(5, 4096, 4096, "block128") == Route("stream", cfg)
    assert rule.route(33, 4096, 4096, "block128").path == "scaled_mm"
    assert rule.route(65, 4096, 4096, "block128") is None and rule.route(1, 4096, 4096, "channel") is None
    path = tmp_path / "rule.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(fp8_config, "rule_for", lambda device: Fp8Rule.from_json(json.loads(path.read_text())))
    cuda = torch.device("cuda", 0)
    assert choose_route(2, 4096, 4096, 128, 128, True, cuda, 132).config == cfg
    # a measured scaled_mm win this build cannot run falls back to the defaults
    assert choose_route(40, 4096, 4096, 128, 128, False, cuda, 132).path == "w8a8"
    assert choose_route(512, 4096, 4096, 128, 128, True, cuda, 132).path == "scaled_mm"
    assert choose_route(4, 1000, 4096, 128, 128, True, cuda, 132).path == "stream"
    data["shapes"][0]["rows"][0]["path"] = "bf16"
    with pytest.raises(ValueError, match="path 'bf16' for x m=1 is not one of"):
        Fp8Rule.from_json(data)


@pytest.mark.parametrize("change,message", [
    ({"block_n": 24}, "block_n=24 must be a power of two >= 1"),
    ({"block_k": 8}, "block_k=8 must be a power of two >= 16"),
    ({"block_n": 512}, "block_n=512 exceeds 256"),
    ({"num_warps": 3}, "num_warps=3 must be one of"),
    ({"split_k": 0}, "split_k=0 must be at least 1"),
    ({"fp8_dot": True}, "fp8_dot=True needs use_dot=True"),
    ({"use_dot": True, "a8": True}, "a8=True needs fp8_dot=True"),
    ({"block_size": 8}, "unexpected keyword argument 'block_size'"),
])
def test_rule_refuses_stream_tiles_no_call_can_run(change, message) -> None:
    """A table whose stream tiles the kernel cannot take is refused at load, naming the shape, the row count,
    the field and the limit, not at the first call of that size inside a graph capture."""
    data = {"device": "card", "shapes": [{"name": "x", "n": 4096, "k": 4096, "scales": "block128", "rows": [
        {"m": 8, "path": "stream", "config": {**vars(FMA), **change}}]}]}
    with pytest.raises(ValueError, match=f"stream tiles for x m=8: .*{message}"):
        Fp8Rule.from_json(data)
    Fp8Rule.from_json({**data, "shapes": [{**data["shapes"][0], "rows": [{"m": 8, "path": "stream",
                                                                          "config": vars(FMA)}]}]})
