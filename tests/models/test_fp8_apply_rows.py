"""``Fp8LinearMethod.apply_rows``: the product with a row range of an fp8 weight (DeepSeek-V4's grouped output
projection runs one per group) against the dequantized weight's rows times x, for block scales (a last block
partial) and per-channel scales; row ranges that split a scale block are refused naming the rows.

On CPU both sides multiply the same dequantized fp32 values in fp32: only summation order differs (1e-6). The
CUDA kernels' version of this test lives in tests/gpu/test_fp8.py."""

from __future__ import annotations

import pytest
import torch
from model_utils import relative_error

from graphserve.layers.linear import ColumnParallelLinear
from graphserve.layers.quant.config import Fp8Config
from graphserve.layers.quant.fp8 import Fp8LinearMethod

N, K = 56, 48  # 56 rows: three whole 16-row blocks and a partial one of 8


def _layer(block: tuple[int, int] | None, seed: int) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(K, N, False)
    Fp8LinearMethod(Fp8Config(block=block, serialized=False)).create_weights(layer)
    layer.quant_method.init_random(layer, torch.float32, torch.Generator().manual_seed(seed))
    return layer


@pytest.mark.parametrize("block", [(16, 16), None], ids=["block", "channel"])
@pytest.mark.parametrize("rows", [(0, 16), (16, 48), (48, 56), (0, 56)])
def test_rows_match_the_dequantized_rows_times_x(block, rows):
    layer = _layer(block, seed=3)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4))
    start, stop = rows
    got = layer.quant_method.apply_rows(layer, x, start, stop)
    want = x @ layer.quant_method.dequantized_weight(layer, torch.float32)[start:stop].T
    assert got.shape == (5, stop - start)
    assert relative_error(got, want) < 1e-6
    # a strided slice of the heads, as the grouped projection passes it
    wide = torch.randn(5, 2 * K, generator=torch.Generator().manual_seed(5))[:, K:]
    assert relative_error(layer.quant_method.apply_rows(layer, wide, start, stop),
                          wide @ layer.quant_method.dequantized_weight(layer, torch.float32)[start:stop].T) < 1e-6


def test_a_row_block_follows_a_reloaded_weight():
    """The row views are cached per range; a weight loaded again in place is read, a replaced one gets views of its own."""
    layer = _layer((16, 16), seed=6)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(7))
    layer.quant_method.apply_rows(layer, x, 16, 32)
    layer.quant_method.init_random(layer, torch.float32, torch.Generator().manual_seed(8))
    want = x @ layer.quant_method.dequantized_weight(layer, torch.float32)[16:32].T
    assert relative_error(layer.quant_method.apply_rows(layer, x, 16, 32), want) < 1e-6
    layer.weight = torch.nn.Parameter(layer.weight.data.clone(), requires_grad=False)
    layer.weight.data[16:32] = layer.weight.data[32:48]
    want = x @ layer.quant_method.dequantized_weight(layer, torch.float32)[16:32].T
    assert relative_error(layer.quant_method.apply_rows(layer, x, 16, 32), want) < 1e-6


@pytest.mark.parametrize(("rows", "match"), [
    ((8, 24), r"rows \[8, 24\) split the fp8 scale blocks of 16 rows"),
    ((16, 40), r"rows \[16, 40\) split the fp8 scale blocks of 16 rows"),
    ((48, 60), r"rows \[48, 60\) are not a row range of a 56-row fp8 weight"),
    ((20, 20), r"rows \[20, 20\) are not a row range"),
])
def test_a_range_that_splits_a_scale_block_is_refused_naming_the_rows(rows, match):
    layer = _layer((16, 16), seed=9)
    with pytest.raises(ValueError, match=match):
        layer.quant_method.apply_rows(layer, torch.randn(2, K), *rows)
    # per-channel scales: every row has its own, so any range inside the weight runs
    channel = _layer(None, seed=10)
    if rows[1] <= N and rows[0] < rows[1]:
        assert channel.quant_method.apply_rows(channel, torch.randn(2, K), *rows).shape == (2, rows[1] - rows[0])
