"""Split-K in the FP8 streaming gemv, on CPU through Triton's interpreter: K cut into 2-4 pieces whose
fp32 partials the last program of each column tile sums in the same launch. Tiny shapes whose K is
not a multiple of the tile (so the last split is partly or wholly past K), block and per-channel
scales, both inner products, the fused prologues, and the per-tile counters left at zero for the
next call (what CUDA-graph replay relies on).

Tolerances as tests/kernels/test_fp8_stream_interp.py's: the FMA path sums the same fp32 products as the
reference in another order (1e-5); the dot path rounds the scaled x to 16 bits (1e-2 normwise).
"""

from __future__ import annotations

import pytest
import torch
from model_utils import relative_error

# first: importing the stream tests puts Triton under the interpreter when there is no GPU
from test_fp8_stream_interp import DEVICE, DOT_DTYPE, _randn, _weight

assert DEVICE.type in ("cpu", "cuda")

from graphserve.kernels import fp8_gemv as gemv_mod  # noqa: E402
from graphserve.kernels.fp8_config import StreamConfig, default_stream_config  # noqa: E402
from graphserve.kernels.fp8_gemv import (  # noqa: E402
    fp8_gemv,
    fp8_norm_gemv,
    fp8_silu_mul_gemv,
)
from graphserve.kernels.fp8_reference import (  # noqa: E402
    fp8_gemv_reference,
    fp8_norm_gemv_reference,
    fp8_silu_mul_gemv_reference,
)

FMA_SPLIT = StreamConfig(block_n=8, block_k=32, num_warps=4, num_stages=2, use_dot=False, split_k=3)
DOT_SPLIT = StreamConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, use_dot=True, split_k=2)


class _GridSpy:
    """Wraps the gemv kernel: records each launch's grid, then launches."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


@pytest.fixture
def grids(monkeypatch) -> list:
    spy = _GridSpy(gemv_mod._fp8_gemv_kernel)
    monkeypatch.setattr(gemv_mod, "_fp8_gemv_kernel", spy)
    return spy.grids


def _counters_zero(device: torch.device) -> bool:
    assert gemv_mod._COUNTERS, "no split-K counters were allocated: the launch did not split"
    return all(int(c.abs().sum()) == 0 for (dev, _), c in gemv_mod._COUNTERS.items() if dev == device)


# (m, n, k, group_n, group_k): K = 200 in 7 tiles of 32 -> splits of 3, 3, 1 tiles, the last one
# ending past K; K = 96 -> 3 whole tiles, one per split; per-channel scales with a K tail
@pytest.mark.parametrize("m,n,k,group_n,group_k", [(1, 40, 200, 16, 32), (3, 37, 96, 8, 16), (2, 24, 136, 1, 136)])
def test_split_k_fma_matches_reference_and_leaves_counters_zero(m, n, k, group_n, group_k, grids) -> None:
    wq, ws = _weight(n, k, group_n, group_k, seed=m + k)
    bias = _randn(n, seed=3)
    for call in range(2):  # the second call finds the counters the first one reset
        x = _randn(m, k, seed=10 + call)
        out = fp8_gemv(x, wq, ws, group_n, group_k, bias, config=FMA_SPLIT)
        want = fp8_gemv_reference(x, wq, ws, group_n, group_k, bias)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        assert _counters_zero(x.device)
    assert grids == [(-(-n // FMA_SPLIT.block_n), 3)] * 2  # both calls launched three splits


def test_split_k_dot_matches_reference(grids) -> None:
    m, n, k = 5, 40, 200
    wq, ws = _weight(n, k, 16, 32, seed=31)
    x = _randn(m, k, seed=32).to(DOT_DTYPE)
    out = fp8_gemv(x, wq, ws, 16, 32, config=DOT_SPLIT)
    assert relative_error(out, fp8_gemv_reference(x.float(), wq, ws, 16, 32)) < 1e-2
    assert grids == [(3, 2)]  # 40 columns in tiles of 16, K in two splits
    assert _counters_zero(x.device)


def test_split_k_fused_prologues_match_reference() -> None:
    """The norm's statistics span all of K in every split; x + residual is written once, by one program."""
    m, n, k = 3, 40, 200
    wq, ws = _weight(n, k, 16, 32, seed=41)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    gate_up = _randn(m, 2 * k, seed=42)
    torch.testing.assert_close(fp8_silu_mul_gemv(gate_up, wq, ws, 16, 32, config=FMA_SPLIT),
                               fp8_silu_mul_gemv_reference(gate_up, wq, ws, 16, 32), **tol)
    x, res, nw = _randn(m, k, seed=43), _randn(m, k, seed=44), _randn(k, seed=45)
    out, summed = fp8_norm_gemv(x, nw, 1e-6, wq, ws, 16, 32, residual=res, config=FMA_SPLIT)
    want, want_sum = fp8_norm_gemv_reference(x, nw, 1e-6, wq, ws, 16, 32, residual=res)
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)


def test_split_k_count_beyond_the_tiles_of_k_is_cut_to_them(grids) -> None:
    """split_k = 8 against K = 64 in two tiles of 32 runs as two splits, never an empty one."""
    wq, ws = _weight(24, 64, 8, 32, seed=51)
    x = _randn(2, 64, seed=52)
    cfg = StreamConfig(block_n=8, block_k=32, num_warps=4, num_stages=2, use_dot=False, split_k=8)
    torch.testing.assert_close(fp8_gemv(x, wq, ws, 8, 32, config=cfg), fp8_gemv_reference(x, wq, ws, 8, 32),
                               rtol=1e-4, atol=1e-5)
    assert grids == [(3, 2)]  # 24 columns in tiles of 8; eight splits asked, two tiles of K to cut


def test_split_k_bad_counts_name_the_limit() -> None:
    wq, ws = _weight(24, 64, 8, 32, seed=61)
    x = _randn(1, 64, seed=62)
    with pytest.raises(ValueError, match="split_k=0"):
        fp8_gemv(x, wq, ws, 8, 32, config=StreamConfig(8, 32, 4, 2, False, split_k=0))
    with pytest.raises(ValueError, match="at most 4096"):
        gemv_mod.split_counters(x.device, 4097)


def test_default_tiles_split_k_only_where_column_tiles_are_short() -> None:
    sms = 132
    narrow = default_stream_config(1, 512, 16384, 128, sms)  # 128 tiles of 4 rows: short of 2 per SM
    assert narrow.split_k == 2 and narrow.num_programs(512) == 256
    assert default_stream_config(1, 4096, 14336, 128, sms).split_k == 1  # 512 tiles already
    assert default_stream_config(1, 1024, 512, 128, sms).split_k == 1  # K too short to cut
