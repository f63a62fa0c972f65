"""FP4 layers on CUDA (kernels/fp4_gemv.fp4_linear, kernels/fp4_moe.fp4_fused_experts through
layers/quant/fp4.py and fp4_moe.py) against their CPU references on fresh random inputs: dense projections whose
fused parts carry different global scales, routed experts with silu and with gpt-oss's swiglu_oai and biases, a
CUDA-graph replay, and an NVFP4 checkpoint end to end."""

from __future__ import annotations

import pytest
import torch
from gpu_utils import capture, rel_err

from graphserve.kernels.fp4_experts_reference import fp4_fused_experts_reference
from graphserve.kernels.fp4_gemm import FP8_DTYPE, linear_path
from graphserve.kernels.fp4_reference import fp4_linear_reference
from graphserve.kernels.moe_reference import softmax_topk_reference
from graphserve.layers.linear import MergedColumnParallelLinear
from graphserve.layers.moe import FusedMoE, SoftmaxTopK
from graphserve.layers.quant.fp4 import Fp4LinearMethod
from graphserve.layers.quant.fp4_config import Fp4Config
from graphserve.layers.quant.fp4_moe import Fp4MoEMethod

CUDA = torch.device("cuda")
BF16_TOL = 2e-2  # bf16 activations and outputs against the fp32 reference of the same bf16 inputs


def _merged(fmt: str, sizes: list[int], k: int, gen: torch.Generator) -> MergedColumnParallelLinear:
    layer = MergedColumnParallelLinear(k, sizes, bias=True).to(CUDA, torch.bfloat16)
    Fp4LinearMethod(Fp4Config(fmt, serialized=False)).create_weights(layer)
    for shard, n in enumerate(sizes):  # each part its own scale of magnitude: distinct global scales
        w = torch.randn(n, k, device=CUDA, generator=gen) * 0.02 * (1 + shard)
        layer.load_weight("weight", layer.weight, w, shard)
    layer.bias.data.normal_(0, 0.1, generator=gen)
    return layer


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [1, 4, 16, 64, 300])
def test_fp4_projection_matches_the_reference(fmt, m, gen):
    layer = _merged(fmt, [1024, 512, 512], 2048, gen)
    if fmt == "nvfp4":
        assert layer.fp4_row_global is not None  # the parts' globals differ: the per-row path
    x = torch.randn(m, 2048, device=CUDA, generator=gen).to(torch.bfloat16)
    g = layer.quant_method.global_rows(layer)
    xr = x.float()
    if linear_path(fmt, layer.weight.shape[0], 2048, m, CUDA)[0] == "fp8":
        # rows the rule gives the fp8 GEMM variant meet the weights as per-token fp8 (W4A8): the reference
        # quantizes x the same way, so the bound stays bf16's rather than fp8's rounding of x
        s = (xr.abs().amax(dim=1, keepdim=True) / torch.finfo(FP8_DTYPE).max).clamp(min=1e-12)
        xr = (xr / s).clamp(-448.0, 448.0).to(FP8_DTYPE).float() * s
    want = fp4_linear_reference(xr, layer.weight, layer.weight_scale, g, fmt, layer.bias)
    assert rel_err(layer(x), want) < BF16_TOL


def test_fp4_projection_with_one_global_replays_in_a_graph(gen):
    layer = _merged("nvfp4", [2048], 4096, gen)
    assert layer.fp4_row_global is None
    x = torch.randn(8, 4096, device=CUDA, generator=gen).to(torch.bfloat16)
    graph, out = capture(lambda: layer(x))
    x.copy_(torch.randn(8, 4096, device=CUDA, generator=gen).to(torch.bfloat16))
    graph.replay()
    want = fp4_linear_reference(x, layer.weight, layer.weight_scale, layer.weight_scale_2[0], "nvfp4", layer.bias)
    assert rel_err(out, want) < BF16_TOL


def _experts(fmt: str, e: int, h: int, i: int, k: int, gen: torch.Generator, activation: str = "silu") -> FusedMoE:
    layer = FusedMoE(e, k, h, i, SoftmaxTopK(e, k, True), dtype=torch.bfloat16, device=CUDA)
    layer.activation = activation
    Fp4MoEMethod(Fp4Config(fmt, serialized=False)).create_weights(layer)
    for expert in range(e):
        for part, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
            w = torch.randn(*shape, device=CUDA, generator=gen) * 0.05
            layer.load_weight("w2_weight" if part == "w2" else "w13_weight", None, w, (expert, part))
    if activation == "swiglu_oai":
        layer.w13_bias = torch.nn.Parameter(torch.randn(e, 2 * i, device=CUDA, generator=gen).to(torch.bfloat16) * 0.1,
                                            requires_grad=False)
        layer.w2_bias = torch.nn.Parameter(torch.randn(e, h, device=CUDA, generator=gen).to(torch.bfloat16) * 0.1,
                                           requires_grad=False)
    return layer


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("t", [1, 8, 64, 512])
def test_fp4_experts_match_the_reference(fmt, activation, t, gen):
    layer = _experts(fmt, 32, 1024, 512, 4, gen, activation)
    x = torch.randn(t, 1024, device=CUDA, generator=gen).to(torch.bfloat16)
    weights, ids = softmax_topk_reference(torch.randn(t, 32, device=CUDA, generator=gen), 4, True)
    got = layer._experts(x, weights, ids, None)
    g13, g2 = layer.quant_method.globals_(layer)
    want = fp4_fused_experts_reference(
        x, layer.w13_weight, layer.w13_weight_scale, g13, layer.w2_weight, layer.w2_weight_scale, g2, fmt, weights,
        ids, w13_bias=getattr(layer, "w13_bias", None), w2_bias=getattr(layer, "w2_bias", None), activation=activation)
    assert rel_err(got, want) < BF16_TOL
    assert int(layer.expert_counts.sum()) == 4 * t


def test_nvfp4_checkpoint_on_cuda_matches_the_cpu_reference(tmp_path):
    """A 6-token prompt: rows the streaming kernels take, where the weights meet bf16 activations as on the CPU
    (W4A16). Prefill chunks from the fp8 variant's rows on quantize x per token (W4A8); each projection and expert
    path is held to its own reference there (test_fp4_projection_matches_the_reference, tests/gpu/test_fp4.py),
    while a random-weight model's logits amplify fp8's rounding of x past any bound a whole-model check could name."""
    from model_utils import PagedHarness, make_hf_checkpoint
    from transformers import Qwen3MoeConfig

    from graphserve.config import EngineConfig
    from graphserve.models.fp4_checkpoint import quantize_checkpoint_nvfp4
    from graphserve.models.loader import load_model

    config = Qwen3MoeConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                            mlp_only_layers=[1], tie_word_embeddings=False)
    make_hf_checkpoint(tmp_path / "src", config, seed=3)
    quantize_checkpoint_nvfp4(tmp_path / "src", tmp_path / "fp4")
    tokens = list(range(5, 11))
    cpu = load_model(EngineConfig(model=str(tmp_path / "fp4")), torch.device("cpu"))
    want = PagedHarness(cpu.model).step([("s", tokens)])[0]
    gpu = load_model(EngineConfig(model=str(tmp_path / "fp4"), dtype="bfloat16"), CUDA)
    got = PagedHarness(gpu.model, dtype=torch.bfloat16, device=CUDA).step([("s", tokens)])[0]
    assert rel_err(got.cpu(), want) < 5e-2
