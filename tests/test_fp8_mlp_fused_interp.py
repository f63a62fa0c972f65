"""benchmarks/fp8_mlp_fused.py's experimental one-launch FP8 MLP against the engine's two launches and the PyTorch
references, on fresh random inputs. The interpreter runs programs one after another, so the phases run as two
launches here (``split_phases``); the benchmark checks the one launch with its barrier against the engine's
output on the GPU before it times it.

Tolerances: the kernel and the engine's kernels round alike, so under one interpreter they agree to 1e-3. Against
the references the bound is 5e-2: Triton 3.6's interpreter truncates fp32 to bf16 where the GPU and PyTorch round
to nearest (about half the elements one ulp low), and the MLP rounds to bf16 five times on the way."""

from __future__ import annotations

import torch
from interp_setup import use_interpreter

use_interpreter("benchmarks.fp8_mlp_fused")

import pytest  # noqa: E402

from benchmarks.fp8_mlp_fused import engine_mlp, fused_mlp  # noqa: E402
from graphserve.kernels.fp8_quant import quantize_weight_channels  # noqa: E402
from graphserve.kernels.fp8_reference import fp8_norm_gemv_reference, fp8_silu_mul_gemv_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H, INTER = 256, 512


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    wgu, sgu = quantize_weight_channels((torch.randn(2 * INTER, H, generator=gen) * 0.05).to(DEVICE))
    wd, sd = quantize_weight_channels((torch.randn(H, INTER, generator=gen) * 0.05).to(DEVICE))
    x = torch.randn(1, H, generator=gen).to(DEVICE, torch.bfloat16)
    residual = torch.randn(1, H, generator=gen).to(DEVICE, torch.bfloat16)
    norm_w = (torch.rand(H, generator=gen) + 0.5).to(DEVICE, torch.bfloat16)
    return x, residual, norm_w, wgu, sgu, wd, sd


@pytest.mark.parametrize("tile", [(8, 128, 16, 128, 4, 2), (16, 64, 32, 256, 4, 2)])
@pytest.mark.parametrize("programs", [3, 8])
def test_fused_mlp_matches_the_engine_and_the_references(tile, programs) -> None:
    """Fewer programs than tiles in both phases (each takes several), tiles of both shapes."""
    x, residual, norm_w, wgu, sgu, wd, sd = _inputs(programs + tile[0])
    sync = torch.zeros(2, device=DEVICE, dtype=torch.int32)
    got = fused_mlp(x, residual, norm_w, 1e-5, wgu, sgu, wd, sd, sync, programs, tile, split_phases=True)
    engine = engine_mlp(x, residual, norm_w, 1e-5, wgu, sgu, wd, sd, None, None)
    gate_up, _ = fp8_norm_gemv_reference(x, norm_w, 1e-5, wgu, sgu.view(-1, 1), 1, H, residual=residual)
    want = fp8_silu_mul_gemv_reference(gate_up, wd, sd.view(-1, 1), 1, INTER)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    assert float((got.float() - engine.float()).norm() / engine.float().norm()) < 1e-3
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 5e-2


def test_fused_mlp_refuses_partial_tiles_and_grids_its_barrier_cannot_hold() -> None:
    x, residual, norm_w, wgu, sgu, wd, sd = _inputs(1)
    sync = torch.zeros(2, device=DEVICE, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"in whole tiles \(24x128, 16x128\)"):
        fused_mlp(x, residual, norm_w, 1e-5, wgu, sgu, wd, sd, sync, 4, (24, 128, 16, 128, 4, 2), split_phases=True)
    with pytest.raises(ValueError, match=r"programs=0, at least 1"):
        fused_mlp(x, residual, norm_w, 1e-5, wgu, sgu, wd, sd, sync, 0, (8, 128, 16, 128, 4, 2), split_phases=True)
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match=r"the one launch needs a GPU .*split_phases=True"):
            fused_mlp(x, residual, norm_w, 1e-5, wgu, sgu, wd, sd, sync, 4, (8, 128, 16, 128, 4, 2))
    else:
        with pytest.raises(ValueError, match=r"programs=100000 exceeds the \d+ SMs"):
            fused_mlp(x, residual, norm_w, 1e-5, wgu, sgu, wd, sd, sync, 100000, (8, 128, 16, 128, 4, 2))
