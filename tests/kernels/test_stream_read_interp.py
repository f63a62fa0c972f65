"""The bandwidth probe's streaming read against its PyTorch reference, through Triton's interpreter.

Its partial sums must add up to the buffer's sum: a read that skipped or repeated a slab (a wrong
stride, a lost tail) changes the total. Sizes are not multiples of the block, grids of one and several
programs; the GPU run of the same kernel is the probe in benchmarks/roofline.py.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_interp import DEVICE  # imported first: switches Triton to its interpreter without a GPU

from graphserve.kernels.stream_read import stream_read, stream_read_reference


@pytest.mark.parametrize("n,programs,block", [(1000, 1, 64), (5000, 3, 128), (4096, 4, 256), (7, 5, 32)])
def test_partials_add_up_to_the_buffer_sum(n, programs, block):
    gen = torch.Generator().manual_seed(n)
    x = (torch.rand(n, generator=gen) + 0.5).to(DEVICE)  # positive: a lost slab lowers the sum
    partial = stream_read(x, programs, block=block, num_warps=1, out=torch.full((programs,), float("nan"),
                                                                                device=DEVICE))
    assert not partial.isnan().any()  # every program wrote its partial
    torch.testing.assert_close(partial.sum(), stream_read_reference(x), rtol=1e-5, atol=0)


def test_each_element_is_read_once():
    """Distinct powers of two per slab: double-counting or skipping one slab shows in the total."""
    block, programs = 32, 3
    slabs = 7
    x = torch.cat([torch.full((block,), float(2**i)) for i in range(slabs)]).to(DEVICE)
    partial = stream_read(x, programs, block=block, num_warps=1)
    assert partial.sum().item() == block * (2**slabs - 1)
    # program p reads slabs p, p + 3, p + 6: its own strided share
    assert partial.tolist() == [block * sum(2**i for i in range(p, slabs, programs)) for p in range(programs)]


def test_bad_arguments_name_the_limit():
    x = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="power-of-two block"):
        stream_read(x, 2, block=48)
    with pytest.raises(ValueError, match="contiguous"):
        stream_read(torch.ones(8, 8, device=DEVICE).t(), 2)
    with pytest.raises(ValueError, match=r"out must be \[2\] float32"):
        stream_read(x, 2, out=torch.empty(3, device=DEVICE))


@pytest.mark.parametrize("grid", [(0, 64, 1), (2, 32, 1)], ids=["a-program-a-block", "persistent"])
def test_step_skeleton_reads_each_weight_in_turn(grid):
    """benchmarks.step_skeleton's captured function, run eagerly: every launch's grid and partial-sum slice fit, fp8
    weights go through as 16-bit elements, and the last launch (the lm_head) leaves its own partials in front."""
    from benchmarks.step_skeleton import SMALL_READ_ELEMS, skeleton

    gen = torch.Generator().manual_seed(1)
    layer = [torch.randn(6, 40, generator=gen).to(torch.float8_e4m3fn), torch.randn(5, 30, generator=gen)]
    head = (torch.rand(9, 20, generator=gen) + 0.5).to(torch.bfloat16)
    weights = [[w.to(DEVICE) for w in layer], [w.to(DEVICE) for w in layer], [head.to(DEVICE)]]
    sms = 2
    small = torch.ones(SMALL_READ_ELEMS * sms, device=DEVICE)
    out = skeleton(weights, grid, sms, small)()
    per_sm, block, _ = grid
    n = per_sm * sms if per_sm else -(-head.numel() // block)
    torch.testing.assert_close(out[:n].sum(), head.float().sum(), rtol=1e-3, atol=0)
