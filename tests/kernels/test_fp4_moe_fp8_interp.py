"""The FP4 routed experts' grouped GEMM in its "fp8" (W4A8) variant against the reference, on CPU through Triton's
interpreter: NVFP4 and MXFP4, each activation, biases, per-part and per-row globals, a padding row (``valid``) and
experts of another rank (``expert_start``), and a gate_up and down in different variants.

Inputs as tests/kernels/test_fp4_interp.py makes them (random bytes and scales, fp16 tokens, a NaN padding row).
The inputs' per-row quantization (kernels/fp8_quant.per_token_group_quant, tested on its own) is swapped for its
torch reference here: the interpreter rounds fp32 to e4m3 without carrying a rounded-up mantissa into the exponent
(124.3 becomes 64, not 128), which the GPU does not. Tolerances:
- against ``fp4_fused_experts_reference(variant="fp8")``, which rounds x and the activation as the kernel's inputs
  are: 5e-3 (fp16 outputs; the fp32 sums' order may flip a rounding of the activation to fp16 and then to e4m3);
- against the unquantized reference: 6e-2, e4m3's 3 mantissa bits (a value's rounding up to 2^-4 of it, about 2.5%
  rms over random values) in x and in the activation before down (measured 0.5-3% a row here).
"""

from __future__ import annotations

import pytest
import torch
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error

use_interpreter()

from graphserve.kernels import fp4_moe  # noqa: E402
from graphserve.kernels.fp4_experts_reference import fp4_fused_experts_reference  # noqa: E402
from graphserve.kernels.fp4_moe import fp4_fused_experts  # noqa: E402
from graphserve.kernels.fp4_moe_config import Fp4MoeTile  # noqa: E402
from graphserve.kernels.fp8_quant import per_token_group_quant_reference  # noqa: E402

DEVICE = kernel_device()
FP8_TOL, PLAIN_TOL = 5e-3, 6e-2


@pytest.fixture(autouse=True)
def torch_rounding(monkeypatch):
    """The inputs' e4m3 rounding by torch (module docstring), on the kernels' device."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(fp4_moe, "per_token_group_quant", lambda x, g: per_token_group_quant_reference(x, g))


def _weight(gen, e, n, k, fmt):
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    if fmt == "nvfp4":
        return packed, (torch.rand(e, n, k // 16, generator=gen) * 0.6 + 0.02).to(torch.float8_e4m3fn)
    return packed, torch.randint(118, 126, (e, n, k // 32), dtype=torch.uint8, generator=gen)


def _case(seed, fmt, activation, t, k, start, local, h, inter, row_global):
    """Experts ``[start, start + local)`` of ``start + local + 1`` with biases; the last token a NaN padding row."""
    gen = torch.Generator().manual_seed(seed)
    total = start + local + 1
    w13, s13 = _weight(gen, local, 2 * inter, h, fmt)
    w2, s2 = _weight(gen, local, h, inter, fmt)
    g13 = g2 = None
    if fmt == "nvfp4":
        g13 = torch.rand(local, 2 * inter if row_global else 2, generator=gen) + 0.5
        g2 = torch.rand(local, h if row_global else 1, generator=gen) + 0.5
    b13 = torch.randn(local, 2 * inter, generator=gen).half()
    b2 = torch.randn(local, h, generator=gen).half()
    # e4m3 values times 2^-6 with each row's amax 7 (448 * 2^-6): the scale amax / 448 is 2^-6 exactly, so x / scale
    # is on the e4m3 grid; small enough that fp16's gate and up do not overflow
    x = ((torch.randn(t, h, generator=gen) * 60).to(torch.float8_e4m3fn).float() * 2**-6).half()
    x[:, 3] = 7.0
    ids = torch.stack([torch.randperm(total, generator=gen)[:k] for _ in range(t)]).int()
    weights = torch.rand(t, k, generator=gen)
    valid = torch.ones(t, dtype=torch.bool)
    valid[-1] = False
    x[-1], weights[-1] = float("nan"), float("nan")
    args = (x, w13, s13, g13, w2, s2, g2, fmt, weights, ids)
    opts = dict(valid=valid, expert_start=start, w13_bias=b13, w2_bias=b2, activation=activation, limit=1.5)
    return args, opts


def _run(args, opts, **kw):
    dev = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    dopts = {name: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for name, v in opts.items()}
    return fp4_fused_experts(*dev, path="gemm", **dopts, **kw)


def _check(out, args, opts, variants=("fp8", "fp8")):
    assert not out.isnan().any() and not out[-1].any()  # the padding row: zeros, whatever its NaN input
    ref8 = fp4_fused_experts_reference(*args, **opts, variant=variants[0])
    if variants[1] != variants[0]:  # gate_up in one variant, down in the other: no single reference, the plain one
        assert relative_error(out.cpu(), fp4_fused_experts_reference(*args, **opts)) < PLAIN_TOL
        return
    assert relative_error(out.cpu(), ref8) < FP8_TOL
    assert relative_error(out.cpu(), fp4_fused_experts_reference(*args, **opts)) < PLAIN_TOL


# (fmt, activation, tokens, top-k, first local expert, local experts, hidden, intermediate, a global per row)
CASES = [
    ("nvfp4", "silu", 7, 2, 0, 4, 64, 96, False),
    ("nvfp4", "swiglu_oai", 6, 3, 1, 3, 96, 64, True),
    ("nvfp4", "silu_clamp", 5, 2, 2, 3, 64, 64, True),
    ("mxfp4", "silu", 6, 2, 1, 3, 96, 64, False),
    ("mxfp4", "swiglu_oai", 7, 2, 0, 4, 64, 96, False),
    ("mxfp4", "silu_clamp", 5, 3, 0, 3, 64, 64, False),
]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # swiglu_oai's sigmoid of a large negative gate: 0
@pytest.mark.parametrize("fmt,activation,t,k,start,local,h,inter,row_global", CASES)
def test_fp8_variant_matches_reference(fmt, activation, t, k, start, local, h, inter, row_global):
    args, opts = _case(t * 31 + h + inter + k + start, fmt, activation, t, k, start, local, h, inter, row_global)
    counts = torch.full((start + local + 1,), -1, dtype=torch.int32, device=DEVICE)
    out = _run(args, opts, variant="fp8", counts=counts)
    _check(out, args, opts)
    ids, valid = args[9], opts["valid"]
    want = torch.bincount(ids[valid].flatten().long(), minlength=start + local + 1).int()
    assert torch.equal(counts.cpu()[start:start + local], want[start:start + local])


@pytest.mark.parametrize("gate_up,down", [("fp8", "bf16"), ("bf16", "fp8")])
def test_each_gemm_takes_its_tiles_variant(gate_up, down):
    """A table may give gate_up and down different variants and tiles (one block_m: one sort)."""
    args, opts = _case(3 + len(gate_up), "nvfp4", "silu", 6, 2, 0, 3, 64, 64, False)
    tiles = tuple(Fp4MoeTile(v, 16, 64 if v == "fp8" else 32, 32 if v == "fp8" else 64, 1, 4, 1)
                  for v in (gate_up, down))  # fmt: skip
    _check(_run(args, opts, tiles=tiles), args, opts, (gate_up, down))


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_tiles_of_64_rows_take_the_weight_as_the_first_operand(variant):
    """From BLOCK_M 64 the bf16 variant multiplies with the widened tile first (kernels/fp4_moe_gemm.py: the other
    order does not compile there for sm_90); both variants at such a tile against the reference."""
    args, opts = _case(11 + len(variant), "mxfp4", "swiglu_oai", 9, 3, 0, 2, 64, 64, False)
    tile = Fp4MoeTile(variant, 64, 64, 32 if variant == "fp8" else 64, 1, 4, 1)
    out = _run(args, opts, tiles=(tile, tile))
    assert not out.isnan().any() and not out[-1].any()
    assert relative_error(out.cpu(), fp4_fused_experts_reference(*args, **opts, variant=variant)) < FP8_TOL


def test_tiles_that_cannot_run_are_refused_by_field_and_limit():
    args, opts = _case(9, "nvfp4", "silu", 3, 2, 0, 2, 48, 64, False)  # hidden 48: not whole 32-column steps
    with pytest.raises(ValueError, match=r"gate_up tile: the fp8 variant steps 32 columns .* K=48"):
        _run(args, opts, variant="fp8")
    bf16 = Fp4MoeTile("bf16", 16, 64, 16)
    with pytest.raises(ValueError, match="block_m 16 and 32 must be equal"):
        _run(args, opts, tiles=(bf16, Fp4MoeTile("bf16", 32, 64, 16)))
    with pytest.raises(ValueError, match=r"block_n=48 must be a power of two"):
        _run(args, opts, tiles=(bf16, Fp4MoeTile("bf16", 16, 48, 16)))
    with pytest.raises(ValueError, match="variant='fp4' must be one of"):
        _run(args, opts, variant="fp4")
