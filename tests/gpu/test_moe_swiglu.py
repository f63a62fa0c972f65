"""gpt-oss's routed experts (biases, the clamped ``swiglu_oai`` activation) on the MoE kernels in bf16 at
gpt-oss-20b's expert shape (32 experts, hidden 2880, intermediate 2880, top-4), on the GPU.

Fresh random inputs per batch (1, 7, 64, 256, 2048) against an fp32 loop over experts, with gate/up large enough
that the clamps bind; both expert paths forced at small batches; FusedMoE with biases captured into a CUDA graph
with padding rows and replayed on new inputs, equal to an eager call bit for bit, padding rows zero.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import capture, rel_err

from graphserve.kernels.moe_fused import fused_experts
from graphserve.kernels.moe_reference import activation_reference, expert_counts_reference
from graphserve.kernels.moe_routing import moe_softmax_topk
from graphserve.layers.moe import FusedMoE, SoftmaxTopK

DT = torch.bfloat16
TOL = 2e-2
E, H, INTER, K = 32, 2880, 2880, 4
LIMIT = 7.0


@pytest.fixture(scope="module")
def experts() -> tuple[torch.Tensor, ...]:
    """bf16 weights and biases; gate/up at three times the usual scale so |gate|, |up| pass the limit."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda", generator=gen) * 3 * H**-0.5).to(DT)
    w2 = (torch.randn(E, H, INTER, device="cuda", generator=gen) * INTER**-0.5).to(DT)
    b13 = torch.randn(E, 2 * INTER, device="cuda", generator=gen).to(DT)
    b2 = torch.randn(E, H, device="cuda", generator=gen).to(DT)
    return w13, w2, b13, b2


def _reference(x, w13, w2, b13, b2, weights, ids) -> torch.Tensor:
    """fp32 loop over the experts that received pairs."""
    t, k = ids.shape
    out = torch.zeros(t, H, device="cuda")
    flat = ids.reshape(-1).long()
    for e in flat.unique().tolist():
        pairs = torch.nonzero(flat == e).flatten()
        rows = x[pairs // k].float()
        gate_up = rows @ w13[e].float().T + b13[e].float()
        act = activation_reference(gate_up, torch.float32, "swiglu_oai", 1.702, LIMIT)
        down = act @ w2[e].float().T + b2[e].float()
        out.index_add_(0, pairs // k, down * weights.reshape(-1)[pairs, None])
    return out


def _epilogue(b13, b2) -> dict:
    return {"w13_bias": b13, "w2_bias": b2, "activation": "swiglu_oai", "alpha": 1.702, "limit": LIMIT}


@pytest.mark.parametrize("t", [1, 7, 64, 256, 2048])
def test_fused_experts_with_biases_and_swiglu_oai_at_gpt_oss_20b_shape(t, experts, gen):
    w13, w2, b13, b2 = experts
    x = torch.randn(t, H, device="cuda", generator=gen).to(DT)
    w, ids = moe_softmax_topk(torch.randn(t, E, device="cuda", generator=gen), K, True)
    counts = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    out = fused_experts(x, w13, w2, w, ids, counts=counts, **_epilogue(b13, b2))
    assert not out.isnan().any()
    assert rel_err(out, _reference(x, w13, w2, b13, b2, w, ids)) < TOL
    assert torch.equal(counts, expert_counts_reference(ids, None, E))
    gate = (x[:1].float() @ w13[ids[0, 0].long()].float().T)[0, :INTER]
    assert gate.abs().max() > LIMIT  # the clamp binds at these scales


@pytest.mark.parametrize("t", [1, 2, 7])
def test_both_paths_agree_at_small_batches(t, experts, gen):
    w13, w2, b13, b2 = experts
    x = torch.randn(t, H, device="cuda", generator=gen).to(DT)
    w, ids = moe_softmax_topk(torch.randn(t, E, device="cuda", generator=gen), K, True)
    ref = _reference(x, w13, w2, b13, b2, w, ids)
    for path in ("gemv", "gemm"):
        assert rel_err(fused_experts(x, w13, w2, w, ids, path=path, **_epilogue(b13, b2)), ref) < TOL, path


@pytest.mark.parametrize("padded, real", [(8, 5), (64, 37)])
def test_layer_with_biases_under_cuda_graph_replay(padded, real, experts, gen):
    w13, w2, b13, b2 = experts
    layer = FusedMoE(E, K, H, INTER, SoftmaxTopK(E, K, True), dtype=DT, device="cuda", activation="swiglu_oai",
                     bias=True, swiglu_limit=LIMIT)  # fmt: skip
    for param, value in ((layer.w13_weight, w13), (layer.w2_weight, w2), (layer.w13_bias, b13), (layer.w2_bias, b2)):
        param.copy_(value)
    x = torch.randn(padded, H, device="cuda", generator=gen).to(DT)
    logits = torch.randn(padded, E, device="cuda", generator=gen)
    valid = torch.tensor(padded, device="cuda")
    graph, out = capture(lambda: layer(x, logits, valid=valid))
    x.copy_(torch.randn(padded, H, device="cuda", generator=gen).to(DT))
    logits.copy_(torch.randn(padded, E, device="cuda", generator=gen) * 3)
    x[real:] = float("nan")  # padding rows hold stale data: nothing of them may reach the output
    logits[real:] = float("nan")
    valid.fill_(real)
    graph.replay()
    torch.cuda.synchronize()
    replay_out = out.clone()
    assert torch.equal(replay_out, layer(x, logits, valid=valid))
    assert torch.equal(replay_out[real:], torch.zeros(padded - real, H, device="cuda", dtype=DT))
    assert int(layer.expert_counts.sum()) == real * K
    w, ids = moe_softmax_topk(logits[:real], K, True)
    assert rel_err(replay_out[:real], _reference(x[:real], w13, w2, b13, b2, w, ids)) < TOL
