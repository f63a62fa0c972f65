"""FP4 kernels on the GPU at model shapes: Llama-3-8B's projections through the streaming kernel and both GEMM
variants, gpt-oss-120b's experts (MXFP4, swiglu_oai, biases; hidden 2880, intermediate 2880, 128 experts top-4)
and Qwen3-30B-A3B's (NVFP4, SiLU) through both expert paths, and CUDA-graph replay equal to eager.

Fresh random bf16 activations and random FP4 bytes with random block scales, against the dequantizing
references beside the kernels (kernels/fp4_reference.py's dequantization, fp32 matmul; for the fp8 GEMM variant x
quantized per token as the kernel's input is) and kernels/fp4_experts_reference.py; bf16 output rounding sets the
thresholds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from gpu_utils import capture, rel_err

from graphserve.kernels.common import sm_count
from graphserve.kernels.fp4_experts_reference import fp4_fused_experts_reference
from graphserve.kernels.fp4_gemm import fp4_gemm, fp4_gemm_reference, fp4_linear, linear_path
from graphserve.kernels.fp4_gemv import (
    fp4_gemv,
    fp4_gemv_reference,
    fp4_norm_gemv,
    fp4_norm_gemv_reference,
    fp4_silu_mul_gemv,
    fp4_silu_mul_gemv_reference,
    stream_config,
)
from graphserve.kernels.fp4_layout import GROUP, widen8
from graphserve.kernels.fp4_moe import fp4_fused_experts
from graphserve.kernels.fp4_reference import fp4_codes_to_float, unpack_fp4

DT = torch.bfloat16
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# name: (experts, hidden, intermediate, top_k, fmt, activation, biases)
MOE = {
    "gpt-oss-120b": (128, 2880, 2880, 4, "mxfp4", "swiglu_oai", True),
    "qwen3-30b-a3b": (128, 2048, 768, 8, "nvfp4", "silu", False),
}


def fp4_weight(lead: tuple[int, ...], n: int, k: int, fmt: str, gen: torch.Generator):
    """Random codes (every E2M1 value) with scales of a real checkpoint's size: outputs of order one."""
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    if fmt == "nvfp4":
        scale = (torch.rand(*lead, n, k // 16, device="cuda", generator=gen) * 40 + 8).to(torch.float8_e4m3fn)
        glob = torch.full((), 1.0 / (448 * 6 * (k ** 0.5) / 8), device="cuda")
    else:
        scale = torch.randint(119, 123, (*lead, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
        glob = None
    return packed, scale, glob


@pytest.mark.parametrize("proj", list(LLAMA3_8B))
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_stream_and_gemm_at_llama3_8b_shapes(proj, fmt):
    n, k = LLAMA3_8B[proj]
    gen = torch.Generator("cuda").manual_seed(n + k + len(fmt))
    packed, scale, gs = fp4_weight((), n, k, fmt, gen)
    bias = torch.randn(n, device="cuda", dtype=DT, generator=gen)
    for m in (1, 3, 8, 32, 64):
        x = torch.randn(m, k, device="cuda", dtype=DT, generator=gen)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=DT)
        fp4_gemv(x, packed, scale, gs, fmt, bias, out)
        assert rel_err(out, fp4_gemv_reference(x, packed, scale, gs, fmt, bias)) < 1e-2, (proj, fmt, m)
    for m in (100, 1024):
        x = torch.randn(m, k, device="cuda", dtype=DT, generator=gen)
        for variant in ("bf16", "fp8"):
            out = fp4_gemm(x, packed, scale, gs, fmt, bias, variant=variant)
            ref = fp4_gemm_reference(x, packed, scale, gs, fmt, bias, variant=variant)
            assert rel_err(out, ref) < 1e-2, (proj, fmt, m, variant)
        path, _ = linear_path(fmt, n, k, m, x.device)  # the variant fp4_linear takes, against its reference
        ref = fp4_gemm_reference(x, packed, scale, gs, fmt, bias, variant=path)
        assert rel_err(fp4_linear(x, packed, scale, gs, fmt, bias), ref) < 1e-2, (proj, fmt, m, path)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_prologues_at_llama3_8b_shapes(fmt):
    gen = torch.Generator("cuda").manual_seed(5)
    for m in (2, 16):
        n, k = LLAMA3_8B["qkv"]
        packed, scale, gs = fp4_weight((), n, k, fmt, gen)
        x, res = (torch.randn(m, k, device="cuda", dtype=DT, generator=gen) for _ in range(2))
        nw = torch.rand(k, device="cuda", dtype=DT, generator=gen) + 0.5
        out, summed = fp4_norm_gemv(x, nw, 1e-5, packed, scale, gs, fmt, residual=res)
        ref, ref_sum = fp4_norm_gemv_reference(x, nw, 1e-5, packed, scale, gs, fmt, None, res)
        assert rel_err(out, ref) < 1e-2 and torch.equal(summed, ref_sum)
        n, k = LLAMA3_8B["down"]
        packed, scale, gs = fp4_weight((), n, k, fmt, gen)
        gate_up = torch.randn(m, 2 * k, device="cuda", dtype=DT, generator=gen)
        out = fp4_silu_mul_gemv(gate_up, packed, scale, gs, fmt)
        assert rel_err(out, fp4_silu_mul_gemv_reference(gate_up, packed, scale, gs, fmt)) < 1e-2


def _experts(name: str, gen: torch.Generator):
    e, h, inter, k, fmt, activation, biases = MOE[name]
    w13, s13, _ = fp4_weight((e,), 2 * inter, h, fmt, gen)
    w2, s2, _ = fp4_weight((e,), h, inter, fmt, gen)
    g13 = g2 = b13 = b2 = None
    if fmt == "nvfp4":
        g13 = torch.rand(e, 2, device="cuda", generator=gen) / (448 * 6 * h ** 0.5 / 8)
        g2 = torch.rand(e, 1, device="cuda", generator=gen) / (448 * 6 * inter ** 0.5 / 8)
    if biases:
        b13 = torch.randn(e, 2 * inter, device="cuda", dtype=DT, generator=gen)
        b2 = torch.randn(e, h, device="cuda", dtype=DT, generator=gen)
    return dict(w13=w13, w13_scale=s13, w13_global=g13, w2=w2, w2_scale=s2, w2_global=g2, fmt=fmt,
                w13_bias=b13, w2_bias=b2, activation=activation), (e, h, k)


def _routing(t: int, e: int, k: int, gen: torch.Generator):
    logits = torch.randn(t, e, device="cuda", generator=gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.int()


@pytest.mark.parametrize("name", list(MOE))
@pytest.mark.parametrize("t,path", [(1, "stream"), (4, "stream"), (4, "gemm"), (64, "gemm"), (512, None)])
def test_fp4_experts_at_model_shapes(name, t, path):
    gen = torch.Generator("cuda").manual_seed(t + len(name))
    w, (e, h, k) = _experts(name, gen)
    x = torch.randn(t, h, device="cuda", dtype=DT, generator=gen)
    weights, ids = _routing(t, e, k, gen)
    counts = torch.full((e,), -1, device="cuda", dtype=torch.int32)
    out = fp4_fused_experts(x, w["w13"], w["w13_scale"], w["w13_global"], w["w2"], w["w2_scale"], w["w2_global"],
                            w["fmt"], weights, ids, counts=counts, w13_bias=w["w13_bias"], w2_bias=w["w2_bias"],
                            activation=w["activation"], path=path)  # fmt: skip
    ref = fp4_fused_experts_reference(x, w["w13"], w["w13_scale"], w["w13_global"], w["w2"], w["w2_scale"],
                                w["w2_global"], w["fmt"], weights, ids, w13_bias=w["w13_bias"],
                                w2_bias=w["w2_bias"], activation=w["activation"])  # fmt: skip
    assert rel_err(out, ref) < 1.5e-2, (name, t, path)
    assert torch.equal(counts, torch.bincount(ids.flatten().long(), minlength=e).int())


@pytest.mark.parametrize("t", [1, 2, 8])
def test_fp4_stream_down_grids_agree_at_gpt_oss_shapes(t):
    """The streaming down projection per pair (then the slot sum) and per token: the same bits, the reference's
    output; at 1-2 tokens the shape picks per pair on a card of 90+ SMs (kernels/fp4_moe.stream_down_per_pair)."""
    gen = torch.Generator("cuda").manual_seed(7 + t)
    w, (e, h, k) = _experts("gpt-oss-120b", gen)
    x = torch.randn(t, h, device="cuda", dtype=DT, generator=gen)
    weights, ids = _routing(t, e, k, gen)
    args = (x, w["w13"], w["w13_scale"], w["w13_global"], w["w2"], w["w2_scale"], w["w2_global"], w["fmt"],
            weights, ids)
    opts = dict(w13_bias=w["w13_bias"], w2_bias=w["w2_bias"], activation=w["activation"], path="stream")
    per_pair, per_token = (fp4_fused_experts(*args, **opts, down_per_pair=p) for p in (True, False))
    assert torch.equal(per_pair, per_token), t
    ref = fp4_fused_experts_reference(*args, w13_bias=w["w13_bias"], w2_bias=w["w2_bias"],
                                      activation=w["activation"])  # fmt: skip
    assert rel_err(per_pair, ref) < 1.5e-2, t


def test_fp4_graph_replay_equals_eager():
    gen = torch.Generator("cuda").manual_seed(99)
    n, k = LLAMA3_8B["down"]
    packed, scale, gs = fp4_weight((), n, k, "nvfp4", gen)
    for m in (1, 32, 256):
        x = torch.randn(m, k, device="cuda", dtype=DT, generator=gen)
        graph, out = capture(lambda x=x: fp4_linear(x, packed, scale, gs, "nvfp4"))
        for _ in range(2):
            x.copy_(torch.randn(m, k, device="cuda", dtype=DT, generator=gen))
            graph.replay()
            assert torch.equal(out, fp4_linear(x, packed, scale, gs, "nvfp4")), m
    w, (e, h, topk) = _experts("gpt-oss-120b", gen)
    for t in (2, 64):
        x = torch.randn(t, h, device="cuda", dtype=DT, generator=gen)
        weights, ids = _routing(t, e, topk, gen)
        valid = torch.ones(t, device="cuda", dtype=torch.bool)

        def step(x=x, weights=weights, ids=ids, valid=valid):
            return fp4_fused_experts(x, w["w13"], w["w13_scale"], None, w["w2"], w["w2_scale"], None, "mxfp4",
                                     weights, ids, valid=valid, w13_bias=w["w13_bias"], w2_bias=w["w2_bias"],
                                     activation="swiglu_oai")  # fmt: skip

        graph, out = capture(step)
        for _ in range(2):
            x.copy_(torch.randn(t, h, device="cuda", dtype=DT, generator=gen))
            new_w, new_ids = _routing(t, e, topk, gen)
            weights.copy_(new_w)
            ids.copy_(new_ids)
            valid[-1] = False
            graph.replay()
            eager = step()
            assert torch.equal(out, eager), t
            assert not out[-1].any()


# the streaming kernels' widenings (kernels/fp4_words.py): each against the reference and against the default
WIDENINGS = ("word", "e4m3", "e4m3_ptx")


@triton.jit
def _widen8_kernel(w_ptr, o_ptr, WIDEN: tl.constexpr):
    i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    v0, v1, v2, v3, v4, v5, v6, v7 = widen8(tl.load(w_ptr + i), WIDEN)
    tl.store(o_ptr + 8 * i, v0)
    tl.store(o_ptr + 8 * i + 1, v1)
    tl.store(o_ptr + 8 * i + 2, v2)
    tl.store(o_ptr + 8 * i + 3, v3)
    tl.store(o_ptr + 8 * i + 4, v4)
    tl.store(o_ptr + 8 * i + 5, v5)
    tl.store(o_ptr + 8 * i + 6, v6)
    tl.store(o_ptr + 8 * i + 7, v7)


def test_ptx_widening_equals_its_twin_bit_for_bit():
    """"e4m3_ptx" (inline PTX) and "e4m3" (Triton) give the same fp16 bits for every byte in every position of a
    word and for random words; both are the format's values times 2^-6."""
    ramp = torch.arange(256, dtype=torch.uint8, device="cuda")
    raw = torch.stack([ramp, ramp.roll(64), ramp.roll(128), ramp.roll(192)], dim=1).flatten()
    gen = torch.Generator("cuda").manual_seed(8)
    raw = torch.cat([raw, torch.randint(0, 256, (4 * 1024 * 64 - raw.numel(),), dtype=torch.uint8, device="cuda",
                                        generator=gen)])  # fmt: skip
    words = raw.view(torch.int32)
    outs = {}
    for code in (2, 3):
        outs[code] = torch.full((words.numel() * 8,), float("nan"), dtype=torch.float16, device="cuda")
        _widen8_kernel[(words.numel() // 1024,)](words, outs[code], WIDEN=code)
    assert torch.equal(outs[2].view(torch.int16), outs[3].view(torch.int16))
    assert torch.equal(outs[3].float() * 2**6, fp4_codes_to_float(unpack_fp4(raw)))


@pytest.mark.parametrize("widen", WIDENINGS)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_stream_widenings_at_llama3_8b_shapes(fmt, widen):
    for proj, (n, k) in LLAMA3_8B.items():
        gen = torch.Generator("cuda").manual_seed(n + k + len(fmt) + len(widen))
        packed, scale, gs = fp4_weight((), n, k, fmt, gen)
        bias = torch.randn(n, device="cuda", dtype=DT, generator=gen)
        for m in (1, 3, 8, 64) if proj == "qkv" else (1, 8):  # FMA at 1 and 3 rows, dot at 8 and 64
            x = torch.randn(m, k, device="cuda", dtype=DT, generator=gen)
            cfg = stream_config(m, n, k, GROUP[fmt], sm_count(x.device), widen=widen)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=DT)
            fp4_gemv(x, packed, scale, gs, fmt, bias, out, config=cfg)
            byte = fp4_gemv(x, packed, scale, gs, fmt, bias, config=stream_config(m, n, k, GROUP[fmt],
                                                                                  sm_count(x.device)))
            ref = fp4_gemv_reference(x, packed, scale, gs, fmt, bias)
            assert rel_err(out, ref) < 1e-2 and rel_err(out, byte) < 1e-2, (proj, m, widen)
            if widen == "e4m3_ptx":  # and its pure-Triton twin, the same values in the same order
                twin = fp4_gemv(x, packed, scale, gs, fmt, bias, config=dataclasses.replace(cfg, widen="e4m3"))
                assert rel_err(out, twin) < 1e-3, (proj, m)
    n, k = LLAMA3_8B["down"]
    packed, scale, gs = fp4_weight((), n, k, fmt, gen)
    for m in (2, 16):  # both prologues on both paths
        cfg = stream_config(m, n, k, GROUP[fmt], sm_count(torch.device("cuda")), widen=widen)
        x, res = (torch.randn(m, k, device="cuda", dtype=DT, generator=gen) for _ in range(2))
        nw = torch.rand(k, device="cuda", dtype=DT, generator=gen) + 0.5
        out, summed = fp4_norm_gemv(x, nw, 1e-5, packed, scale, gs, fmt, residual=res, config=cfg)
        ref, ref_sum = fp4_norm_gemv_reference(x, nw, 1e-5, packed, scale, gs, fmt, None, res)
        assert rel_err(out, ref) < 1e-2 and torch.equal(summed, ref_sum), m
        gate_up = torch.randn(m, 2 * k, device="cuda", dtype=DT, generator=gen)
        cfg = stream_config(m, n, k, GROUP[fmt], sm_count(torch.device("cuda")), widen=widen)
        out = fp4_silu_mul_gemv(gate_up, packed, scale, gs, fmt, config=cfg)
        assert rel_err(out, fp4_silu_mul_gemv_reference(gate_up, packed, scale, gs, fmt)) < 1e-2, m
    x = torch.randn(1, k, device="cuda", dtype=DT, generator=gen)
    cfg = stream_config(1, n, k, GROUP[fmt], sm_count(x.device), widen=widen)
    graph, out = capture(lambda: fp4_gemv(x, packed, scale, gs, fmt, config=cfg))
    x.copy_(torch.randn(1, k, device="cuda", dtype=DT, generator=gen))
    graph.replay()
    assert torch.equal(out, fp4_gemv(x, packed, scale, gs, fmt, config=cfg))


@pytest.mark.parametrize("widen", WIDENINGS)
@pytest.mark.parametrize("name", list(MOE))
def test_fp4_experts_stream_widenings_at_model_shapes(name, widen):
    gen = torch.Generator("cuda").manual_seed(len(name) + len(widen))
    w, (e, h, k) = _experts(name, gen)
    for t in (1, 4):
        x = torch.randn(t, h, device="cuda", dtype=DT, generator=gen)
        weights, ids = _routing(t, e, k, gen)
        args = (x, w["w13"], w["w13_scale"], w["w13_global"], w["w2"], w["w2_scale"], w["w2_global"], w["fmt"],
                weights, ids)
        opts = dict(w13_bias=w["w13_bias"], w2_bias=w["w2_bias"], activation=w["activation"], path="stream")
        out = fp4_fused_experts(*args, **opts, widen=widen)
        ref = fp4_fused_experts_reference(*args, w13_bias=w["w13_bias"], w2_bias=w["w2_bias"],
                                          activation=w["activation"])  # fmt: skip
        assert rel_err(out, ref) < 1.5e-2 and rel_err(out, fp4_fused_experts(*args, **opts)) < 1.5e-2, (name, t)
