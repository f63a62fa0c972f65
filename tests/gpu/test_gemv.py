"""The gemv kernels (plain, silu-fused, norm-fused) in bf16 at the decode projections of qwen3-0.6b
and Llama-3-8B, on the GPU.

Fresh random inputs per shape and batch against the fp32 references; a CUDA-graph replay on new
inputs must equal an eager call bit for bit (the decode path runs the kernels only that way); the
layers must route decode-sized batches to the kernels and larger ones to cuBLAS.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_utils import capture, rel_err

from graphserve.kernels.activation import silu_and_mul
from graphserve.kernels.common import sm_count
from graphserve.kernels.gemv import (
    gemv,
    gemv_reference,
    norm_gemv,
    norm_gemv_reference,
    silu_mul_gemv,
    silu_mul_gemv_reference,
)
from graphserve.kernels.gemv_config import GemvRule, choose_config
from graphserve.kernels.norm import fused_add_rms_norm, rms_norm
from graphserve.layers import linear as linear_mod
from graphserve.layers.norm import RMSNorm

DT = torch.bfloat16
TOL = 2e-2
BATCHES = [1, 2, 4, 8, 16]

# name: (N, K) of x @ W.T; qkv and gate_up are the fused projections the model runs
PROJECTIONS = {
    "qwen3-0.6b qkv": (4096, 1024),
    "qwen3-0.6b o_proj": (1024, 2048),
    "qwen3-0.6b gate_up": (6144, 1024),
    "qwen3-0.6b down": (1024, 3072),
    "qwen3-0.6b lm_head": (151936, 1024),
    "llama3-8b qkv": (6144, 4096),
    "llama3-8b o_proj": (4096, 4096),
    "llama3-8b gate_up": (28672, 4096),
    "llama3-8b down": (4096, 14336),
}
DOWN = {"qwen3-0.6b down": (1024, 3072), "llama3-8b down": (4096, 14336)}
NORMED = {"qwen3-0.6b qkv": (4096, 1024), "qwen3-0.6b gate_up": (6144, 1024)}  # the projections a norm feeds
EPS = 1e-6


def weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(DT)


@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize("name", list(PROJECTIONS))
def test_gemv_bf16_model_shapes(name, m, gen):
    n, k = PROJECTIONS[name]
    w = weight(n, k, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).to(DT)
    bias = torch.randn(n, device="cuda", generator=gen).to(DT)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=DT)
    gemv(x, w, out=out)
    assert not out.isnan().any()
    assert rel_err(out, gemv_reference(x, w)) < TOL
    assert rel_err(gemv(x, w, bias), gemv_reference(x, w, bias)) < TOL


@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize("name", list(DOWN))
def test_silu_mul_gemv_bf16_down_projection(name, m, gen):
    n, k = DOWN[name]
    w = weight(n, k, gen)
    gate_up = (torch.randn(m, 2 * k, device="cuda", generator=gen) * 3).to(DT)
    out = silu_mul_gemv(gate_up, w)
    assert rel_err(out, silu_mul_gemv_reference(gate_up, w)) < TOL
    # same activation numbers as the separate kernel, so only the matmul's summation order differs
    assert rel_err(out, gemv(silu_and_mul(gate_up), w)) < 1e-2


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("name", list(NORMED))
def test_norm_gemv_bf16_normed_projections(name, m, gen):
    n, k = NORMED[name]
    w = weight(n, k, gen)
    norm_w = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(DT)
    x = torch.randn(m, k, device="cuda", generator=gen).to(DT)
    residual = (4 * torch.randn(m, k, device="cuda", generator=gen)).to(DT)
    old_residual = residual.clone()

    y, summed = norm_gemv(x, norm_w, EPS, w, residual=residual)
    ref_y, _ = norm_gemv_reference(x, norm_w, EPS, w, residual=residual)
    assert rel_err(y, ref_y) < TOL
    assert torch.equal(residual, old_residual)
    h, unfused_summed = fused_add_rms_norm(x, residual, norm_w, EPS)
    assert torch.equal(summed, unfused_summed)  # the next layer's residual, bit for bit
    assert rel_err(y, gemv(h, w)) < 1e-2

    y_first, none = norm_gemv(x, norm_w, EPS, w)  # the first layer: no residual yet
    assert none is None
    assert rel_err(y_first, norm_gemv_reference(x, norm_w, EPS, w)[0]) < TOL
    assert rel_err(y_first, gemv(rms_norm(x, norm_w, EPS), w)) < 1e-2


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("name", ["qwen3-0.6b down", "llama3-8b qkv"])
def test_cuda_graph_replay_matches_eager(name, m, gen):
    n, k = PROJECTIONS[name]
    cfg = choose_config(m, n, k, sm_count(torch.device("cuda")))
    w = weight(n, k, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).to(DT)
    gate_up = torch.randn(m, 2 * k, device="cuda", generator=gen).to(DT)
    residual, norm_w = torch.randn(m, k, device="cuda", generator=gen).to(DT), torch.ones(k, device="cuda", dtype=DT)
    out, fused = torch.empty(m, n, device="cuda", dtype=DT), torch.empty(m, n, device="cuda", dtype=DT)
    normed, summed = torch.empty(m, n, device="cuda", dtype=DT), torch.empty(m, k, device="cuda", dtype=DT)

    def step() -> None:
        gemv(x, w, out=out)
        silu_mul_gemv(gate_up, w, out=fused)
        norm_gemv(x, norm_w, EPS, w, residual=residual, residual_out=summed, out=normed)

    graph, _ = capture(step)
    x.copy_(torch.randn(m, k, device="cuda", generator=gen).to(DT))
    gate_up.copy_(torch.randn(m, 2 * k, device="cuda", generator=gen).to(DT))
    residual.copy_(torch.randn(m, k, device="cuda", generator=gen).to(DT))
    for buf in (out, fused, normed, summed):
        buf.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv(x, w)), cfg
    assert torch.equal(fused, silu_mul_gemv(gate_up, w)), cfg
    eager_normed, eager_summed = norm_gemv(x, norm_w, EPS, w, residual=residual)
    assert torch.equal(normed, eager_normed) and torch.equal(summed, eager_summed), cfg
    assert rel_err(out, gemv_reference(x, w)) < TOL


@torch.inference_mode()
def test_layers_route_by_the_measured_rule(gen, monkeypatch):
    """Each kind of call takes gemv up to the rows its card's rule lists for its shape, cuBLAS above. The rule is
    one written here (which card's table ships, or was tuned, is not this test's business: tests/kernels/test_tune_tables.py
    covers the lookup), so the routing is checked alike on every card."""
    rule = GemvRule("this card", {("linear", 1024, 3072): 4, ("silu_mul", 1024, 3072): 2, ("norm", 4096, 1024): 2})
    monkeypatch.setattr(linear_mod, "rule_for", lambda device: rule)
    lin = linear_mod.Linear(3072, 1024, bias=True, device="cuda", dtype=DT).requires_grad_(False)  # qwen3-0.6b down
    top = rule.max_rows("linear", 1024, 3072)
    small = torch.randn(top, 3072, device="cuda", generator=gen).to(DT)
    large = torch.randn(top + 1, 3072, device="cuda", generator=gen).to(DT)
    assert linear_mod.use_gemv(small, lin.weight) and not linear_mod.use_gemv(large, lin.weight)
    assert torch.equal(lin(small), gemv(small, lin.weight, lin.bias))
    assert torch.equal(lin(large), F.linear(large, lin.weight, lin.bias))
    fused_top = rule.max_rows("silu_mul", 1024, 3072)
    for rows in {1, fused_top, fused_top + 1} - {0}:
        gate_up = torch.randn(rows, 6144, device="cuda", generator=gen).to(DT)
        expect = (silu_mul_gemv(gate_up, lin.weight, lin.bias) if rows <= fused_top
                  else lin(silu_and_mul(gate_up)))  # fmt: skip
        assert torch.equal(linear_mod.silu_mul_linear(gate_up, lin), expect), rows
    # a norm feeding a projection (qwen3-0.6b qkv): fused into the gemv where measured faster
    qkv = linear_mod.Linear(1024, 4096, bias=False, device="cuda", dtype=DT).requires_grad_(False)
    norm = RMSNorm(1024, EPS).to("cuda", DT)
    norm_top = rule.max_rows("norm", 4096, 1024)
    for rows in {1, norm_top, norm_top + 1} - {0}:
        x = torch.randn(rows, 1024, device="cuda", generator=gen).to(DT)
        residual = torch.randn(rows, 1024, device="cuda", generator=gen).to(DT)
        y, summed = linear_mod.norm_linear(norm, x, residual.clone(), qkv)
        if rows <= norm_top:
            expect_y, expect_summed = norm_gemv(x, norm.weight, EPS, qkv.weight, None, residual)
        else:
            h, expect_summed = fused_add_rms_norm(x, residual, norm.weight, EPS)
            expect_y = qkv(h)
        assert torch.equal(y, expect_y) and torch.equal(summed, expect_summed), rows
    # a shape the benchmark never measured stays on cuBLAS even at one row
    other = torch.empty(1000, 3000, device="cuda", dtype=DT)
    assert not linear_mod.use_gemv(torch.randn(1, 3000, device="cuda", generator=gen).to(DT), other)
