"""Per-output-row NVFP4 global scales in the FP4 streaming kernel, tiled GEMM and routed experts, against the
reference, on CPU through Triton's interpreter: a fused q/k/v or gate/up whose parts carry different globals scales
each row in the kernels' epilogue (no launch after them). Inputs as tests/kernels/test_fp4_interp.py makes them: random
bytes and scales, NaN rows past M, outputs poisoned with NaN."""

from __future__ import annotations

import pytest
import torch
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error

use_interpreter()

from graphserve.kernels.fp4_experts_reference import fp4_fused_experts_reference  # noqa: E402
from graphserve.kernels.fp4_gemm import Fp4GemmConfig, fp4_gemm  # noqa: E402
from graphserve.kernels.fp4_gemv import Fp4StreamConfig, fp4_gemv  # noqa: E402
from graphserve.kernels.fp4_moe import fp4_fused_experts  # noqa: E402
from graphserve.kernels.fp4_reference import fp4_dequantize  # noqa: E402

DEVICE = kernel_device()


def _case(gen, m, n, k, dtype, fp8_x=False):
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // 16, generator=gen) * 0.6 + 0.02).to(torch.float8_e4m3fn)
    # three parts of unequal rows, each its own global, as a fused qkv whose modules ModelOpt scaled apart
    sizes = (n // 2, n // 4, n - n // 2 - n // 4)
    parts = torch.rand(3, generator=gen) * 2 + 0.25
    rows = parts.repeat_interleave(torch.tensor(sizes)).contiguous()
    buf = torch.randn(m + 2, k, generator=gen)
    if fp8_x:  # on the e4m3 grid, each row's amax 448: the fp8 variant's per-token quantization is exact
        buf = (buf * 60).to(torch.float8_e4m3fn).float()
        buf[:, 5] = 448.0
    buf = buf.to(dtype)
    buf[m:] = float("nan")
    x = buf[:m]
    bias = torch.randn(n, generator=gen).to(dtype)
    ref = x.float() @ fp4_dequantize(packed, scale, rows, "nvfp4").T + bias.float()
    assert not torch.allclose(rows, rows[0])  # the case means something only where the parts differ
    return ref, [t.to(DEVICE) for t in (x, packed, scale, rows, bias)]


@pytest.mark.parametrize("m,cfg", [
    (2, Fp4StreamConfig(8, 64, 1, False)),  # FMA
    (7, Fp4StreamConfig(16, 64, 2, True)),  # dot, split-K: the global applied once, after the reduction
])
def test_fp4_gemv_takes_a_global_per_row(m, cfg):
    dtype = torch.float16 if cfg.use_dot else torch.bfloat16
    ref, (x, packed, scale, rows, bias) = _case(torch.Generator().manual_seed(m), m, 40, 224, dtype)
    out = torch.full((m, 40), float("nan"), dtype=dtype, device=DEVICE)
    fp4_gemv(x, packed, scale, rows, "nvfp4", bias, out, config=cfg)
    assert not out.isnan().any()
    assert relative_error(out.cpu(), ref) < 8e-3


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_fp4_gemm_takes_a_global_per_row(variant):
    k = 224 if variant == "bf16" else 192
    ref, (x, packed, scale, rows, bias) = _case(torch.Generator().manual_seed(len(variant)), 37, 40, k,
                                                torch.float16, fp8_x=variant == "fp8")
    out = torch.full((37, 40), float("nan"), dtype=torch.float16, device=DEVICE)
    cfg = Fp4GemmConfig(16, 32 if variant == "bf16" else 64, 64 if variant == "bf16" else 32, group_m=2, num_warps=4, num_stages=1)
    fp4_gemm(x, packed, scale, rows, "nvfp4", bias, out, variant=variant, config=cfg)
    assert not out.isnan().any()
    assert relative_error(out.cpu(), ref) < 2e-3


def test_a_global_of_another_shape_is_refused():
    _, (x, packed, scale, rows, bias) = _case(torch.Generator().manual_seed(3), 2, 40, 224, torch.bfloat16)
    with pytest.raises(ValueError, match=r"fp4_gemv: the global scale must be one value or one per output row \(40,\)"):
        fp4_gemv(x, packed, scale, rows[:20], "nvfp4")
    with pytest.raises(ValueError, match=r"fp4_gemm: the global scale .* got shape \(40, 1\)"):
        fp4_gemm(x, packed, scale, rows.view(40, 1), "nvfp4")


@pytest.mark.parametrize("path", ["stream", "gemm"])
def test_fp4_fused_experts_take_a_global_per_row(path):
    """Routed experts whose w13 carries one global per row ([E, 2I]) and w2 one per row ([E, H]), applied in the
    kernels' epilogues, against the reference (fp16 tokens, a NaN padding row)."""
    gen = torch.Generator().manual_seed(5 + len(path))
    e, t, k, h, inter = 3, 4, 2, 64, 48
    w13 = torch.randint(0, 256, (e, 2 * inter, h // 2), dtype=torch.uint8, generator=gen)
    s13 = (torch.rand(e, 2 * inter, h // 16, generator=gen) * 0.6 + 0.02).to(torch.float8_e4m3fn)
    w2 = torch.randint(0, 256, (e, h, inter // 2), dtype=torch.uint8, generator=gen)
    s2 = (torch.rand(e, h, inter // 16, generator=gen) * 0.6 + 0.02).to(torch.float8_e4m3fn)
    g13, g2 = torch.rand(e, 2 * inter, generator=gen) + 0.25, torch.rand(e, h, generator=gen) + 0.25
    x = torch.randn(t, h, generator=gen).half()
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()
    weights = torch.rand(t, k, generator=gen)
    valid = torch.ones(t, dtype=torch.bool)
    valid[-1] = False
    x[-1], weights[-1] = float("nan"), float("nan")
    ref = fp4_fused_experts_reference(x, w13, s13, g13, w2, s2, g2, "nvfp4", weights, ids, valid=valid)
    args = [a.to(DEVICE) for a in (x, w13, s13, g13, w2, s2, g2)]
    out = fp4_fused_experts(*args[:7], "nvfp4", weights.to(DEVICE), ids.to(DEVICE), valid=valid.to(DEVICE), path=path)
    assert not out.isnan().any() and not out[-1].any()
    assert relative_error(out.cpu(), ref) < 5e-3
