"""kernels/v4_rope.py (DeepSeek-V4's interleaved partial rope, optionally after the query's per-head RMS) against
its PyTorch reference, on CPU through Triton's interpreter: fresh random rows at large and mixed positions, 2-D and
3-D inputs, a non-power-of-two width, rotating forward and back, in place; tests/gpu/test_deepseek_v4_gpu.py runs
it at the real shapes in bf16 inside the model."""

from __future__ import annotations

import pytest
import torch
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error

use_interpreter()

from graphserve.kernels.v4_rope import v4_rope, v4_rope_reference  # noqa: E402
from graphserve.layers.rotary import rope_tables  # noqa: E402

DEVICE = kernel_device()


def _inputs(shape, pairs, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE)
    positions = torch.randint(0, 600_000, (shape[0],), generator=g).to(DEVICE)
    inv_freq = rope_tables(2 * pairs, {"rope_type": "default", "rope_theta": 10000.0})[0].to(DEVICE)
    return x, positions, inv_freq


@pytest.mark.parametrize("shape,pairs", [((5, 3, 24), 4), ((7, 40), 8), ((1, 2, 16), 8)])
# bf16: the RMS factor is rounded to bf16 before it scales the row, so a last-bit difference in the mean (a sum
# over the row in another order) can move a whole row by one bf16 step (2^-8 relative)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_rope_matches_the_reference(shape, pairs, dtype, tol, norm, sign):
    x, positions, inv_freq = _inputs(shape, pairs, dtype, seed=len(shape) * 100 + pairs)
    eps = 1e-6 if norm else None
    want = v4_rope_reference(x, positions, inv_freq, sign, norm_eps=eps)
    got = v4_rope(x, positions, inv_freq, sign, norm_eps=eps)
    assert got.dtype == dtype and got.shape == x.shape
    assert relative_error(got, want) < tol
    head = shape[-1] - 2 * pairs
    if not norm:  # the dims before the rope pairs pass through untouched
        assert torch.equal(got[..., :head], x[..., :head])
    rotated_back = v4_rope(got, positions, inv_freq, -sign)
    assert relative_error(rotated_back, v4_rope_reference(want, positions, inv_freq, -sign)) < tol
    if dtype == torch.float32 and not norm:  # a rotation and its inverse give the row back
        assert relative_error(rotated_back, x) < 1e-5


def test_in_place_rotation_and_position_zero():
    x, positions, inv_freq = _inputs((6, 2, 32), 8, torch.float32, seed=3)
    positions[0] = 0
    want = v4_rope_reference(x, positions, inv_freq, -1.0)
    got = v4_rope(x, positions, inv_freq, -1.0, out=x)
    assert got.data_ptr() == x.data_ptr()
    assert relative_error(got, want) < 1e-5
    assert torch.equal(got[0], want[0])  # angle 0: nothing moves


def test_bad_input_names_the_argument():
    x, positions, inv_freq = _inputs((4, 16), 4, torch.float32, seed=1)
    with pytest.raises(ValueError, match="positions"):
        v4_rope(x, positions[:3], inv_freq)
    with pytest.raises(ValueError, match="inv_freq"):
        v4_rope(x, positions, inv_freq.double())
    with pytest.raises(ValueError, match="last dim contiguous"):
        v4_rope(x.t(), positions[:4], inv_freq)
