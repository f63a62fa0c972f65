"""The dense FP4 GEMM's "dequant_fp8" variant (kernels/fp4_dequant_fp8.py) on CPU through Triton's interpreter: the
per-call conversion of a packed FP4 weight to e4m3 byte for byte what ``--fp4-load-as fp8`` holds (fp4_to_fp8.pow2_fp8
on the dequantized weight), rows whose group scales span many binades included (subnormal e4m3 and flushes); the row
scales made without a host sync equal the reference's; the variant end to end (x quantized per token, the W8A8 FP8
matmul that runs where cuBLASLt's does not) against the conversion-then-FP8-reference, with a global per tensor or per
row and a bias; fp4_linear running it where its table names it.
"""

from __future__ import annotations

import torch
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error

use_interpreter()

from graphserve.kernels import fp4_gemm as gemm_mod  # noqa: E402
from graphserve.kernels.fp4_dequant_fp8 import (  # noqa: E402
    fp4_to_fp8_weight,
    fp4_to_fp8_weight_reference,
    fp8_row_scales,
)
from graphserve.kernels.fp4_gemm import fp4_gemm, fp4_gemm_reference, fp4_linear  # noqa: E402
from graphserve.kernels.fp4_gemm_config import Fp4GemmConfig, Fp4GemmTile  # noqa: E402
from graphserve.kernels.fp4_reference import fp4_dequantize  # noqa: E402
from graphserve.layers.quant.fp4_to_fp8 import pow2_fp8  # noqa: E402

DEVICE = kernel_device()


def _weight(gen, fmt, n, k, wide_row=None, mx_top=137):
    """Random bytes (every E2M1 code) and scales; row ``wide_row``'s group scales spread over every binade the format
    has (NVFP4: e4m3's 2^-9 to 448, 19 binades; MXFP4: from 2^-40 to 2^(mx_top - 127)), so its small groups fall on e4m3's subnormal
    grid or flush to zero after the division by the row's power of two."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    groups = k // (16 if fmt == "nvfp4" else 32)
    if fmt == "nvfp4":
        scale = torch.rand(n, groups, generator=gen) * 0.6 + 0.02
        if wide_row is not None:
            scale[wide_row] = torch.logspace(-9, 8.8, groups, base=2.0)[torch.randperm(groups, generator=gen)]
        scale = scale.to(torch.float8_e4m3fn)
    else:
        scale = torch.randint(118, 126, (n, groups), dtype=torch.uint8, generator=gen)
        if wide_row is not None:
            scale[wide_row] = torch.linspace(87, mx_top, groups).round().to(torch.uint8)[torch.randperm(groups, generator=gen)]
    return packed, scale


def _on_e4m3_grid(x: torch.Tensor) -> torch.Tensor:
    """fp16 x whose per-token quantization is exact (each row on the e4m3 grid, its amax 448): the interpreter's fp8
    cast rounds ties away from zero where the GPU's rounds to even, so this checks the GEMM's arithmetic."""
    x = (x * 60).clamp(-440, 440).to(torch.float8_e4m3fn).half()
    x[:, 5] = 448.0
    return x


def test_conversion_is_the_load_time_conversion_byte_for_byte():
    """NVFP4 and MXFP4, K a whole number of tiles and not (the tail masked by group), rows past N masked: the e4m3
    bytes and row scales are --fp4-load-as fp8's (pow2_fp8 over the unit-global dequantized weight)."""
    for fmt, n, k, tile in (("nvfp4", 37, 160, Fp4GemmConfig(16, 16, 64)), ("mxfp4", 21, 192, Fp4GemmConfig(16, 32, 128)),
                            ("nvfp4", 8, 512, Fp4GemmConfig(16, 16, 128))):  # fmt: skip
        gen = torch.Generator().manual_seed(n + k)
        packed, scale = _weight(gen, fmt, n, k, wide_row=3)
        unit = torch.ones(()) if fmt == "nvfp4" else None
        q_load, s_load = pow2_fp8(fp4_dequantize(packed, scale, unit, fmt)[None], None)
        q_ref, rs_ref = fp4_to_fp8_weight_reference(packed, scale, fmt)
        assert torch.equal(q_ref.view(torch.uint8), q_load[0].view(torch.uint8))
        assert torch.equal(rs_ref, s_load.reshape(-1))
        rs = fp8_row_scales(packed.to(DEVICE), scale.to(DEVICE), fmt)
        assert torch.equal(rs.cpu(), rs_ref)
        q = fp4_to_fp8_weight(packed.to(DEVICE), scale.to(DEVICE), rs, fmt, tile)
        assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)), fmt
        # the wide row rounds somewhere (else it tests nothing beyond exact shifts); the others convert exactly
        back = q_ref.float() * rs_ref[:, None]
        exact = fp4_dequantize(packed, scale, unit, fmt)
        assert not torch.equal(back[3], exact[3])
        assert (back[3] != 0).sum() > k // 4


def test_the_variant_matches_the_conversion_then_the_fp8_reference():
    """End to end: one global per tensor and one per row (fused parts), a bias, the row scales passed as a layer holds
    them and made in the call, a caller's output buffer; against the conversion followed by the FP8 reference matmul
    (x per token), and close to the exact FP4 product (a few weights' e4m3 roundings apart)."""
    gen = torch.Generator().manual_seed(11)
    for fmt, m, n, k, per_row in (("nvfp4", 70, 48, 128, False), ("nvfp4", 66, 40, 96, True), ("mxfp4", 80, 32, 128, False)):
        packed, scale = _weight(gen, fmt, n, k, wide_row=1, mx_top=125)
        gs = None
        if fmt == "nvfp4":  # small: the wide row's 448 group scales times x's 448 stay within fp16
            gs = (torch.rand(n, generator=gen) + 0.3) / 4096 if per_row else torch.tensor([2.0**-13])
        bias = torch.randn(n, generator=gen).half()
        x = _on_e4m3_grid(torch.randn(m, k, generator=gen))
        ref = fp4_gemm_reference(x, packed, scale, gs, fmt, bias, variant="dequant_fp8")
        exact = fp4_gemm_reference(x, packed, scale, gs, fmt, bias)
        dev = [t.to(DEVICE) if t is not None else None for t in (x, packed, scale, gs, bias)]
        tile = Fp4GemmConfig(16, 16, 32 if fmt == "nvfp4" else 64)
        rs = fp8_row_scales(dev[1], dev[2], fmt)
        for given in (rs, None):
            out = fp4_gemm(*dev[:4], fmt, dev[4], variant="dequant_fp8", config=tile, fp8_row_scale=given)
            assert out.dtype == torch.float16 and out.shape == (m, n)
            assert relative_error(out.cpu(), ref) < 2e-3, (fmt, per_row)
            assert relative_error(out.cpu(), exact) < 0.05
        into = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)
        assert fp4_gemm(*dev[:4], fmt, dev[4], into, variant="dequant_fp8", config=tile) is into
        assert relative_error(into.cpu(), ref) < 2e-3


def test_fp4_linear_runs_the_variant_its_table_names(monkeypatch):
    """A listed shape's dequant_fp8 bucket: fp4_linear hands the caller's row scales to that variant's call."""
    seen = []
    real = gemm_mod.fp4_gemm

    def spy(*args, **kwargs):
        seen.append((kwargs["variant"], kwargs["config"], kwargs["fp8_row_scale"]))
        return real(*args, **kwargs)

    tile = Fp4GemmTile("dequant_fp8", Fp4GemmConfig(16, 32, 128))
    monkeypatch.setattr(gemm_mod, "fp4_gemm", spy)
    monkeypatch.setattr(gemm_mod, "gemm_tile", lambda fmt, n, k, m, device, variant: tile)
    gen = torch.Generator().manual_seed(4)
    packed, scale = _weight(gen, "mxfp4", 32, 128)
    x = _on_e4m3_grid(torch.randn(72, 128, generator=gen))
    ref = fp4_gemm_reference(x, packed, scale, None, "mxfp4", variant="dequant_fp8")
    rs = fp8_row_scales(packed, scale, "mxfp4").to(DEVICE)
    out = fp4_linear(x.to(DEVICE).view(8, 9, 128), packed.to(DEVICE), scale.to(DEVICE), None, "mxfp4",
                     fp8_row_scale=rs)  # fmt: skip
    assert [(v, c) for v, c, _ in seen] == [("dequant_fp8", tile.config)] and seen[0][2] is rs
    assert out.shape == (8, 9, 32) and relative_error(out.view(72, 32).cpu(), ref) < 2e-3


def test_a_layers_row_scales_and_conversion_are_what_fp4_load_as_fp8_holds():
    """Fused parts quantized at load with their own NVFP4 globals: the FP4 layer's prepared row scales times its
    per-row globals are the scales ``convert_linear`` gives a copy of it, and the per-call conversion its bytes, so
    the variant multiplies what the FP8 layer would."""
    from graphserve.layers.linear import MergedColumnParallelLinear
    from graphserve.layers.quant.fp4 import Fp4LinearMethod, prepare_fp4_linears
    from graphserve.layers.quant.fp4_config import Fp4Config
    from graphserve.layers.quant.fp4_to_fp8 import FP8_LAYOUT, convert_linear
    from graphserve.layers.quant.fp8 import Fp8LinearMethod

    gen = torch.Generator().manual_seed(8)
    sizes, k = [32, 16, 16], 64
    layers = []
    for _ in range(2):
        layer = MergedColumnParallelLinear(k, sizes, bias=False).to(torch.bfloat16)
        Fp4LinearMethod(Fp4Config("nvfp4", serialized=False)).create_weights(layer)
        layers.append(layer)
    for shard, n in enumerate(sizes):
        w = torch.randn(n, k, generator=gen) * 0.02 * (1 + 3 * shard)
        for layer in layers:
            layer.load_weight("weight", layer.weight, w, shard)
    fp4, fp8 = layers
    assert fp4.fp4_row_global is not None and prepare_fp4_linears(fp4) == 0  # CPU: the reference path needs none
    fp4.quant_method.prepare(fp4)
    convert_linear(fp8, Fp8LinearMethod(FP8_LAYOUT))
    assert torch.equal(fp4.fp8_row_scale * fp4.fp4_row_global, fp8.weight_scale)
    q = fp4_to_fp8_weight(fp4.weight.to(DEVICE), fp4.weight_scale.to(DEVICE), fp4.fp8_row_scale.to(DEVICE), "nvfp4",
                          Fp4GemmConfig(16, 16, 64))  # fmt: skip
    assert torch.equal(q.cpu().view(torch.uint8), fp8.weight.view(torch.uint8))
