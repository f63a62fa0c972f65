"""The streaming FP4 matmul's word widenings (kernels/fp4_words.py: "word", "e4m3") against plain PyTorch, on CPU
through Triton's interpreter: each int32-word widening exact for every nibble in every position, x's eight column
slices in order, and fp4_gemv with each widening on both paths (FMA and dot, split-K with a short last split, K not a whole number
of steps, both prologues) and the experts' streaming path against the contract's dequantization
(kernels/fp4_reference.py). "e4m3_ptx" is inline PTX, which the interpreter cannot run: it is refused here, and
tests/gpu/test_fp4.py compares it bit for bit with its twin "e4m3". Conventions as tests/kernels/test_fp4_interp.py's:
NaN-poisoned outputs and rows past M, fp16 x on the dot path and the prologues.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from interp_setup import kernel_device, use_interpreter

use_interpreter()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from graphserve.kernels.fp4_gemv import (  # noqa: E402
    Fp4StreamConfig,
    fp4_gemv,
    stream_config,
)
from graphserve.kernels.fp4_layout import DEFAULT_WIDEN, default_widen, split8, widen8  # noqa: E402
from graphserve.kernels.fp4_moe import fp4_fused_experts  # noqa: E402
from graphserve.kernels.fp4_reference import fp4_codes_to_float, unpack_fp4  # noqa: E402

from test_fp4_interp import (  # noqa: E402  # isort: skip
    _dev,
    _weight,
    check_experts_out,
    check_gemv,
    check_prologues,
    experts_case,
)

DEVICE = kernel_device()


@triton.jit
def _widen_words_kernel(w_ptr, o_ptr, o8_ptr, x_ptr, xo_ptr):
    i = tl.arange(0, 512)
    w = tl.load(w_ptr + i)
    v0, v1, v2, v3, v4, v5, v6, v7 = widen8(w, 1)
    tl.store(o_ptr + 8 * i, v0.to(tl.float32))
    tl.store(o_ptr + 8 * i + 1, v1.to(tl.float32))
    tl.store(o_ptr + 8 * i + 2, v2.to(tl.float32))
    tl.store(o_ptr + 8 * i + 3, v3.to(tl.float32))
    tl.store(o_ptr + 8 * i + 4, v4.to(tl.float32))
    tl.store(o_ptr + 8 * i + 5, v5.to(tl.float32))
    tl.store(o_ptr + 8 * i + 6, v6.to(tl.float32))
    tl.store(o_ptr + 8 * i + 7, v7.to(tl.float32))
    v0, v1, v2, v3, v4, v5, v6, v7 = widen8(w, 2)
    tl.store(o8_ptr + 8 * i, v0.to(tl.float32))
    tl.store(o8_ptr + 8 * i + 1, v1.to(tl.float32))
    tl.store(o8_ptr + 8 * i + 2, v2.to(tl.float32))
    tl.store(o8_ptr + 8 * i + 3, v3.to(tl.float32))
    tl.store(o8_ptr + 8 * i + 4, v4.to(tl.float32))
    tl.store(o8_ptr + 8 * i + 5, v5.to(tl.float32))
    tl.store(o8_ptr + 8 * i + 6, v6.to(tl.float32))
    tl.store(o8_ptr + 8 * i + 7, v7.to(tl.float32))
    offs = tl.arange(0, 4)[:, None, None] * 64 + tl.arange(0, 8)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    x0, x1, x2, x3, x4, x5, x6, x7 = split8(tl.load(x_ptr + offs), 4, 8)
    o2 = tl.arange(0, 4)[:, None] * 64 + tl.arange(0, 8)[None, :] * 8
    tl.store(xo_ptr + o2, x0)
    tl.store(xo_ptr + o2 + 1, x1)
    tl.store(xo_ptr + o2 + 2, x2)
    tl.store(xo_ptr + o2 + 3, x3)
    tl.store(xo_ptr + o2 + 4, x4)
    tl.store(xo_ptr + o2 + 5, x5)
    tl.store(xo_ptr + o2 + 6, x6)
    tl.store(xo_ptr + o2 + 7, x7)


def test_word_widening_is_exact_and_split8_keeps_order():
    gen = torch.Generator().manual_seed(1)
    # every byte value in every byte position of a word (sign bit 31 included), then random words
    ramp = torch.arange(256, dtype=torch.uint8)
    raw = torch.cat([ramp, ramp.roll(64), ramp.roll(128), ramp.roll(192)]).view(4, 256).T.contiguous()
    raw = torch.cat([raw.flatten(), torch.randint(0, 256, (1024,), dtype=torch.uint8, generator=gen)])
    words = raw.view(torch.int32)
    assert words.numel() == 512
    out, out8 = (torch.full((4096,), float("nan"), device=DEVICE) for _ in range(2))
    x = torch.randn(256, generator=gen)
    xo = torch.full((256,), float("nan"), device=DEVICE)
    _widen_words_kernel[(1,)](words.to(DEVICE), out, out8, x.to(DEVICE), xo)
    want = fp4_codes_to_float(unpack_fp4(raw))
    assert torch.equal(out.cpu() * 2**14, want) and torch.equal(out8.cpu() * 2**6, want)
    assert torch.equal(xo.cpu(), x)


WIDENINGS = ("word", "e4m3")  # the interpreter's; "e4m3_ptx" on the GPU
# (fmt, rows, N, K, tiles, bias); K 224 / 160 / 352 are whole groups, not whole steps
WORD_CASES = [
    ("nvfp4", 1, 40, 224, Fp4StreamConfig(16, 64, 1, False), True),
    ("mxfp4", 3, 24, 160, Fp4StreamConfig(8, 128, 1, False), False),
    ("nvfp4", 2, 40, 224, Fp4StreamConfig(16, 64, 3, False), False),  # split-K, a short last split
    ("mxfp4", 20, 40, 352, Fp4StreamConfig(16, 128, 1, True), True),
    ("nvfp4", 7, 24, 352, Fp4StreamConfig(16, 128, 2, True), True),  # dot + split-K
]


@pytest.mark.parametrize("widen", WIDENINGS)
@pytest.mark.parametrize("fmt,m,n,k,tiles,with_bias", WORD_CASES)
def test_fp4_gemv_word_widenings_match_reference(fmt, m, n, k, tiles, with_bias, widen):
    gen = torch.Generator().manual_seed(m * 131 + n + k + len(widen))
    check_gemv(gen, fmt, m, n, k, dataclasses.replace(tiles, widen=widen), with_bias)


@pytest.mark.parametrize("widen", WIDENINGS)
@pytest.mark.parametrize("use_dot", [False, True])
def test_fp4_gemv_word_widening_prologues(use_dot, widen):
    m, n, k, fmt = (6, 24, 160, "mxfp4") if use_dot else (2, 24, 96, "nvfp4")
    check_prologues(torch.Generator().manual_seed(17 + use_dot + len(widen)), fmt, m, n, k,
                    Fp4StreamConfig(16 if use_dot else 8, 128 if use_dot else 64, 2, use_dot, widen=widen))


def test_word_widening_refusals_name_the_field_and_limit():
    packed, scale = _weight(torch.Generator().manual_seed(3), (), 8, 256, "mxfp4")
    x = torch.randn(8, 256).half()
    with pytest.raises(ValueError, match="widen='nibble' must be one of"):
        fp4_gemv(x, packed, scale, None, "mxfp4", config=Fp4StreamConfig(16, 128, 1, True, widen="nibble"))
    with pytest.raises(ValueError, match="needs block_k >= 128"):
        fp4_gemv(x, packed, scale, None, "mxfp4", config=Fp4StreamConfig(16, 64, 1, True, widen="word"))
    shifted = torch.zeros(8 * 128 + 2, dtype=torch.uint8)[2:].view(8, 128)
    with pytest.raises(ValueError, match=r"storage offset \(2\)"):
        fp4_gemv(x[:1], shifted, scale, None, "mxfp4", config=Fp4StreamConfig(8, 64, 1, False, widen="word"))
    with pytest.raises(ValueError, match="widen='e4m3_ptx' runs inline PTX, CUDA only"):
        fp4_gemv(x[:1], packed, scale, None, "mxfp4", config=Fp4StreamConfig(8, 64, 1, False, widen="e4m3_ptx"))
    # the word widening is the default, by measurement on an H100; a PTX widening off CUDA becomes its Triton twin
    assert DEFAULT_WIDEN == "word" and stream_config(1, 4096, 4096, 16, 132).widen == "word"
    assert stream_config(1, 4096, 4096, 16, 132, widen="word").widen == "word"
    cpu = torch.device("cpu")
    assert default_widen(cpu) == "word" and default_widen(cpu, "e4m3_ptx") == "e4m3"
    assert default_widen(cpu, "word") == "word"


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # swiglu_oai's sigmoid of a large negative gate: 0
@pytest.mark.parametrize("widen", WIDENINGS)
@pytest.mark.parametrize("fmt,activation,t,k,start,local,h,inter", [
    ("nvfp4", "silu", 4, 2, 0, 5, 96, 64),
    ("mxfp4", "swiglu_oai", 3, 3, 1, 4, 64, 96),
])  # fmt: skip
def test_fp4_experts_stream_word_widenings_match_reference(fmt, activation, t, k, start, local, h, inter, widen):
    ref, inputs = experts_case(torch.Generator().manual_seed(t * 19 + h + inter), fmt, activation, t, k, start,
                               local, h, inter)  # fmt: skip
    x, w13, s13, g13, w2, s2, g2, weights, ids, valid, b13, b2 = _dev(*inputs)
    out = fp4_fused_experts(x, w13, s13, g13, w2, s2, g2, fmt, weights, ids, valid=valid, expert_start=start,
                            w13_bias=b13, w2_bias=b2, activation=activation, path="stream", widen=widen)  # fmt: skip
    check_experts_out(out, ref)
    with pytest.raises(ValueError, match="widen='half' must be one of"):
        fp4_fused_experts(x, w13, s13, g13, w2, s2, g2, fmt, weights, ids, path="stream", widen="half")
