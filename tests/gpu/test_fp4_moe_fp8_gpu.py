"""The FP4 routed experts' grouped GEMM in its fp8 (W4A8) variant, compiled, at DeepSeek-V4-Flash's expert shape
(256 experts, hidden 4096, intermediate 2048, top-6, NVFP4, silu_clamp) with a decode batch of 64 tokens, captured in
a CUDA graph and replayed on new tokens, against the reference; also gpt-oss-120b's MXFP4 experts (biases,
swiglu_oai) and half of V4's experts on this rank (expert parallel).

Tolerances: against ``fp4_fused_experts_reference(variant="fp8")``, which rounds x per token and the activation per
pair to e4m3 as the kernel's inputs are, 1e-2 (bf16 outputs; fp32 sums in another order may flip a bf16 and then an
e4m3 rounding of the activation); against the unquantized reference 6e-2: e4m3's 3 mantissa bits, a value's
rounding up to 2^-4 of it (about 2.5% rms), in x and in the activation before down.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import capture, rel_err

from graphserve.kernels.fp4_experts_reference import fp4_fused_experts_reference
from graphserve.kernels.fp4_moe import fp4_fused_experts

DT = torch.bfloat16
# name: (experts, hidden, intermediate, top-k, fmt, activation, biases)
SHAPES = {
    "deepseek-v4-flash": (256, 4096, 2048, 6, "nvfp4", "silu_clamp", False),
    "gpt-oss-120b": (128, 2880, 2880, 4, "mxfp4", "swiglu_oai", True),
}


def _experts(name: str, local: int, gen: torch.Generator) -> dict:
    e, h, inter, _k, fmt, activation, biases = SHAPES[name]
    out = {"fmt": fmt, "activation": activation, "limit": 10.0 if activation == "silu_clamp" else 7.0}
    for part, n, k in (("w13", 2 * inter, h), ("w2", h, inter)):
        out[part] = torch.randint(0, 256, (local, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        if fmt == "nvfp4":
            out[f"{part}_scale"] = (torch.rand(local, n, k // 16, device="cuda", generator=gen) * 40 + 8).to(
                torch.float8_e4m3fn)
            out[f"{part}_global"] = torch.rand(local, 2 if part == "w13" else 1, device="cuda",
                                               generator=gen) / (448 * 6 * k ** 0.5 / 8)  # fmt: skip
        else:
            out[f"{part}_scale"] = torch.randint(119, 123, (local, n, k // 32), dtype=torch.uint8, device="cuda",
                                                 generator=gen)  # fmt: skip
            out[f"{part}_global"] = None
        out[f"{part}_bias"] = torch.randn(local, n, device="cuda", dtype=DT, generator=gen) if biases else None
    return out


def _call(fn, x, w, weights, ids, valid, start, **kw):
    return fn(x, w["w13"], w["w13_scale"], w["w13_global"], w["w2"], w["w2_scale"], w["w2_global"], w["fmt"], weights,
              ids, valid=valid, expert_start=start, w13_bias=w["w13_bias"], w2_bias=w["w2_bias"],
              activation=w["activation"], limit=w["limit"], **kw)  # fmt: skip


@pytest.mark.parametrize("name,start,local", [("deepseek-v4-flash", 0, 256), ("deepseek-v4-flash", 128, 128),
                                              ("gpt-oss-120b", 0, 128)])  # fmt: skip
def test_fp8_variant_in_a_captured_graph_matches_reference(name, start, local):
    e, h, _inter, k = SHAPES[name][:4]
    gen = torch.Generator("cuda").manual_seed(start + local + h)
    w = _experts(name, local, gen)
    t = 64
    x = torch.randn(t, h, device="cuda", dtype=DT, generator=gen)
    weights = torch.empty(t, k, device="cuda")
    ids = torch.empty(t, k, device="cuda", dtype=torch.int32)
    valid = torch.ones(t, device="cuda", dtype=torch.bool)
    valid[-3:] = False  # padding rows of a captured batch: zeros out, whatever their inputs

    def route() -> None:
        probs = torch.softmax(torch.randn(t, e, device="cuda", generator=gen), -1).topk(k, dim=-1)
        weights.copy_(probs.values / probs.values.sum(-1, keepdim=True))
        ids.copy_(probs.indices.int())

    route()
    counts = torch.full((e,), -1, device="cuda", dtype=torch.int32)
    graph, out = capture(lambda: _call(fp4_fused_experts, x, w, weights, ids, valid, start, counts=counts,
                                       variant="fp8", path="gemm"))  # fmt: skip
    for _ in range(2):  # new tokens and routing into the captured buffers, replayed
        x.copy_(torch.randn(t, h, device="cuda", dtype=DT, generator=gen))
        x[-3:] = float("nan")
        route()
        graph.replay()
        torch.cuda.synchronize()
        ref8 = _call(fp4_fused_experts_reference, x, w, weights, ids, valid, start, variant="fp8")
        ref = _call(fp4_fused_experts_reference, x, w, weights, ids, valid, start)
        assert not out.isnan().any() and not out[-3:].any()
        assert rel_err(out, ref8) < 1e-2, (name, start)
        assert rel_err(out, ref) < 6e-2, (name, start)
        want = torch.bincount(ids[valid].flatten().long(), minlength=e).int()
        assert torch.equal(counts[start:start + local], want[start:start + local])


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_a_prefill_batch_takes_tiles_of_64_rows(variant):
    """3072 tokens over V4's 256 experts, top-6: 72 pairs an expert, so BLOCK_M 64, where the bf16 variant takes the
    widened tile as the MMA's first operand (kernels/fp4_moe_gemm.py); both variants against the reference."""
    e, h, _inter, k = SHAPES["deepseek-v4-flash"][:4]
    gen = torch.Generator("cuda").manual_seed(7 + len(variant))
    w = _experts("deepseek-v4-flash", e, gen)
    t = 3072
    x = torch.randn(t, h, device="cuda", dtype=DT, generator=gen)
    probs = torch.softmax(torch.randn(t, e, device="cuda", generator=gen), -1).topk(k, dim=-1)
    weights, ids = (probs.values / probs.values.sum(-1, keepdim=True)).contiguous(), probs.indices.int().contiguous()
    out = _call(fp4_fused_experts, x, w, weights, ids, None, 0, variant=variant, path="gemm")
    ref = _call(fp4_fused_experts_reference, x, w, weights, ids, None, 0, variant=variant)
    assert rel_err(out, ref) < 1e-2, variant
