"""FP4 kernels (streaming matmul, tiled GEMM, routed experts) against plain PyTorch, on CPU through Triton's
interpreter.

Weights are random bytes (every E2M1 code, -0 included) with random block scales, dequantized by the contract's
reference (kernels/fp4_reference.py), so the kernels' bit tricks are checked against the format's definition, not
against themselves. Shapes are tiny and not multiples of the tiles (N past the last tile, K
a whole number of scale groups but not of steps); outputs are poisoned with NaN before the call and x's rows
past M are NaN. The dot paths and the prologues run fp16 x here: the interpreter's bf16 dot computes on the raw
bits and its bf16 roundings are not the GPU's (the GPU tests run bf16). The fp8 GEMM variant takes x whose rows quantize exactly (values on the e4m3 grid, each row's
amax 448): the interpreter's fp8 rounding differs from the GPU's, and this checks the kernel's arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error

use_interpreter()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from graphserve.kernels.fp4_experts_reference import fp4_fused_experts_reference  # noqa: E402
from graphserve.kernels.fp4_gemm import Fp4GemmConfig, Fp4Rule, fp4_gemm, fp4_linear  # noqa: E402
from graphserve.kernels.fp4_gemm_config import default_config  # noqa: E402
from graphserve.kernels.fp4_gemv import (  # noqa: E402
    Fp4StreamConfig,
    fp4_gemv,
    fp4_norm_gemv,
    fp4_norm_gemv_reference,
    fp4_silu_mul_gemv,
    stream_config,
)
from graphserve.kernels.fp4_layout import widen_fp8, widen_fp16  # noqa: E402
from graphserve.kernels.fp4_moe import fp4_fused_experts  # noqa: E402
from graphserve.kernels.fp4_reference import fp4_codes_to_float, fp4_dequantize, unpack_fp4  # noqa: E402

DEVICE = kernel_device()


def _dequant(packed, scale, global_scale, fmt):
    """fp32 weights by the contract's reference (kernels/fp4_reference.py)."""
    return fp4_dequantize(packed, scale, global_scale, fmt)


def _weight(gen, lead, n, k, fmt):
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=gen)
    if fmt == "nvfp4":
        scale = (torch.rand(*lead, n, k // 16, generator=gen) * 0.6 + 0.02).to(torch.float8_e4m3fn)
    else:
        scale = torch.randint(118, 126, (*lead, n, k // 32), dtype=torch.uint8, generator=gen)
    return packed, scale


def _x(gen, m, k, dtype, spare=3):
    """x [m, k] as the first rows of a buffer whose other rows are NaN: a read past M would show."""
    buf = torch.randn(m + spare, k, generator=gen).to(dtype)
    buf[m:] = float("nan")
    return buf[:m]


def _ref(x, packed, scale, gs, fmt, bias=None):
    out = x.float() @ _dequant(packed, scale, gs, fmt).T
    return out + bias.float() if bias is not None else out


def _dev(*ts):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts]


def check_gemv(gen, fmt, m, n, k, cfg, with_bias):
    """fp4_gemv under ``cfg`` (fp16 x on the dot path, bf16 on FMA) against the reference, into a NaN-poisoned
    output."""
    dtype = torch.float16 if cfg.use_dot else torch.bfloat16
    packed, scale = _weight(gen, (), n, k, fmt)
    gs = torch.tensor(0.7) if fmt == "nvfp4" else None
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    x = _x(gen, m, k, dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    ref = _ref(x, packed, scale, gs, fmt, bias)
    x, packed, scale, gs, bias, out = _dev(x, packed, scale, gs, bias, out)
    fp4_gemv(x, packed, scale, gs, fmt, bias, out, config=cfg)
    assert not out.isnan().any()
    assert relative_error(out.cpu(), ref) < 8e-3


def check_prologues(gen, fmt, m, n, k, cfg):
    """fp4_norm_gemv (with a residual) and fp4_silu_mul_gemv under ``cfg`` against the reference, in fp16: the
    prologue rounds intermediates, which the interpreter's bf16 does not as the GPU does."""
    dtype = torch.float16
    packed, scale = _weight(gen, (), n, k, fmt)
    gs = torch.tensor(1.3) if fmt == "nvfp4" else None
    x, res = _x(gen, m, k, dtype), torch.randn(m, k, generator=gen).to(dtype)
    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    ref, summed = fp4_norm_gemv_reference(x, nw, 1e-6, packed, scale, gs, fmt, None, res)
    gate_up = _x(gen, m, 2 * k, dtype)
    g, u = gate_up.float().chunk(2, dim=-1)
    silu_ref = _ref((torch.nn.functional.silu(g) * u).to(dtype), packed, scale, gs, fmt)
    x, res, nw, packed, scale, gs, gate_up = _dev(x, res, nw, packed, scale, gs, gate_up)
    out, res_out = fp4_norm_gemv(x, nw, 1e-6, packed, scale, gs, fmt, residual=res, config=cfg)
    assert relative_error(out.cpu(), ref) < 8e-3 and torch.equal(res_out.cpu(), summed)
    out = fp4_silu_mul_gemv(gate_up, packed, scale, gs, fmt, config=cfg)
    assert relative_error(out.cpu(), silu_ref) < 8e-3


def experts_case(gen, fmt, activation, t, k, start, local, h, inter):
    """Random biased experts ``[start, start + local)`` of ``start + local + 1`` (one past this rank's: its pairs
    are not ours), fp16 tokens whose last is a NaN padding row; the reference's output and the inputs, on CPU:
    (x, w13, s13, g13, w2, s2, g2, weights, ids, valid, b13, b2)."""
    total = start + local + 1
    w13, s13 = _weight(gen, (local,), 2 * inter, h, fmt)
    w2, s2 = _weight(gen, (local,), h, inter, fmt)
    g13 = torch.rand(local, 2, generator=gen) + 0.5 if fmt == "nvfp4" else None
    g2 = torch.rand(local, 1, generator=gen) + 0.5 if fmt == "nvfp4" else None
    b13 = torch.randn(local, 2 * inter, generator=gen).half()
    b2 = torch.randn(local, h, generator=gen).half()
    x = torch.randn(t, h, generator=gen).half() * 2
    ids = torch.stack([torch.randperm(total, generator=gen)[:k] for _ in range(t)]).int()
    weights = torch.rand(t, k, generator=gen)
    valid = torch.ones(t, dtype=torch.bool)
    valid[-1] = False  # a padding row: NaN input and router output, zeros out
    x[-1], weights[-1] = float("nan"), float("nan")
    ref = fp4_fused_experts_reference(x, w13, s13, g13, w2, s2, g2, fmt, weights, ids, valid=valid,
                                      expert_start=start, w13_bias=b13, w2_bias=b2, activation=activation)  # fmt: skip
    return ref, (x, w13, s13, g13, w2, s2, g2, weights, ids, valid, b13, b2)


def check_experts_out(out, ref):
    """No NaN, zeros on the padding row, within fp16's error of the reference."""
    assert not out.isnan().any() and torch.equal(out[-1].cpu(), torch.zeros(out.shape[1], dtype=out.dtype))
    assert relative_error(out.cpu(), ref) < 5e-3


@triton.jit
def _widen_kernel(b_ptr, o16_ptr, o8_ptr):
    i = tl.arange(0, 256)
    b = tl.load(b_ptr + i).to(tl.int32)
    lo, hi = widen_fp16(b)
    tl.store(o16_ptr + 2 * i, lo.to(tl.float32))
    tl.store(o16_ptr + 2 * i + 1, hi.to(tl.float32))
    lo8, hi8 = widen_fp8(b)
    tl.store(o8_ptr + 2 * i, lo8.to(tl.float8e4nv, bitcast=True).to(tl.float32))
    tl.store(o8_ptr + 2 * i + 1, hi8.to(tl.float8e4nv, bitcast=True).to(tl.float32))


def test_widening_is_exact_for_every_byte():
    b = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    o16 = torch.full((512,), float("nan"), device=DEVICE)
    o8 = torch.full((512,), float("nan"), device=DEVICE)
    _widen_kernel[(1,)](b, o16, o8)
    want = fp4_codes_to_float(unpack_fp4(b.cpu()))
    assert torch.equal(o16.cpu() * 2**14, want) and torch.equal(o8.cpu() * 2**6, want)


# (fmt, rows, N, K, tiles, bias); K 224 / 160 are whole groups, not whole 64- or 128-wide steps
STREAM_CASES = [
    ("nvfp4", 1, 40, 224, Fp4StreamConfig(16, 64, 1, False), True),
    ("mxfp4", 3, 24, 160, Fp4StreamConfig(8, 128, 1, False), False),
    ("nvfp4", 2, 40, 224, Fp4StreamConfig(16, 64, 3, False), False),  # split-K, a short last split
    ("mxfp4", 20, 40, 224, Fp4StreamConfig(16, 64, 1, True), True),
    ("nvfp4", 7, 24, 160, Fp4StreamConfig(16, 64, 2, True), True),  # dot + split-K
]


@pytest.mark.parametrize("fmt,m,n,k,cfg,with_bias", STREAM_CASES)
def test_fp4_gemv_matches_reference(fmt, m, n, k, cfg, with_bias):
    check_gemv(torch.Generator().manual_seed(m * 131 + n + k), fmt, m, n, k, cfg, with_bias)


@pytest.mark.parametrize("use_dot", [False, True])
def test_fp4_gemv_prologues_match_reference(use_dot):
    m, n, k, fmt = (6, 24, 96, "mxfp4") if use_dot else (2, 24, 96, "nvfp4")
    check_prologues(torch.Generator().manual_seed(7 + use_dot), fmt, m, n, k,
                    Fp4StreamConfig(16 if use_dot else 8, 64, 2, use_dot))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_fp4_gemm_matches_reference(fmt, variant):
    gen = torch.Generator().manual_seed(len(fmt) + len(variant))
    m, n, k = 37, 40, 224 if variant == "bf16" else 192
    packed, scale = _weight(gen, (), n, k, fmt)
    gs = torch.tensor(0.45) if fmt == "nvfp4" else None
    bias = torch.randn(n, generator=gen).half()
    x = _x(gen, m, k, torch.float16)
    if variant == "fp8":  # on the e4m3 grid with each row's amax 448: per-token quantization is exact
        x = (x.float() * 60).to(torch.float8_e4m3fn).half()
        x[:, 5] = 448.0
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    ref = _ref(x, packed, scale, gs, fmt, bias)
    cfg = Fp4GemmConfig(16, 32 if variant == "bf16" else 64, 64 if variant == "bf16" else 32, group_m=2, num_warps=4, num_stages=1)
    x, packed, scale, gs, bias, out = _dev(x, packed, scale, gs, bias, out)
    fp4_gemm(x, packed, scale, gs, fmt, bias, out, variant=variant, config=cfg)
    assert not out.isnan().any()
    assert relative_error(out.cpu(), ref) < 2e-3


def test_fp4_linear_routes_by_rows_and_rule():
    rule = Fp4Rule("card", {("nvfp4", 40, 224): (4, 64), ("mxfp4", 40, 224): (16, 0)})
    assert [rule.route("nvfp4", 40, 224, m) for m in (1, 4, 5, 63, 64, 4096)] == \
        ["stream", "stream", "bf16", "bf16", "fp8", "fp8"]  # fmt: skip
    assert [rule.route("mxfp4", 40, 224, m) for m in (16, 17, 4096)] == ["stream", "bf16", "bf16"]
    assert [rule.route("mxfp4", 8, 64, m) for m in (8, 9, 31, 32)] == ["stream", "bf16", "bf16", "fp8"]  # defaults
    gen = torch.Generator().manual_seed(11)
    packed, scale = _weight(gen, (), 24, 64, "mxfp4")
    x = torch.randn(2, 1, 64, generator=gen).half()
    ref = _ref(x.view(2, 64), packed, scale, None, "mxfp4")
    x, packed, scale = _dev(x, packed, scale)
    out = fp4_linear(x, packed, scale, None, "mxfp4")
    assert out.shape == (2, 1, 24) and relative_error(out.view(2, 24).cpu(), ref) < 2e-3


def test_tiles_are_a_function_of_the_shape():
    """Llama-3-8B's shapes on a 132-SM card: the down projection (few columns, long K) splits K until about two
    programs an SM, the wide ones do not; K steps are whole scale groups; the fp8 GEMM steps one 32-wide MMA, and the
    tiled GEMM takes small batches in 16-row tiles."""
    down, gate_up = stream_config(1, 4096, 14336, 16, 132), stream_config(1, 28672, 4096, 16, 132)
    assert down.split_k > 1 and triton.cdiv(4096, down.block_n) * down.split_k >= 2 * 132
    assert gate_up.split_k == 1 and not gate_up.use_dot
    for m in (1, 4, 5, 16, 64):
        cfg = stream_config(m, 6144, 4096, 32, 132)
        assert cfg.use_dot == (m > 4) and cfg.block_k % 32 == 0
    assert default_config("fp8", 16384, 4096, 4096, 16, 132).block_k == 32
    assert default_config("bf16", 9, 4096, 4096, 16, 132).block_m == 16  # x the MMA's first operand


def test_fp4_refusals_name_the_tensor_and_limit():
    packed, scale = _weight(torch.Generator().manual_seed(3), (), 8, 64, "nvfp4")
    x = torch.randn(1, 64).half()
    with pytest.raises(ValueError, match=r"scale must be contiguous torch.float8_e4m3fn \(8, 4\)"):
        fp4_gemv(x, packed, scale[:, :2].contiguous(), torch.tensor(1.0), "nvfp4")
    with pytest.raises(ValueError, match="nvfp4 needs an fp32 global scale"):
        fp4_gemv(x, packed, scale, None, "nvfp4")
    with pytest.raises(ValueError, match="at most 64 rows"):
        fp4_gemv(torch.randn(65, 64).half(), packed, scale, torch.tensor(1.0), "nvfp4")
    with pytest.raises(ValueError, match="holds K = 64"):
        fp4_gemm(torch.randn(4, 96).half(), packed, scale, torch.tensor(1.0), "nvfp4")


# (fmt, path, activation, tokens, top-k, first local expert, local experts, hidden, intermediate)
MOE_CASES = [
    ("nvfp4", "stream", "silu", 4, 2, 0, 5, 96, 64),
    ("mxfp4", "stream", "swiglu_oai", 3, 3, 1, 4, 64, 96),
    ("nvfp4", "gemm", "swiglu_oai", 7, 2, 0, 5, 96, 48),
    ("mxfp4", "gemm", "silu", 6, 2, 2, 3, 64, 64),
    ("nvfp4", "stream", "silu_clamp", 3, 2, 0, 4, 64, 64),  # DeepSeek-V4's experts
    ("mxfp4", "gemm", "silu_clamp", 6, 2, 1, 3, 64, 64),
]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # swiglu_oai's sigmoid of a large negative gate: 0
@pytest.mark.parametrize("fmt,path,activation,t,k,start,local,h,inter", MOE_CASES)
def test_fp4_fused_experts_match_reference(fmt, path, activation, t, k, start, local, h, inter):
    gen = torch.Generator().manual_seed(t * 17 + h + inter + k)
    ref, inputs = experts_case(gen, fmt, activation, t, k, start, local, h, inter)
    ids, valid, total = inputs[8], inputs[9], start + local + 1
    want_counts = torch.bincount(ids[valid].flatten().long(), minlength=total).int()
    x, w13, s13, g13, w2, s2, g2, weights, ids, valid, b13, b2 = _dev(*inputs)
    counts = torch.full((total,), -1, dtype=torch.int32, device=DEVICE)
    out = fp4_fused_experts(x, w13, s13, g13, w2, s2, g2, fmt, weights, ids, valid=valid, expert_start=start,
                            counts=counts, w13_bias=b13, w2_bias=b2, activation=activation, path=path)  # fmt: skip
    check_experts_out(out, ref)
    assert torch.equal(counts.cpu()[start:start + local], want_counts[start:start + local])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("fmt,activation", [("mxfp4", "swiglu_oai"), ("nvfp4", "silu")])
def test_fp4_stream_down_per_pair_equals_per_token(fmt, activation):
    """The streaming down projection's two grids: a program per pair then the slot sum, or a program per token
    over its slots; the same fp32 terms added in the same slot order, so the same bits, and the reference's output
    (an expert of another rank and a padding row included)."""
    gen = torch.Generator().manual_seed(31 + len(fmt))
    ref, inputs = experts_case(gen, fmt, activation, 3, 3, 1, 4, 64, 96)
    x, w13, s13, g13, w2, s2, g2, weights, ids, valid, b13, b2 = _dev(*inputs)
    outs = [fp4_fused_experts(x, w13, s13, g13, w2, s2, g2, fmt, weights, ids, valid=valid, expert_start=1,
                              w13_bias=b13, w2_bias=b2, activation=activation, path="stream", down_per_pair=per_pair)
            for per_pair in (True, False)]  # fmt: skip
    check_experts_out(outs[0], ref)
    assert torch.equal(outs[0], outs[1])
