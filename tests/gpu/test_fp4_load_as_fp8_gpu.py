"""On CUDA: the FP4 kernels' per-output-row global scales (dense under CUDA-graph replay, routed experts), and ``--fp4-load-as fp8`` (an
NVFP4 checkpoint and ``--quantization nvfp4`` converted to FP8 at load) running the FP8 kernels, against the same
conversion's CPU reference and through the engine with CUDA graphs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gpu_utils import capture, rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_utils import PagedHarness, held_weight_bytes, make_hf_checkpoint  # noqa: E402

from graphserve.kernels.fp4_gemm import FP8_DTYPE, fp4_linear, linear_path  # noqa: E402
from graphserve.kernels.fp4_reference import fp4_linear_reference, nvfp4_quantize  # noqa: E402

CUDA = torch.device("cuda")


@pytest.mark.parametrize("m", [1, 8, 64, 256])
def test_per_row_globals_match_the_reference_and_replay(m):
    """llama3-8b's fused qkv [4096 + 1024 + 1024, 4096], each part quantized with its own global: the rows' globals
    in the kernels' epilogue, at the rows of each route (stream, bf16 and fp8 GEMM variants)."""
    gen = torch.Generator("cuda").manual_seed(m)
    parts = [torch.randn(n, 4096, device=CUDA, generator=gen) * 0.02 * (1 + i) for i, n in enumerate((4096, 1024, 1024))]
    quantized = [nvfp4_quantize(w) for w in parts]
    packed = torch.cat([q[0] for q in quantized])
    scale = torch.cat([q[1] for q in quantized])
    rows = torch.cat([q[2].float().expand(w.shape[0]) for q, w in zip(quantized, parts)]).contiguous()
    assert rows.unique().numel() == 3
    x = torch.randn(m, 4096, device=CUDA, generator=gen).to(torch.bfloat16)
    graph, out = capture(lambda: fp4_linear(x, packed, scale, rows, "nvfp4"))
    x.copy_(torch.randn(m, 4096, device=CUDA, generator=gen).to(torch.bfloat16))
    graph.replay()
    assert torch.equal(out, fp4_linear(x, packed, scale, rows, "nvfp4"))
    xr = x.float()
    if linear_path("nvfp4", packed.shape[0], 4096, m, CUDA)[0] == "fp8":  # W4A8: x per token in fp8, as the kernel
        s = (xr.abs().amax(dim=1, keepdim=True) / torch.finfo(FP8_DTYPE).max).clamp(min=1e-12)
        xr = (xr / s).clamp(-448.0, 448.0).to(FP8_DTYPE).float() * s
    assert rel_err(out, fp4_linear_reference(xr, packed, scale, rows, "nvfp4")) < 2e-2


@pytest.mark.parametrize("t,path", [(2, "stream"), (64, "gemm")])
def test_per_row_expert_globals_match_the_reference(t, path):
    """Experts at qwen3-30b-a3b's shapes (8 of its 128) with one global per w13 and w2 row, on both paths."""
    from graphserve.kernels.fp4_experts_reference import fp4_fused_experts_reference
    from graphserve.kernels.fp4_moe import fp4_fused_experts

    gen = torch.Generator("cuda").manual_seed(t)
    e, h, i, k = 8, 2048, 768, 4
    w13, s13, _ = nvfp4_quantize(torch.randn(e, 2 * i, h, device=CUDA, generator=gen) * 0.05)
    w2, s2, _ = nvfp4_quantize(torch.randn(e, h, i, device=CUDA, generator=gen) * 0.05)
    g13 = torch.rand(e, 2 * i, device=CUDA, generator=gen) + 0.25
    g2 = torch.rand(e, h, device=CUDA, generator=gen) + 0.25
    x = torch.randn(t, h, device=CUDA, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=CUDA, generator=gen)[:k] for _ in range(t)]).int()
    weights = torch.rand(t, k, device=CUDA, generator=gen)
    out = fp4_fused_experts(x, w13, s13, g13, w2, s2, g2, "nvfp4", weights, ids, path=path)
    want = fp4_fused_experts_reference(x, w13, s13, g13, w2, s2, g2, "nvfp4", weights, ids)
    assert rel_err(out, want) < 1.5e-2  # as tests/gpu/test_fp4.py holds the per-part globals


def test_nvfp4_checkpoint_as_fp8_tracks_its_cpu_reference(tmp_path):
    """A ModelOpt NVFP4 checkpoint (dense and experts, each part its own global) converted at load on CUDA and on
    the CPU: the same FP8 weights (the conversion is exact arithmetic on powers of two), the GPU side adding the FP8
    kernels' activation rounding and bf16 (the bound of tests/gpu/test_fp8.py's checkpoint test)."""
    from transformers import Qwen3MoeConfig

    from graphserve.config import EngineConfig
    from graphserve.layers.attention_triton import TritonAttentionBackend
    from graphserve.models.fp4_checkpoint import quantize_checkpoint_nvfp4
    from graphserve.models.loader import load_model

    config = Qwen3MoeConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                            mlp_only_layers=[1], tie_word_embeddings=False)
    make_hf_checkpoint(tmp_path / "src", config, seed=3)
    quantize_checkpoint_nvfp4(tmp_path / "src", tmp_path / "fp4")
    gpu = load_model(EngineConfig(model=str(tmp_path / "fp4"), device="cuda", fp4_load_as="fp8"), CUDA)
    cpu = load_model(EngineConfig(model=str(tmp_path / "fp4"), fp4_load_as="fp8"), torch.device("cpu"))
    assert gpu.info.description.weights_bytes == held_weight_bytes(gpu.model)
    experts = gpu.model.get_submodule("model.layers.0.mlp.experts")
    assert experts.w13_weight.dtype == FP8_DTYPE
    assert torch.equal(experts.w13_weight.cpu().float(),
                       cpu.model.get_submodule("model.layers.0.mlp.experts").w13_weight.float())
    g = PagedHarness(gpu.model, block_size=16, dtype=torch.bfloat16, device=CUDA, backend=TritonAttentionBackend())
    c = PagedHarness(cpu.model, block_size=16)
    prompt = list(range(10, 70))
    with torch.inference_mode():
        errors = [rel_err(g.step([("s", prompt)])[0].cpu(), c.step([("s", prompt)])[0])]
        for t in (3, 5, 7):
            errors.append(rel_err(g.step([("s", [t])])[0].cpu(), c.step([("s", [t])])[0]))
    assert max(errors) < 0.2, errors


def test_nvfp4_as_fp8_dummy_model_generates_with_cuda_graphs(release_engines):
    from graphserve import LLM, SamplingParams

    prompts = [[100 + i, 200 + i, 300 + i] for i in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM("dummy:qwen3-0.6b", quantization="nvfp4", fp4_load_as="fp8", max_model_len=512, cuda_graph_max_bs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(len(o.token_ids) == 16 for o in outs)
    decode = [r for r in llm.engine.core.telemetry.records() if r.kind == "decode"]
    assert decode and any(r.graph for r in decode)
