"""The small-batch gemv kernels against their fp32 PyTorch references, through Triton's interpreter.

fp32, small shapes whose N and K are not multiples of the tiles, both inner products (FMA and
tl.dot), bias on and off, outputs poisoned with NaN first; the norm prologue with and without a
residual. The bf16 model-shape versions and the CUDA-graph check live in tests/gpu/test_gemv.py.
"""

from __future__ import annotations

import torch
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error

use_interpreter()

import pytest  # noqa: E402

from graphserve.kernels.activation import silu_and_mul  # noqa: E402
from graphserve.kernels.gemv import (  # noqa: E402
    gemv,
    gemv_reference,
    norm_gemv,
    norm_gemv_reference,
    silu_mul_gemv,
    silu_mul_gemv_reference,
)
from graphserve.kernels.gemv_config import MAX_M, GemvConfig, choose_config  # noqa: E402
from graphserve.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from graphserve.layers import linear as linear_mod  # noqa: E402
from graphserve.layers.activation import silu_and_mul as layer_silu_and_mul  # noqa: E402
from graphserve.layers.norm import RMSNorm  # noqa: E402

DEVICE = kernel_device()
RTOL = 1e-4
FMA = GemvConfig(block_n=8, block_k=64, num_warps=4, num_stages=2, use_dot=False)
DOT = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, use_dot=True)

# (N, K) per projection of the presets the decode path serves: qwen3-0.6b, llama3-8b, lm_head
MODEL_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
                (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (151936, 1024)]  # fmt: skip


def randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE)


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize(("n", "k"), [(70, 200), (33, 515)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_reference(m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k + with_bias)
    x, w = randn(m, k, gen=gen), randn(n, k, gen=gen)
    bias = randn(n, gen=gen) if with_bias else None
    out = torch.full((m, n), float("nan"), device=DEVICE)
    assert gemv(x, w, bias, out=out) is out
    assert relative_error(out, gemv_reference(x, w, bias)) < RTOL


@pytest.mark.parametrize("config", [FMA, DOT], ids=["fma", "dot"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 128), (2, 17, 100), (5, 64, 96), (8, 9, 64)])
def test_both_inner_products_with_and_without_a_k_tail(config, m, n, k):
    """K = 128/96/64 are multiples of block_k (unmasked loads); K = 100 leaves a masked tail."""
    gen = torch.Generator().manual_seed(7 * m + n)
    x, w, bias = randn(m, k, gen=gen), randn(n, k, gen=gen), randn(n, gen=gen)
    out = gemv(x, w, bias, config=config)
    assert out.shape == (m, n) and not out.isnan().any()
    assert relative_error(out, gemv_reference(x, w, bias)) < RTOL


@pytest.mark.parametrize("config", [None, FMA, DOT], ids=["chosen", "fma", "dot"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_silu_mul_gemv_matches_reference_and_the_unfused_path(config, m):
    gen = torch.Generator().manual_seed(31 + m)
    n, k = 45, 160
    gate_up, w, bias = randn(m, 2 * k, gen=gen) * 3, randn(n, k, gen=gen), randn(n, gen=gen)
    out = silu_mul_gemv(gate_up, w, bias, config=config)
    assert relative_error(out, silu_mul_gemv_reference(gate_up, w, bias)) < RTOL
    # the prologue rounds silu(gate) * up as the activation kernel does, so both feed the same x
    unfused = gemv(silu_and_mul(gate_up), w, bias, config=config)
    assert relative_error(out, unfused) < 1e-6


@pytest.mark.parametrize("config", [None, FMA, DOT], ids=["chosen", "fma", "dot"])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_norm_gemv_matches_reference_and_the_unfused_path(config, m, with_residual):
    """K = 100 is no multiple of FMA's 64 nor DOT's 32: the statistics pass and the matmul both mask a tail."""
    gen = torch.Generator().manual_seed(3 * m + with_residual)
    n, k, eps = 37, 100, 1e-6
    x, norm_w = randn(m, k, gen=gen) * 2, randn(k, gen=gen)
    w, bias = randn(n, k, gen=gen), randn(n, gen=gen)
    residual = randn(m, k, gen=gen) if with_residual else None
    old_residual = residual.clone() if with_residual else None
    residual_out = torch.full((m, k), float("nan"), device=DEVICE) if with_residual else None
    out = torch.full((m, n), float("nan"), device=DEVICE)
    y, summed = norm_gemv(x, norm_w, eps, w, bias, residual, residual_out=residual_out, out=out, config=config)
    assert y is out and summed is residual_out
    ref_y, ref_summed = norm_gemv_reference(x, norm_w, eps, w, bias, residual)
    assert relative_error(y, ref_y) < RTOL
    if with_residual:
        assert torch.equal(summed, ref_summed)
        assert torch.equal(residual, old_residual)  # read by every program, never written
        h, unfused_summed = fused_add_rms_norm(x, residual, norm_w, eps)
        assert torch.equal(summed, unfused_summed)
    else:
        assert summed is None
        h = rms_norm(x, norm_w, eps)
    # the same normalised rows reach the matmul as through the separate norm kernel
    assert relative_error(y, gemv(h, w, bias, config=config)) < 1e-6


def test_norm_gemv_rejects_writing_over_the_residual_it_reads():
    x, r, norm_w, w = torch.ones(2, 32), torch.ones(2, 32), torch.ones(32), torch.ones(8, 32)
    with pytest.raises(ValueError, match="new buffer"):
        norm_gemv(x, norm_w, 1e-6, w, residual=r, residual_out=r)
    with pytest.raises(ValueError, match=r"norm weight must be contiguous with shape \(32,\), got \(31,\)"):
        norm_gemv(x, torch.ones(31), 1e-6, w)
    with pytest.raises(ValueError, match="residual_out given without a residual"):
        norm_gemv(x, norm_w, 1e-6, w, residual_out=torch.empty(2, 32))


def test_strided_rows_in_and_out_touch_only_their_columns():
    """x as a column slice of a wider activation and out as a slice of a wider buffer, as a model has them."""
    gen = torch.Generator().manual_seed(5)
    m, n, k = 3, 50, 120
    wide_x = randn(m, k + 24, gen=gen)
    x = wide_x[:, 8 : 8 + k]
    w = randn(n, k, gen=gen)
    buf = torch.full((m, n + 30), float("nan"), device=DEVICE)
    out = buf[:, 10 : 10 + n]
    gemv(x, w, out=out)
    assert relative_error(out, gemv_reference(x, w)) < RTOL
    assert buf[:, :10].isnan().all() and buf[:, 10 + n :].isnan().all()


@pytest.mark.parametrize("sms", [132, 108, 16])
@pytest.mark.parametrize("m", range(1, MAX_M + 1))
def test_chosen_configs_fill_the_gpu_at_model_shapes(sms, m):
    """Every SM gets a weight slab even for N = 1024, without split-K; the tiles are valid for the kernel."""
    for n, k in MODEL_SHAPES:
        cfg = choose_config(m, n, k, sms)
        assert cfg.num_programs(n) >= sms, (m, n, k, cfg)
        # no masked tail at model K (powers of two times 1..7), unless the whole slab is one tile
        assert k % cfg.block_k == 0 or cfg.block_k >= k, (m, n, k, cfg)
        for size in (cfg.block_n, cfg.block_k):
            assert size & (size - 1) == 0
        if cfg.use_dot:
            assert m >= 5 and cfg.block_n >= 16 and cfg.block_k >= 16  # tl.dot's smallest tile edge
        else:
            # the weight tile held per thread is bounded (registers, not spills)
            per_thread = cfg.block_n * cfg.block_k // (32 * cfg.num_warps)
            assert per_thread <= (128 if m <= 2 else 64), (m, n, k, cfg)


def test_bad_inputs_name_the_limit():
    x, w = torch.ones(MAX_M + 1, 32), torch.ones(8, 32)
    with pytest.raises(ValueError, match=f"1..{MAX_M} rows, got {MAX_M + 1}"):
        gemv(x, w)
    with pytest.raises(ValueError, match="does not match the input's K = 32"):
        gemv(torch.ones(2, 32), torch.ones(8, 31))
    with pytest.raises(ValueError, match="must share one of"):
        gemv(torch.ones(2, 32, dtype=torch.float16), w)
    with pytest.raises(ValueError, match=r"out must be \[2, 8\]"):
        gemv(torch.ones(2, 32), w, out=torch.empty(2, 9))
    with pytest.raises(ValueError, match="even last dim"):
        silu_mul_gemv(torch.ones(2, 33), w)


def test_linear_layers_keep_nn_linear_results_off_the_gemv_path():
    """On CPU (and with autograd recording) the layers are exactly nn.Linear and silu_and_mul + linear."""
    gen = torch.Generator().manual_seed(11)
    lin = linear_mod.Linear(24, 10, bias=True)
    merged = linear_mod.MergedLinear(24, [6, 4], bias=False)
    assert isinstance(merged, linear_mod.Linear) and merged.shard_rows(1) == slice(6, 10)
    x = torch.randn(3, 24, generator=gen)
    assert not linear_mod.use_gemv(x, lin.weight)
    with torch.no_grad():
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        gate_up = torch.randn(2, 48, generator=gen)
        assert torch.equal(linear_mod.silu_mul_linear(gate_up, lin), lin(layer_silu_and_mul(gate_up)))


@pytest.mark.parametrize("with_residual", [False, True], ids=["first_layer", "later_layer"])
def test_norm_linear_off_the_gemv_path_is_the_norm_then_the_linear(with_residual):
    """On CPU norm_linear is exactly the decoder layer's two calls: norm (with residual add), then linear."""
    gen = torch.Generator().manual_seed(13)
    norm = RMSNorm(24, 1e-5)
    lin = linear_mod.MergedLinear(24, [6, 4], bias=True)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=gen))
        x = torch.randn(3, 24, generator=gen)
        residual = torch.randn(3, 24, generator=gen) if with_residual else None
        y, new_residual = linear_mod.norm_linear(norm, x, residual, lin)
        if with_residual:
            h, expect_residual = norm(x, residual)
        else:
            h, expect_residual = norm(x), x
        assert torch.equal(y, lin(h)) and torch.equal(new_residual, expect_residual)
