"""The FP4 references against hand-computed values: nibble order, every E2M1 code, ties to even, both scale
recipes, and round trips on random inputs."""

from __future__ import annotations

import pytest
import torch

from graphserve.kernels.fp4_reference import (
    E2M1_VALUES,
    e8m0_to_float,
    float_to_fp4_codes,
    fp4_codes_to_float,
    fp4_dequantize,
    fp4_linear_reference,
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    pack_fp4,
    unpack_fp4,
)


def test_pack_puts_element_2i_in_the_low_nibble():
    codes = torch.tensor([[0x1, 0xA, 0xF, 0x0, 0x7, 0x8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0xA1, 0x0F, 0x87]]
    assert torch.equal(unpack_fp4(packed), codes)


def test_pack_unpack_round_trip_random_with_expert_dims():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(unpack_fp4(packed), codes)
    bytes_ = torch.randint(0, 256, (4, 8), generator=g, dtype=torch.uint8)
    assert torch.equal(pack_fp4(unpack_fp4(bytes_)), bytes_)


def test_pack_refuses_bad_codes():
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="< 16"):
        pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack_fp4(torch.zeros(2, dtype=torch.int32))


def test_every_code_value_and_its_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = fp4_codes_to_float(codes)
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert vals.tolist() == want
    assert torch.signbit(vals[8]), "code 8 is -0"
    assert torch.equal(float_to_fp4_codes(vals), codes)


def test_rounding_ties_go_to_the_even_code():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0])
    # 0.75 -> 1.0 (code 2), 1.25 -> 1.0 (code 2), 1.75 -> 2.0 (code 4), 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    assert float_to_fp4_codes(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 10, 14]


def test_rounding_off_ties_and_saturation():
    x = torch.tensor([0.2, 0.26, 0.74, 0.76, 1.3, 1.8, 2.6, 3.4, 3.6, 4.9, 5.1, 6.0, 7.0, 1e6, -1e6, -0.1])
    assert fp4_codes_to_float(float_to_fp4_codes(x)).tolist() == [
        0.0,
        0.5,
        0.5,
        1.0,
        1.5,
        2.0,
        3.0,
        3.0,
        4.0,
        4.0,
        6.0,
        6.0,
        6.0,
        6.0,
        -6.0,
        -0.0,
    ]


def test_rounding_is_nearest_on_random_values():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(4096, generator=g) * 14 - 7
    got = fp4_codes_to_float(float_to_fp4_codes(x))
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES[1:]))
    best = (x.clamp(-6, 6)[:, None] - grid[None, :]).abs().min(dim=1).values
    assert torch.equal((x.clamp(-6, 6) - got).abs(), best)


def test_nvfp4_scale_recipe_by_hand():
    # One row, two blocks of 16: block 0 amax 12 (the matrix amax), block 1 amax 3.
    w = torch.zeros(1, 32)
    w[0, :16] = torch.tensor([12.0, -6.0, 3.0, 1.0] + [0.0] * 12)
    w[0, 16:] = torch.tensor([3.0, 1.5, -0.75] + [0.0] * 13)
    packed, scale, g = nvfp4_quantize(w)
    assert packed.shape == (1, 16) and scale.shape == (1, 2) and g.shape == ()
    assert scale.dtype == torch.float8_e4m3fn and g.dtype == torch.float32
    assert g.item() == pytest.approx(12.0 / 2688.0, rel=1e-7)
    # Block scales: 12 / 6 / g = 448 exactly, 3 / 6 / g = 112 (both representable in e4m3).
    assert scale.float().tolist() == [[448.0, 112.0]]
    codes = unpack_fp4(packed)[0]
    # Block 0 divides by 448 * g = 2: 6, -3, 1.5, 0.5. Block 1 divides by 0.5: 6, 3, -1.5.
    assert fp4_codes_to_float(codes[:4]).tolist() == [6.0, -3.0, 1.5, 0.5]
    assert fp4_codes_to_float(codes[16:19]).tolist() == [6.0, 3.0, -1.5]
    # The global (12 / 2688) is not exact in fp32, so the values come back to within its rounding.
    torch.testing.assert_close(nvfp4_dequantize(packed, scale, g), w, rtol=1e-6, atol=0)


def test_nvfp4_round_trip_random_within_the_grid_error():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(24, 64, generator=g) * 0.05
    packed, scale, gs = nvfp4_quantize(w)
    dq = nvfp4_dequantize(packed, scale, gs, torch.float32)
    # Per element the error is at most half the widest E2M1 gap (1.0 between 4 and 6) times the block's step,
    # plus the e4m3 rounding of the scale (2^-4 relative) on the block's amax.
    step = scale.float().repeat_interleave(16, dim=-1) * gs
    assert bool(((dq - w).abs() <= step * 1.0 + w.abs() * 0.07 + 1e-9).all())
    rel = (dq - w).norm() / w.norm()
    assert rel < 0.12
    # Quantizing the dequantized values again is exact: they are on the grid.
    p2, s2, g2 = nvfp4_quantize(dq)
    assert torch.equal(nvfp4_dequantize(p2, s2, g2), dq)


def test_nvfp4_expert_dims_and_per_part_global_scales():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 8, 32, generator=g)
    w[1] *= 100.0
    packed, scale, gs = nvfp4_quantize(w)
    assert packed.shape == (3, 8, 16) and scale.shape == (3, 8, 2) and gs.shape == (3,)
    for e in range(3):
        p, s, ge = nvfp4_quantize(w[e])
        assert torch.equal(p, packed[e]) and torch.equal(s.float(), scale[e].float()) and ge == gs[e]
    dq = nvfp4_dequantize(packed, scale, gs)
    # A fused gate/up: two halves quantized alone, their globals stacked [E, 2].
    gate, up = nvfp4_quantize(w[:, :4]), nvfp4_quantize(w[:, 4:])
    fused = nvfp4_dequantize(
        torch.cat([gate[0], up[0]], 1), torch.cat([gate[1], up[1]], 1), torch.stack([gate[2], up[2]], 1)
    )
    assert torch.equal(fused[:, :4], nvfp4_dequantize(*gate)) and torch.equal(fused[:, 4:], nvfp4_dequantize(*up))
    assert (dq - w).norm() / w.norm() < 0.12
    with pytest.raises(ValueError, match="global scale shape"):
        nvfp4_dequantize(packed, scale, torch.ones(3, 3))


def test_nvfp4_zero_matrix_and_shape_refusals():
    packed, scale, g = nvfp4_quantize(torch.zeros(2, 16))
    assert g.item() == 1.0 and torch.equal(nvfp4_dequantize(packed, scale, g), torch.zeros(2, 16))
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize(torch.ones(2, 24))
    with pytest.raises(ValueError, match="non-finite"):
        nvfp4_quantize(torch.tensor([[float("inf")] + [0.0] * 15]))
    p, s, g = nvfp4_quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match="want"):
        nvfp4_dequantize(p, s[:, :1], g)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        nvfp4_dequantize(p, s.float(), g)


def test_e8m0_values():
    s = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = e8m0_to_float(s)
    assert got[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(got[6])


def test_mxfp4_scale_recipe_by_hand():
    w = torch.zeros(2, 32)
    w[0, :4] = torch.tensor([5.0, -1.0, 0.3, 2.5])  # amax 5: floor(log2 5) = 2, exponent 0, scale 2^0
    w[1, :3] = torch.tensor([0.75, -0.375, 0.1])  # amax 0.75: floor(log2) = -1, exponent -3, scale 2^-3
    packed, scale = mxfp4_quantize(w)
    assert packed.shape == (2, 16) and scale.shape == (2, 1) and scale.dtype == torch.uint8
    assert scale.flatten().tolist() == [127, 124]
    codes = unpack_fp4(packed)
    assert fp4_codes_to_float(codes[0, :4]).tolist() == [4.0, -1.0, 0.5, 2.0]  # 5 -> 4 and 2.5 -> 2 are ties
    assert fp4_codes_to_float(codes[1, :3]).tolist() == [6.0, -3.0, 1.0]  # 0.8 -> 1.0
    dq = mxfp4_dequantize(packed, scale)
    assert dq[0, :4].tolist() == [4.0, -1.0, 0.5, 2.0]
    assert dq[1, :3].tolist() == [0.75, -0.375, 0.125]


def test_mxfp4_saturates_above_six_times_the_scale_and_zero_blocks():
    w = torch.zeros(1, 64)
    w[0, 0] = 7.5  # floor(log2 7.5) = 2: scale 1, 7.5 saturates to 6
    packed, scale = mxfp4_quantize(w)
    assert scale.tolist() == [[127, 0]]
    assert mxfp4_dequantize(packed, scale)[0, 0].item() == 6.0
    assert torch.equal(mxfp4_dequantize(packed, scale)[0, 1:], torch.zeros(63))


def test_mxfp4_round_trip_random_and_expert_dims():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(2, 16, 96, generator=g) * 0.02
    packed, scale = mxfp4_quantize(w)
    assert packed.shape == (2, 16, 48) and scale.shape == (2, 16, 3)
    dq = mxfp4_dequantize(packed, scale, torch.bfloat16)
    assert dq.dtype == torch.bfloat16
    assert (dq.float() - w).norm() / w.norm() < 0.2
    p2, s2 = mxfp4_quantize(dq.float())
    assert torch.equal(mxfp4_dequantize(p2, s2), dq.float())
    # gpt-oss's blocks layout [E, N, K/32, 16] is the packed layout after a reshape.
    blocks = packed.reshape(2, 16, 3, 16)
    assert torch.equal(mxfp4_dequantize(blocks.flatten(-2), scale), dq.float())
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize(torch.ones(2, 48))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_dequantize(packed, scale.float())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_reference_matches_dequantized_matmul(fmt, dtype):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 64, generator=g)
    x = torch.randn(3, 64, generator=g).to(dtype)
    bias = torch.randn(40, generator=g)
    if fmt == "nvfp4":
        packed, scale, gs = nvfp4_quantize(w)
    else:
        (packed, scale), gs = mxfp4_quantize(w), None
    wd = fp4_dequantize(packed, scale, gs, fmt)
    out = fp4_linear_reference(x, packed, scale, gs, fmt, bias)
    assert out.dtype == dtype and out.shape == (3, 40)
    want = (x.float() @ wd.T + bias).to(dtype)
    assert torch.equal(out, want)
    # And the quantized product is close to the unquantized one.
    exact = x.float() @ w.T + bias
    assert (out.float() - exact).norm() / exact.norm() < 0.2


def test_fp4_dequantize_refuses_mixed_arguments():
    p, s, g = nvfp4_quantize(torch.randn(2, 32))
    with pytest.raises(ValueError, match="needs a global"):
        fp4_dequantize(p, s, None, "nvfp4")
    with pytest.raises(ValueError, match="no global"):
        fp4_dequantize(p, s, g, "mxfp4")
    with pytest.raises(ValueError, match="fmt"):
        fp4_dequantize(p, s, g, "int4")
