"""--quantization on dummy: presets, the plan's FP8 byte counts, and the flag's validation."""

from __future__ import annotations

import argparse

import pytest
import torch
from model_utils import PagedHarness, dummy_preset

from graphserve.analysis.plan import build_plan, load_hf_config
from graphserve.config import EngineConfig, add_engine_args, config_from_args
from graphserve.errors import ConfigError, ModelLoadError
from graphserve.kernels.fp8_quant import FP8_DTYPE, dequantize_blocks
from graphserve.models.loader import load_model

CPU = torch.device("cpu")


@pytest.fixture
def tiny_preset(monkeypatch):
    """qwen3-0.6b's layout at a size the CPU runs in a second; fused parts multiples of 128."""
    return dummy_preset(monkeypatch, "qwen3-0.6b", "tiny-fp8", hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                        max_position_embeddings=256)  # fmt: skip


@pytest.mark.parametrize("quantization", ["fp8", "fp8-block"])
def test_dummy_fp8_is_the_quantized_bf16_dummy(tiny_preset, quantization):
    """Same seed: every FP8 projection dequantizes to within e4m3 rounding of the unquantized weight;
    ``fp8`` stores one scale per output channel, ``fp8-block`` one per 128x128 block."""
    plain = load_model(EngineConfig(model=tiny_preset, seed=2), CPU).model
    fp8 = load_model(EngineConfig(model=tiny_preset, seed=2, quantization=quantization), CPU).model
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        layer, ref = fp8.model.layers[1].get_submodule(name), plain.model.layers[1].get_submodule(name)
        assert layer.weight.dtype == FP8_DTYPE
        if quantization == "fp8-block":
            assert layer.weight_scale_inv.shape == (-(-layer.out_features // 128), -(-layer.in_features // 128))
            back = dequantize_blocks(layer.weight, layer.weight_scale_inv, 128, 128)
        else:
            assert layer.weight_scale.shape == (layer.out_features,)
            back = layer.weight.float() * layer.weight_scale[:, None]
        assert ((back - ref.weight).abs() <= ref.weight.abs() * 2**-4 + 1e-6).all(), name
    assert torch.equal(fp8.model.layers[0].input_layernorm.weight, plain.model.layers[0].input_layernorm.weight)
    tokens = [list(range(5, 25))]
    a = PagedHarness(plain).step([("s", tokens[0])])[0]
    b = PagedHarness(fp8).step([("s", tokens[0])])[0]
    assert torch.isfinite(b).all() and float((a - b).norm() / a.norm()) < 0.15


def test_plan_counts_fp8_weight_bytes_and_scales():
    hf = load_hf_config("dummy:llama3-8b")
    plain = build_plan(hf, gpu_memory_gb=141)
    fp8 = build_plan(hf, gpu_memory_gb=141, quantization="fp8-block")
    # Llama-3-8B: 1,050,673,152 embedding + head parameters and the 266,240 of the norms (32 layers x 2 x 4096
    # and the final 4096) stay bf16; the other 6,979,321,856 take one byte, and a 4-byte scale per 128x128 block
    # of each layer's qkv [6144, 4096], o [4096, 4096], gate_up [28672, 4096] and down [4096, 14336]
    assert plain["weights_bytes"] == 8_030_261_248 * 2
    kept = (1_050_673_152 + 266_240) * 2
    assert fp8["weights_bytes"] == 6_979_321_856 + 32 * 4 * (48 * 32 + 32 * 32 + 224 * 32 + 32 * 112) + kept
    # per channel (``fp8``): a 4-byte scale per output row of each layer's qkv, o, gate_up and down
    channel = build_plan(hf, gpu_memory_gb=141, quantization="fp8")
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    rows = ((hf["num_attention_heads"] + 2 * hf["num_key_value_heads"]) * head_dim + hf["hidden_size"]
            + 2 * hf["intermediate_size"] + hf["hidden_size"])
    assert rows == 43_008
    assert channel["weights_bytes"] == 6_979_321_856 + 4 * rows * hf["num_hidden_layers"] + kept
    assert fp8["memory"]["kv_tokens"] > plain["memory"]["kv_tokens"]
    # an FP8 checkpoint's config is counted in FP8 without the flag
    shipped = build_plan({**hf, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                        "activation_scheme": "dynamic"}}, gpu_memory_gb=141)
    assert shipped["weights_bytes"] == fp8["weights_bytes"]
    with pytest.raises(ModelLoadError, match="quant_method='gptq'"):
        build_plan({**hf, "quantization_config": {"quant_method": "gptq"}}, gpu_memory_gb=141)


def test_quantization_flag_is_validated_and_parsed():
    with pytest.raises(ConfigError, match="--quantization='int4' is invalid"):
        EngineConfig(quantization="int4")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--quantization", "fp8"]), "dummy:llama3-8b").quantization == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "awq"])


def test_block_quantization_refuses_fused_parts_off_the_block(monkeypatch):
    dummy_preset(monkeypatch, "qwen3-0.6b", "tiny-odd", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32)  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"qkv_proj: a fused projection's parts \[64, 32, 32\] must be multiples"):
        load_model(EngineConfig(model="dummy:tiny-odd", quantization="fp8-block"), CPU)
    # per-channel scales (``fp8``'s dense projections, ``fp8-channel``) have no block to align with
    for quantization in ("fp8", "fp8-channel"):
        loaded = load_model(EngineConfig(model="dummy:tiny-odd", quantization=quantization), CPU)
        assert loaded.model.model.layers[0].mlp.gate_up_proj.weight_scale.shape == (192,)


def test_fp8_kv_cache_halves_the_bytes_and_keeps_the_logits(tiny_preset):
    """The CPU path writes K/V as e4m3 and reads them widened: prefill + decode logits stay within
    e4m3's rounding (2^-4 relative per cached element; attention averages it over the context)."""
    plain = load_model(EngineConfig(model=tiny_preset, seed=2), CPU)
    fp8 = load_model(EngineConfig(model=tiny_preset, seed=2, kv_cache_dtype="fp8_e4m3"), CPU)
    assert fp8.info.kv.dtype == FP8_DTYPE
    assert fp8.info.kv_bytes_per_token * 4 == plain.info.kv_bytes_per_token  # fp32 on CPU -> 1 byte
    ref, test = PagedHarness(plain.model), PagedHarness(plain.model)
    test.kv_caches = [torch.zeros_like(c, dtype=FP8_DTYPE) for c in test.kv_caches]
    prompts = {"a": list(range(30, 50)), "b": list(range(300, 307))}
    for seq, tokens in prompts.items():  # a prefill attends over its own fresh K/V, read back from the cache
        a, b = ref.step([(seq, tokens)])[0], test.step([(seq, tokens)])[0]
        assert float((a - b).norm() / a.norm()) < 0.05, seq
    for step in range(4):
        chunk = [(seq, [1000 + 7 * step + i]) for i, seq in enumerate(prompts)]
        a, b = torch.cat(ref.step(chunk)), torch.cat(test.step(chunk))
        assert float((a - b).norm() / a.norm()) < 0.05, step
    assert test.kv_caches[0].view(torch.uint8).any()  # the cache really holds the written fp8 bytes


def test_plan_counts_fp8_kv_bytes():
    hf = load_hf_config("dummy:llama3-8b")
    plain = build_plan(hf, gpu_memory_gb=141, quantization="fp8")
    fp8 = build_plan(hf, gpu_memory_gb=141, quantization="fp8", kv_cache_dtype_name="fp8_e4m3")
    assert fp8["kv_bytes_per_token"] * 2 == plain["kv_bytes_per_token"] == 131072
    # same budget left for the pool (the graph pool's KV-free estimate is unchanged): twice the tokens
    assert abs(fp8["memory"]["kv_tokens"] - 2 * plain["memory"]["kv_tokens"]) <= 32
    with pytest.raises(ConfigError, match="--kv-cache-dtype='fp8_e5m2' is invalid"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_engine_serves_with_an_fp8_kv_cache():
    from graphserve import LLM, SamplingParams

    llm = LLM("builtin:tiny-llama", kv_cache_dtype="fp8_e4m3", quantization="fp8-channel", num_kv_tokens=512)
    assert llm.engine.core.info.kv.dtype == llm.engine.core.runner.kv_caches[0].dtype == FP8_DTYPE
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 8


def test_static_quant_saturates_and_refuses_what_it_cannot_take():
    """Off the GPU ``static_quant`` is its reference: x / scale saturated at ±448, the scale as every row's; shapes
    and scales it cannot take are refused by name."""
    import pytest

    from graphserve.kernels.fp8_quant import FP8_DTYPE, static_quant

    x = torch.tensor([[1.0, -2.0, 1000.0], [0.25, -1000.0, 0.0]])
    q, s = static_quant(x, torch.tensor([0.5]))
    assert q.dtype == FP8_DTYPE and q.float().tolist() == [[2.0, -4.0, 448.0], [0.5, -448.0, 0.0]]
    assert s.shape == (2, 1) and s.flatten().tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match=r"static_quant takes a row-major \[M, K\] x and one fp32 scale"):
        static_quant(x, torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"one fp32 scale, got x \(3, 2\) strides \(1, 3\)"):
        static_quant(x.t(), torch.tensor([0.5]))
