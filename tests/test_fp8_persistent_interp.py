"""The FP8 streaming matmul's persistent grid (kernels/fp8_gemv_persistent.py) on CPU through Triton's
interpreter: fresh random inputs at tiny shapes whose N and K are not multiples of the tiles, every way the
program boundaries can fall (on a slab's edge, inside a slab, one program for everything), against the
dequantize-then-matmul references.

On CPU ``sm_count`` is 1, so ``programs_per_sm`` is the grid itself. Tolerances as the tiled FMA path's
(tests/test_fp8_stream_interp.py): the kernel and the reference multiply the same fp8 weights and fp32 scales
in fp32 and differ by summation order only; a lost or doubled piece of a slab gives errors of order 1.
"""

from __future__ import annotations

import torch
from interp_setup import use_interpreter

use_interpreter()

import pytest  # noqa: E402

from graphserve.kernels.fp8_config import StreamConfig  # noqa: E402
from graphserve.kernels.fp8_gemv import fp8_gemv, fp8_norm_gemv, fp8_silu_mul_gemv, split_counters  # noqa: E402
from graphserve.kernels.fp8_gemv_persistent import persistent_constants  # noqa: E402
from graphserve.kernels.fp8_quant import quantize_weight_blocks, quantize_weight_channels  # noqa: E402
from graphserve.kernels.fp8_reference import (  # noqa: E402
    fp8_gemv_reference,
    fp8_norm_gemv_reference,
    fp8_silu_mul_gemv_reference,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _channel_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_weight_channels(_randn(n, k, seed=seed) * 0.05)
    return q, s.reshape(-1, 1)


def _persistent(block_n: int, block_k: int, programs: int, stages: int = 1) -> StreamConfig:
    return StreamConfig(block_n, block_k, num_warps=4, num_stages=stages, use_dot=False, programs_per_sm=programs)


# (m, n, k, block_n, block_k, programs): 40 x 200 in 8 x 64 tiles is 5 slabs of 4 steps (the last 8 columns
# wide): 1 program streams all; 2 cut slab 2 in half; 3 cut slabs 1 and 3 off their edges; 5 take one
# slab each; 7 are capped at the 5 slabs. 37 rows leave a partial last slab; 3 rows and 4-row tiles too.
CASES = [
    (1, 40, 200, 8, 64, 1), (1, 40, 200, 8, 64, 2), (1, 40, 200, 8, 64, 3), (1, 40, 200, 8, 64, 5),
    (1, 40, 200, 8, 64, 7), (3, 37, 96, 4, 32, 4), (2, 37, 200, 16, 64, 2),
]


@pytest.mark.parametrize("stages", [1, 2, 3])  # tiles in flight a program: loaded 0, 1 or 2 loop turns ahead
@pytest.mark.parametrize("m,n,k,block_n,block_k,programs", CASES)
def test_persistent_grid_matches_reference(m, n, k, block_n, block_k, programs, stages) -> None:
    wq, ws = _channel_weight(n, k, seed=m + n + programs)
    x, bias = _randn(m, k, seed=k + programs), _randn(n, seed=5)
    cfg = _persistent(block_n, block_k, programs, stages)
    for b in (None, bias):
        out = fp8_gemv(x, wq, ws, 1, k, b, config=cfg)
        torch.testing.assert_close(out, fp8_gemv_reference(x, wq, ws, 1, k, b), **TOL)
    # the boundary counters are left at zero: a second call (a graph replay) sums the same pieces again
    again = fp8_gemv(x, wq, ws, 1, k, bias, config=cfg)
    assert torch.equal(again, out)
    assert not split_counters(x.device, 1).any()


def test_every_program_streams_within_one_tile_of_the_same_share() -> None:
    """The balance the grid exists for: programs' ranges of tiles differ by at most one, and none is shorter
    than a slab (so no slab is cut twice)."""
    consts = persistent_constants(1, 6144, 4096, 8, 1024, 4, 132)
    units, programs = consts["TILES"] * consts["K_STEPS"], consts["PROGRAMS"]
    assert programs == 528 and consts["TILES"] == 768 and consts["K_STEPS"] == 4
    shares = [(p + 1) * units // programs - p * units // programs for p in range(programs)]
    assert max(shares) - min(shares) <= 1 and min(shares) >= consts["K_STEPS"]
    assert persistent_constants(1, 40, 200, 8, 64, 32, 132)["PROGRAMS"] == 5  # never more programs than slabs


def test_persistent_grid_fused_prologues_match_reference() -> None:
    """SiLU·mul and (residual add +) RMSNorm computed in the loads, as the tiled kernel's FMA path does."""
    m, n, k = 2, 40, 200
    cfg = _persistent(8, 64, 3, stages=3)
    wq, ws = _channel_weight(n, k, seed=31)
    gate_up = _randn(m, 2 * k, seed=32)
    torch.testing.assert_close(fp8_silu_mul_gemv(gate_up, wq, ws, 1, k, config=cfg),
                               fp8_silu_mul_gemv_reference(gate_up, wq, ws, 1, k), **TOL)
    x, res, nw = _randn(m, k, seed=33), _randn(m, k, seed=34), _randn(k, seed=35)
    for residual in (None, res):
        out, summed = fp8_norm_gemv(x, nw, 1e-6, wq, ws, 1, k, residual=residual, config=cfg)
        want, want_sum = fp8_norm_gemv_reference(x, nw, 1e-6, wq, ws, 1, k, residual=residual)
        torch.testing.assert_close(out, want, **TOL)
        if residual is None:
            assert summed is None
        else:
            torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)


def test_persistent_grid_refuses_what_it_cannot_run() -> None:
    x = _randn(1, 128, seed=41)
    bq, bs = quantize_weight_blocks(_randn(32, 128, seed=42), 16, 32)
    with pytest.raises(ValueError, match=r"programs_per_sm=2 \(the persistent grid\) takes per-channel weight scales"):
        fp8_gemv(x, bq, bs, 16, 32, config=_persistent(8, 32, 2))
    with pytest.raises(ValueError, match=r"programs_per_sm=2 \(the persistent grid\) takes FMA tiles without split-K"):
        StreamConfig(16, 64, 4, 1, use_dot=True, programs_per_sm=2).validate()
    with pytest.raises(ValueError, match=r"split_k=2"):
        StreamConfig(8, 64, 4, 1, use_dot=False, split_k=2, programs_per_sm=2).validate()
    with pytest.raises(ValueError, match=r"num_stages=4: the persistent grid keeps 1-3 tiles in flight"):
        StreamConfig(8, 64, 4, 4, use_dot=False, programs_per_sm=2).validate()
    with pytest.raises(ValueError, match=r"programs_per_sm=33 must be in 0\.\.32"):
        StreamConfig(8, 64, 4, 1, use_dot=False, programs_per_sm=33).validate()
