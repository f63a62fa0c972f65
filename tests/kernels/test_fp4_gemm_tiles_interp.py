"""The dense FP4 GEMM (kernels/fp4_gemm.py) under the tiles its table may name, on CPU through Triton's interpreter:
x as the MMA's first operand (16 and 32 rows) and the weight first (64), a K that is not whole steps, split-K (the
partials summed by the second launch), the three variants and both formats, against the dequantizing reference; and
fp4_linear taking the variant and tile its table lists.

As in test_fp4_interp.py: random bytes (every E2M1 code) and scales, fp16 x (the interpreter's bf16 dot is not the
GPU's), NaN past x's rows and in the output before the call; the fp8 variant's x on the e4m3 grid with each row's
amax 448, so per-token quantization is exact and this checks the kernel's arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error

use_interpreter()

from graphserve.kernels import fp4_gemm as gemm_mod  # noqa: E402
from graphserve.kernels import fp4_gemm_config as cfg_mod  # noqa: E402
from graphserve.kernels.fp4_gemm import fp4_gemm, fp4_gemm_reference, fp4_linear  # noqa: E402
from graphserve.kernels.fp4_gemm_config import Fp4GemmConfig, Fp4GemmTile  # noqa: E402

DEVICE = kernel_device()


def _case(gen, fmt, variant, m, n, k, bias=True, per_row=False):
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    if fmt == "nvfp4":
        scale = (torch.rand(n, k // 16, generator=gen) * 0.6 + 0.02).to(torch.float8_e4m3fn)
        gs = torch.rand(n, generator=gen) + 0.3 if per_row else torch.tensor(0.45)
    else:
        scale = torch.randint(118, 126, (n, k // 32), dtype=torch.uint8, generator=gen)
        gs = None
    b = torch.randn(n, generator=gen).half() if bias else None
    buf = torch.randn(m + 3, k, generator=gen).half()
    buf[m:] = float("nan")
    x = buf[:m]
    if variant == "fp8":  # on the e4m3 grid, each row's amax 448: the per-token quantization is exact
        x = (x.float() * 60).clamp(-440, 440).to(torch.float8_e4m3fn).half()
        x[:, 3] = 448.0
    ref = fp4_gemm_reference(x, packed, scale, gs, fmt, b)
    return ref, [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in (x, packed, scale, gs, b)]


# (fmt, variant, m, n, k, tile): x first at 16 and 32 rows, the weight first at 64; K 224 / 160 not whole steps of
# 64 / 128 (a tail masked by scale group); split-K 2 and 3 (whole steps a split; with a tail, the last split's
# steps past K masked)
CASES = [
    ("nvfp4", "bf16", 13, 40, 224, Fp4GemmConfig(16, 32, 64, group_m=2, num_stages=1)),
    ("mxfp4", "bf16", 29, 72, 160, Fp4GemmConfig(32, 64, 128, group_m=1, num_stages=1)),
    ("mxfp4", "bf16", 37, 40, 224, Fp4GemmConfig(64, 16, 32, group_m=2, num_stages=1)),
    ("nvfp4", "bf16", 21, 40, 192, Fp4GemmConfig(16, 32, 32, group_m=2, num_stages=1, split_k=3)),
    ("mxfp4", "bf16", 19, 40, 160, Fp4GemmConfig(16, 32, 64, group_m=2, num_stages=1, split_k=2)),
    ("nvfp4", "fp8", 18, 72, 192, Fp4GemmConfig(16, 64, 32, group_m=2, num_stages=1)),
    ("mxfp4", "fp8", 33, 64, 256, Fp4GemmConfig(32, 64, 32, group_m=2, num_stages=1, split_k=2)),
    ("nvfp4", "dequant", 20, 40, 224, Fp4GemmConfig(16, 16, 64)),  # the weight dequantized (tail masked), cuBLAS
    ("mxfp4", "dequant", 7, 24, 160, Fp4GemmConfig(16, 32, 128)),
]


@pytest.mark.parametrize("fmt,variant,m,n,k,tile", CASES)
def test_fp4_gemm_tiles_match_reference(fmt, variant, m, n, k, tile):
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    ref, (x, packed, scale, gs, bias) = _case(gen, fmt, variant, m, n, k)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)
    fp4_gemm(x, packed, scale, gs, fmt, bias, out, variant=variant, config=tile)
    assert not out.isnan().any()
    assert relative_error(out.cpu(), ref) < 2e-3


@pytest.mark.parametrize("variant", ["bf16", "dequant"])
def test_a_global_per_row_is_applied_once(variant):
    """Split-K: the epilogue (per-row global, bias) runs once, in the second launch, after the partials' sum;
    dequant: the global is folded into the dequantized weight, the bias into the matmul."""
    gen = torch.Generator().manual_seed(5)
    ref, (x, packed, scale, gs, bias) = _case(gen, "nvfp4", "bf16", 9, 24, 128, per_row=True)
    tile = Fp4GemmConfig(16, 16, 32, group_m=1, num_stages=1, split_k=4)
    out = fp4_gemm(x, packed, scale, gs, "nvfp4", bias, variant=variant, config=tile)
    assert relative_error(out.cpu(), ref) < 2e-3


def test_fp4_linear_takes_the_tables_variant_and_tile(monkeypatch):
    """A listed shape runs the table's variant and tile (here split-K fp8 where the rule would say bf16), a pure
    function of the shape; the output matches that variant's reference."""
    seen = []
    real = gemm_mod.fp4_gemm

    def spy(*args, **kwargs):
        seen.append((kwargs["variant"], kwargs["config"]))
        return real(*args, **kwargs)

    tile = Fp4GemmTile("fp8", Fp4GemmConfig(16, 64, 32, group_m=1, num_stages=1, split_k=2))
    monkeypatch.setattr(gemm_mod, "fp4_gemm", spy)
    monkeypatch.setattr(gemm_mod, "gemm_tile", lambda fmt, n, k, m, device, variant: tile)
    gen = torch.Generator().manual_seed(9)
    ref, (x, packed, scale, gs, bias) = _case(gen, "mxfp4", "fp8", 12, 64, 128)
    out = fp4_linear(x.view(3, 4, 128), packed, scale, gs, "mxfp4", bias)
    assert seen == [("fp8", tile.config)] and out.shape == (3, 4, 64)
    assert relative_error(out.view(12, 64).cpu(), ref) < 2e-3


def test_refusals_name_the_field_and_limit():
    gen = torch.Generator().manual_seed(2)
    _, (x, packed, scale, gs, bias) = _case(gen, "nvfp4", "bf16", 4, 16, 96)
    for tile, variant, match in [
        (Fp4GemmConfig(16, 32, 64), "fp8", "steps 32 columns .* got block_k=64"),
        (Fp4GemmConfig(16, 32, 32), "fp8", "block_n=32 must be at least 64"),
        (Fp4GemmConfig(8, 32, 32), "bf16", "block_m=8 must be at least 16"),
        (Fp4GemmConfig(16, 48, 32), "bf16", "block_n=48 must be a power of two"),
        (Fp4GemmConfig(16, 32, 8), "bf16", "block_k=8 must be a multiple of the scale group"),
        (Fp4GemmConfig(16, 32, 32, split_k=16), "bf16", "split_k=16 must be 1 to 8"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            fp4_gemm(x, packed, scale, gs, "nvfp4", variant=variant, config=tile)
    assert cfg_mod.default_config("fp8", 4, 16, 96, 16, 1).block_k == 32
    # splits: whole steps each; where K is whole steps, only counts that divide them (7 or 5 steps: none), else any
    assert [gemm_mod.k_split(Fp4GemmConfig(16, 32, 32, split_k=s), k) for s, k in ((3, 192), (3, 224), (2, 160))] \
        == [64, 224, 160]  # fmt: skip
    assert gemm_mod.k_split(Fp4GemmConfig(16, 32, 64, split_k=2), 160) == 128
