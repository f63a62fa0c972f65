"""gpt-oss's experts on the MoE kernels (expert biases, the clamped ``swiglu_oai`` activation) against their
PyTorch reference, on CPU through Triton's interpreter: both paths (grouped GEMM, streaming), padding rows and
an expert-parallel slice, inputs large enough that the clamps bind; and FusedMoE's kernel path against its CPU
path. The plain SiLU experts' checks are tests/kernels/test_moe_interp.py's, unchanged."""

from __future__ import annotations

import torch
from interp_setup import kernel_device, use_interpreter

use_interpreter("graphserve.layers.moe")

import pytest  # noqa: E402

from graphserve.kernels.moe_fused import fused_experts  # noqa: E402
from graphserve.kernels.moe_reference import (  # noqa: E402
    activation_reference,
    expert_counts_reference,
    experts_reference,
    softmax_topk_reference,
)
from graphserve.layers.moe import FusedMoE, SoftmaxTopK  # noqa: E402

from test_moe_interp import E, GEMM, GEMV, H, INTER, _randn, routed_tokens  # noqa: E402  # isort: skip

DEVICE = kernel_device()
LIMIT = 1.5  # below the spread of gate/up at these scales, so both clamps cut some values


def test_swiglu_oai_reference_is_transformers_gpt_oss_activation():
    """The reference on [gate; up] against transformers' GptOssExperts._apply_gate on the interleaved layout."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(5, 16, generator=gen) * 6, torch.randn(5, 16, generator=gen) * 6
    interleaved = torch.stack((gate, up), dim=-1).reshape(5, 32)
    hf = GptOssExperts.__new__(GptOssExperts)
    hf.alpha, hf.limit = 1.702, 7.0
    want = GptOssExperts._apply_gate(hf, interleaved)
    got = activation_reference(torch.cat((gate, up), dim=-1), torch.float32, "swiglu_oai", 1.702, 7.0)
    assert (gate > 7).any() and (up.abs() > 7).any()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", ["gemm", "gemv"])
@pytest.mark.parametrize("t,k,expert_start,num_local,padded,h,inter", [(7, 2, 0, E, False, H, INTER),
                                                                       (9, 3, 2, 3, True, 64, 32)])
def test_fused_experts_with_biases_and_swiglu_oai_match_reference(path, t, k, expert_start, num_local, padded, h,
                                                                   inter):  # fmt: skip
    gen = torch.Generator().manual_seed(t * k + num_local)
    w13, w2 = _randn(num_local, 2 * inter, h, gen=gen, scale=0.3), _randn(num_local, h, inter, gen=gen, scale=0.3)
    b13, b2 = _randn(num_local, 2 * inter, gen=gen), _randn(num_local, h, gen=gen)
    x, topk_w, topk_ids, valid = routed_tokens(gen, t, h, k, padded)
    counts = torch.full((E,), -1, dtype=torch.int32, device=DEVICE)
    epilogue = {"w13_bias": b13, "w2_bias": b2, "activation": "swiglu_oai", "alpha": 1.702, "limit": LIMIT}
    out = fused_experts(x, w13, w2, topk_w, topk_ids, valid=valid, expert_start=expert_start, counts=counts,
                        path=path, gemm_tiles=GEMM, gemv_tiles=GEMV, **epilogue)  # fmt: skip
    want = experts_reference(x, w13, w2, topk_w, topk_ids, valid, expert_start, **epilogue)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(counts.cpu(), expert_counts_reference(topk_ids, valid, E).cpu())
    # the biases and the clamps matter: without them the answer is another
    plain = experts_reference(x, w13, w2, topk_w, topk_ids, valid, expert_start, activation="swiglu_oai",
                              limit=LIMIT)  # fmt: skip
    unclamped = experts_reference(x, w13, w2, topk_w, topk_ids, valid, expert_start, **{**epilogue, "limit": 1e4})
    rows = slice(0, t - 2) if padded else slice(None)
    assert not torch.allclose(plain[rows], want[rows], rtol=1e-2) and not torch.allclose(unclamped[rows], want[rows],
                                                                                          rtol=1e-2)  # fmt: skip
    if padded:
        assert torch.equal(out[-2:].cpu(), torch.zeros(2, h))


def test_fused_experts_refuses_a_bias_of_the_wrong_shape_by_name():
    gen = torch.Generator().manual_seed(3)
    w13, w2 = _randn(E, 2 * INTER, H, gen=gen), _randn(E, H, INTER, gen=gen)
    x = _randn(4, H, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(4, E, gen=gen), 2, True)
    with pytest.raises(ValueError, match=r"w2_bias must be a contiguous torch.float32 \[6, 40\], got .* \[6, 24\]"):
        fused_experts(x, w13, w2, topk_w, topk_ids, w2_bias=torch.zeros(E, INTER, device=DEVICE))
    with pytest.raises(ValueError, match=r"activation='gelu' must be one of \('silu', 'swiglu_oai', 'silu_clamp'\)"):
        fused_experts(x, w13, w2, topk_w, topk_ids, activation="gelu")


@pytest.mark.parametrize("path", ["gemm", "gemv"])
def test_fused_experts_with_deepseek_v4_clamped_silu_match_reference(path):
    gen = torch.Generator().manual_seed(21)
    t, k = 7, 2
    w13, w2 = _randn(E, 2 * INTER, H, gen=gen, scale=0.3), _randn(E, H, INTER, gen=gen, scale=0.3)
    x, topk_w, topk_ids, valid = routed_tokens(gen, t, H, k, True)
    out = fused_experts(x, w13, w2, topk_w, topk_ids, valid=valid, path=path, gemm_tiles=GEMM, gemv_tiles=GEMV,
                        activation="silu_clamp", limit=LIMIT)  # fmt: skip
    want = experts_reference(x, w13, w2, topk_w, topk_ids, valid, 0, activation="silu_clamp", limit=LIMIT)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    plain = experts_reference(x, w13, w2, topk_w, topk_ids, valid, 0)  # the clamps bind: plain SiLU differs
    assert not torch.allclose(plain[: t - 2], want[: t - 2], rtol=1e-2)
    assert torch.equal(out[-2:].cpu(), torch.zeros(2, H))


def test_layer_with_biases_kernel_path_matches_cpu_path():
    gen = torch.Generator().manual_seed(11)
    layer = FusedMoE(E, 2, H, INTER, SoftmaxTopK(E, 2, True), dtype=torch.float32, activation="swiglu_oai",
                     bias=True, swiglu_limit=LIMIT).to(DEVICE)  # fmt: skip
    with torch.no_grad():
        for p in (layer.w13_weight, layer.w2_weight):
            p.copy_(_randn(*p.shape, gen=gen, scale=0.3))
        for p in (layer.w13_bias, layer.w2_bias):
            p.copy_(_randn(*p.shape, gen=gen))
    x, logits = _randn(6, H, gen=gen), _randn(6, E, gen=gen)
    layer.use_kernels = False
    want = layer(x, logits, valid=torch.tensor(4, device=DEVICE))
    layer.use_kernels = True
    got = layer(x, logits, valid=torch.tensor(4, device=DEVICE))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(got[4:].cpu(), torch.zeros(2, H))
