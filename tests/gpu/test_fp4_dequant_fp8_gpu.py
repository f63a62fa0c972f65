"""The dense FP4 GEMM's "dequant_fp8" variant (kernels/fp4_dequant_fp8.py) compiled, at Llama-3-8B's shapes: the
per-call conversion byte for byte the load-time one (``--fp4-load-as fp8``), rows whose group scales span many binades
included; the variant (cuBLASLt FP8 rowwise) against the conversion-then-FP8-reference at prefill rows, with one global
per row (fused q/k/v parts) and a bias; a projection's output equal, bit for bit, to the same projection converted by
``--fp4-load-as fp8`` running the FP8 linear's prefill path; and fp4_linear captured in a CUDA graph on this variant,
replayed equal to eager.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import capture, rel_err
from test_fp4 import fp4_weight

from graphserve.kernels import fp4_gemm as gemm_mod
from graphserve.kernels.common import sm_count
from graphserve.kernels.fp4_dequant_fp8 import fp4_to_fp8_weight, fp4_to_fp8_weight_reference, fp8_row_scales
from graphserve.kernels.fp4_gemm import fp4_gemm, fp4_gemm_reference, fp4_linear
from graphserve.kernels.fp4_gemm_config import Fp4GemmTile, default_config
from graphserve.kernels.fp4_layout import GROUP
from graphserve.kernels.fp4_reference import fp4_dequantize
from graphserve.kernels.fp8_gemm import scaled_mm_supported
from graphserve.layers.linear import MergedColumnParallelLinear
from graphserve.layers.quant.fp4 import Fp4LinearMethod
from graphserve.layers.quant.fp4_config import Fp4Config
from graphserve.layers.quant.fp4_to_fp8 import FP8_LAYOUT, convert_linear
from graphserve.layers.quant.fp8 import Fp8LinearMethod

CUDA = torch.device("cuda")
DT = torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "down": (4096, 14336)}


def _widen_row(scale: torch.Tensor, fmt: str, row: int, gen: torch.Generator) -> None:
    """Row ``row``'s group scales spread over the format's binades (NVFP4: e4m3's 2^-9 to 448; MXFP4: 2^-40 to
    2^2), so its small groups land on e4m3's subnormal grid or flush after the division by the row's power."""
    groups = scale.shape[1]
    order = torch.randperm(groups, device=CUDA, generator=gen)
    if fmt == "nvfp4":
        scale[row] = torch.logspace(-9, 8.8, groups, base=2.0, device=CUDA)[order].to(torch.float8_e4m3fn)
    else:
        scale[row] = torch.linspace(87, 129, groups, device=CUDA).round().to(torch.uint8)[order]


@pytest.mark.parametrize("proj", list(SHAPES))
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_conversion_is_the_load_time_one_byte_for_byte(fmt, proj):
    n, k = SHAPES[proj]
    gen = torch.Generator("cuda").manual_seed(n + k + len(fmt))
    packed, scale, _ = fp4_weight((), n, k, fmt, gen)
    _widen_row(scale, fmt, 5, gen)
    q_ref, rs_ref = fp4_to_fp8_weight_reference(packed, scale, fmt)
    rs = fp8_row_scales(packed, scale, fmt)
    assert torch.equal(rs, rs_ref)
    tile = default_config("dequant_fp8", 4096, n, k, GROUP[fmt], sm_count(CUDA))
    q = fp4_to_fp8_weight(packed, scale, rs, fmt, tile)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), (fmt, proj)
    unit = torch.ones((), device=CUDA) if fmt == "nvfp4" else None
    exact = fp4_dequantize(packed[5:6], scale[5:6], unit, fmt)[0]
    assert (q_ref[5].float() * rs_ref[5] != exact).any()  # the wide row rounds (else only exact shifts were checked)


@pytest.mark.parametrize("m", [300, 2048])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_variant_matches_its_reference_at_prefill_rows(fmt, m):
    """q/k/v of Llama-3-8B, NVFP4 with each part's own global (one per row), a bias; x fresh bf16."""
    n, k = SHAPES["qkv"]
    gen = torch.Generator("cuda").manual_seed(m + len(fmt))
    packed, scale, gs = fp4_weight((), n, k, fmt, gen)
    if fmt == "nvfp4":  # q, k and v each their own global
        parts = torch.tensor([4096, 1024, 1024], device=CUDA)
        gs = (gs * torch.tensor([1.0, 0.5, 2.0], device=CUDA).repeat_interleave(parts)).contiguous()
    assert scaled_mm_supported(m, n, k, CUDA)  # cuBLASLt FP8 rowwise runs it, as the FP8 linear at prefill
    bias = torch.randn(n, device=CUDA, dtype=DT, generator=gen)
    x = torch.randn(m, k, device=CUDA, dtype=DT, generator=gen)
    rs = fp8_row_scales(packed, scale, fmt)
    out = fp4_gemm(x, packed, scale, gs, fmt, bias, variant="dequant_fp8", fp8_row_scale=rs)
    assert out.dtype == DT and out.shape == (m, n)
    assert rel_err(out, fp4_gemm_reference(x, packed, scale, gs, fmt, bias, variant="dequant_fp8")) < 1e-2
    # against the FP4 product itself: x's e4m3 rounding and a few NVFP4 weights' (fp4_to_fp8's note) apart
    assert rel_err(out, fp4_gemm_reference(x, packed, scale, gs, fmt, bias)) < 8e-2


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_projection_equals_the_same_projection_loaded_as_fp8(fmt, gen, monkeypatch):
    """Fused q/k/v parts, each quantized with its own global: the FP4 layer at 1024 rows on dequant_fp8 returns the
    FP8 layer's (fp4_to_fp8.convert_linear of a copy) prefill output bit for bit: the same e4m3 bytes and scales, the
    same per-token quantization of x, the same cuBLASLt call."""
    sizes, k = [4096, 1024, 1024], 4096
    layers = []
    for _ in range(2):
        layer = MergedColumnParallelLinear(k, sizes, bias=True).to(CUDA, DT)
        Fp4LinearMethod(Fp4Config(fmt, serialized=False)).create_weights(layer)
        layers.append(layer)
    seed = torch.Generator("cuda").manual_seed(3)
    for shard, n in enumerate(sizes):
        w = torch.randn(n, k, device=CUDA, generator=seed) * 0.02 * (1 + shard)
        for layer in layers:
            layer.load_weight("weight", layer.weight, w, shard)
    bias = torch.randn(sum(sizes), device=CUDA, dtype=DT, generator=gen)
    for layer in layers:
        layer.bias.data.copy_(bias)
    fp4, fp8 = layers
    convert_linear(fp8, Fp8LinearMethod(FP8_LAYOUT))
    x = torch.randn(1024, k, device=CUDA, dtype=DT, generator=gen)
    tile = Fp4GemmTile("dequant_fp8", default_config("dequant_fp8", 1024, sum(sizes), k, GROUP[fmt], sm_count(CUDA)))
    monkeypatch.setattr(gemm_mod, "gemm_tile", lambda *args: tile)
    monkeypatch.setattr(gemm_mod.Fp4Rule, "route", lambda self, fmt, n, k, m: "bf16")
    got, want = fp4(x), fp8(x)
    assert fp8.quant_method._route(x, sum(sizes), k).path == "w8a8"  # the FP8 linear's prefill path
    assert torch.equal(got, want)


def test_fp4_linear_on_the_variant_replays_equal_to_eager(monkeypatch):
    """Captured in a CUDA graph (the conversion's transient from the graph's pool), replayed over new x."""
    n, k = SHAPES["down"]
    gen = torch.Generator("cuda").manual_seed(17)
    packed, scale, gs = fp4_weight((), n, k, "nvfp4", gen)
    tile = Fp4GemmTile("dequant_fp8", default_config("dequant_fp8", 512, n, k, 16, sm_count(CUDA)))
    monkeypatch.setattr(gemm_mod, "gemm_tile", lambda *args: tile)
    monkeypatch.setattr(gemm_mod.Fp4Rule, "route", lambda self, fmt, n, k, m: "bf16")
    rs = fp8_row_scales(packed, scale, "nvfp4")
    x = torch.randn(512, k, device=CUDA, dtype=DT, generator=gen)
    graph, out = capture(lambda: fp4_linear(x, packed, scale, gs, "nvfp4", fp8_row_scale=rs))
    for _ in range(2):
        x.copy_(torch.randn(512, k, device=CUDA, dtype=DT, generator=gen))
        graph.replay()
        eager = fp4_linear(x, packed, scale, gs, "nvfp4", fp8_row_scale=rs)
        assert torch.equal(out, eager)
        assert rel_err(out, fp4_gemm_reference(x, packed, scale, gs, "nvfp4", variant="dequant_fp8")) < 1e-2
