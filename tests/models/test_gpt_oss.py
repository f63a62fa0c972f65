"""gpt-oss against transformers' ``models/gpt_oss`` in float32 on CPU: a tiny checkpoint with windows of 8 on
alternate layers, attention sinks, YaRN rope, a biased router and biased clamped-SwiGLU experts; paged logits on
prefill, chunked prefill and decode with contexts several windows long, greedy tokens under continuous batching;
the stacked, interleaved expert tensors loaded into FusedMoE's layout; the presets' published parameter counts;
bad checkpoints refused by name."""

from __future__ import annotations

import pytest
import torch
from model_utils import (
    check_paged_parity,
    engine_greedy,
    held_weight_bytes,
    hf_greedy,
    make_hf_checkpoint,
    random_prompts,
)
from transformers import GptOssConfig

from graphserve import LLM
from graphserve.config import EngineConfig
from graphserve.errors import ModelLoadError
from graphserve.models.gpt_oss import GptOssForCausalLM
from graphserve.models.loader import load_model
from graphserve.models.registry import describe_model

WINDOW = 8
TOL = 1e-4


def _config(**over) -> GptOssConfig:
    fields = dict(
        vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 32, "rope_theta": 150000.0},
        architectures=["GptOssForCausalLM"],
    )  # fmt: skip
    return GptOssConfig(**{**fields, **over})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt-oss")
    hf = make_hf_checkpoint(folder, _config())
    # weights of 0.1 keep the experts' gate/up near 0; scale them so the clamp at swiglu_limit (7) binds
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(12.0)
    hf.save_pretrained(folder)
    loaded = load_model(EngineConfig(model=str(folder), dtype="float32"), torch.device("cpu"))
    return folder, hf, loaded


def test_layers_windows_sinks_and_experts_are_transformers(checkpoint):
    _, hf, loaded = checkpoint
    model = loaded.model
    assert isinstance(model, GptOssForCausalLM)
    layers = model.model.layers
    assert [layer.self_attn.attn.window for layer in layers] == [WINDOW, None, WINDOW]
    assert [layer.self_attn.attn.window for layer in layers] == [h.self_attn.sliding_window for h in hf.model.layers]
    for ours, theirs in zip(layers, hf.model.layers):
        torch.testing.assert_close(ours.self_attn.attn.sinks, theirs.self_attn.sinks, rtol=0, atol=0)
        experts, hf_experts = ours.mlp.experts, theirs.mlp.experts
        # [E, H, 2I] interleaved (x @ it) -> [E, 2I, H], gate rows then up rows
        gate_up = hf_experts.gate_up_proj.transpose(1, 2)
        torch.testing.assert_close(experts.w13_weight, torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1),
                                   rtol=0, atol=0)  # fmt: skip
        bias = hf_experts.gate_up_proj_bias
        torch.testing.assert_close(experts.w13_bias, torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1), rtol=0, atol=0)
        torch.testing.assert_close(experts.w2_weight, hf_experts.down_proj.transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(experts.w2_bias, hf_experts.down_proj_bias, rtol=0, atol=0)
    # the clamp binds: on unit-RMS rows (what the post-attention norm hands the experts) gate/up pass the limit
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    gate_up = torch.einsum("th,eho->teo", x, hf.model.layers[0].mlp.experts.gate_up_proj)
    assert gate_up.abs().max() > 7.0


def test_prefill_chunked_prefill_and_decode_match_transformers_past_the_window(checkpoint):
    _, hf, loaded = checkpoint
    check_paged_parity(loaded.model, hf, "gpt-oss", TOL, decode_steps=4, lengths=(21, 37, 26), prefix=13)


def test_greedy_generation_matches_transformers_under_continuous_batching(checkpoint):
    folder, hf, _ = checkpoint
    prompts = random_prompts((20, 29, 40))
    new_tokens = 10
    expected = [hf_greedy(hf, ids, new_tokens) for ids in prompts]
    # 16-token chunks: the 29 and 40-token prompts prefill across steps beside other requests' decodes
    llm = LLM(str(folder), block_size=4, chunked_prefill_size=16, dtype="float32")
    assert engine_greedy(llm, prompts, new_tokens) == expected
    llm.engine.core.block_manager.check_no_leak()


def test_description_counts_the_checkpoint(checkpoint):
    _, hf, loaded = checkpoint
    d = loaded.info.description
    assert d.num_params == sum(p.numel() for p in hf.parameters()) == loaded.info.num_params
    assert d.num_moe_layers == 3 and d.num_experts == 6 and d.top_k == 2


# openai/gpt-oss-20b and -120b's model card: parameters (billions) and checkpoint size (GiB), experts in MXFP4
@pytest.mark.parametrize("preset, layers, experts, params_b, gib", [("gpt-oss-20b", 24, 32, 20.91, 12.8),
                                                                    ("gpt-oss-120b", 36, 128, 116.83, 60.8)])
def test_presets_have_the_published_shapes_and_parameter_counts(preset, layers, experts, params_b, gib):
    from graphserve.models.presets import get_preset_config

    raw = get_preset_config(preset)
    d = describe_model(raw, torch.bfloat16)
    assert abs(d.num_params / 1e9 - params_b) < 0.005, d.num_params
    assert (d.num_moe_layers, d.num_experts, d.top_k, d.hidden_size, d.vocab_size) == (layers, experts, 4, 2880,
                                                                                         201088)  # fmt: skip
    loaded = load_model(EngineConfig(model=f"dummy:{preset}", dtype="bfloat16"), torch.device("meta"))
    attn = [layer.self_attn.attn for layer in loaded.model.model.layers]
    assert [a.window for a in attn] == [128 if i % 2 == 0 else None for i in range(layers)]
    assert all(a.sinks is not None and a.sinks.shape == (64,) for a in attn)
    rotary = loaded.model.model.rotary_emb
    assert abs(rotary.attention_factor - (0.1 * torch.log(torch.tensor(32.0)).item() + 1)) < 1e-6
    # the experts are MXFP4 as the checkpoints ship them, the rest bf16: the published size
    from graphserve.layers.quant.fp4_moe import Fp4MoEMethod

    assert all(isinstance(m.quant_method, Fp4MoEMethod) and m.quant_method.fmt == "mxfp4"
               for m in loaded.model.moe_layers())  # fmt: skip
    assert all(m.w13_bias.dtype == torch.bfloat16 for m in loaded.model.moe_layers())
    assert loaded.info.description.num_params == d.num_params
    # the model assembled on the meta device holds exactly the bytes the description prices
    assert held_weight_bytes(loaded.model) == loaded.info.description.weights_bytes
    if preset == "gpt-oss-20b":  # and its bf16-experts twin: the same parameters, in bf16 but the float32 sinks
        bf16 = load_model(EngineConfig(model="dummy:gpt-oss-20b-bf16", dtype="bfloat16"), torch.device("meta"))
        assert all(m.quant_method is None for m in bf16.model.moe_layers())
        assert sum(p.numel() for p in bf16.model.parameters()) == d.num_params
        sinks = layers * 64
        assert bf16.info.description.weights_bytes == held_weight_bytes(bf16.model) == 2 * d.num_params + 2 * sinks
    assert abs(loaded.info.description.weights_bytes / 2**30 - gib) < 0.1, loaded.info.description.weights_bytes


def _refusal(tmp_path, **over):
    make_hf_checkpoint(tmp_path, _config(**over))
    return load_model(EngineConfig(model=str(tmp_path), dtype="float32"), torch.device("cpu"))


def test_bad_configs_are_refused_by_name(tmp_path):
    with pytest.raises(ModelLoadError, match=r"layer_types holds \['chunked_attention'\]"):
        _refusal(tmp_path / "a", layer_types=["sliding_attention", "full_attention", "chunked_attention"])
    cfg = _config().to_dict() | {"swiglu_limit": -1.0}
    with pytest.raises(ModelLoadError, match="swiglu_limit=-1.0 must be positive"):
        GptOssForCausalLM(describe_model.__globals__["hf_config_object"](cfg), 64)


def test_stacked_expert_tensor_of_the_wrong_shape_is_refused(checkpoint):
    _, _, loaded = checkpoint
    bad = torch.zeros(5, 64, 64)
    with pytest.raises(ModelLoadError, match=r"gate_up_proj' has shape \(5, 64, 64\), the config's \(6, 64, 64\)"):
        loaded.model.load_weights([("model.layers.0.mlp.experts.gate_up_proj", bad)])


def test_mxfp4_checkpoint_matches_the_model_holding_its_dequantized_weights(tmp_path):
    """OpenAI's layout: experts as MXFP4 ``*_blocks`` / ``*_scales`` stacks (rows interleaved), biases and every
    other tensor in the model dtype. Loaded through the FP4 experts' method, the model matches transformers holding
    the dequantized weights."""
    import json

    from safetensors.torch import load_file, save_file

    from graphserve.kernels.fp4_reference import mxfp4_dequantize, mxfp4_quantize
    from graphserve.layers.quant.fp4_moe import Fp4MoEMethod

    hf = make_hf_checkpoint(tmp_path, _config(num_hidden_layers=2))
    stacks = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            experts = layer.mlp.experts
            experts.gate_up_proj.mul_(12.0)  # so the clamp binds
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(experts, name).transpose(1, 2)  # [E, N, K] as the blocks store it (x @ stored)
                packed, scales = mxfp4_quantize(w)
                getattr(experts, name).copy_(mxfp4_dequantize(packed, scales).transpose(1, 2))
                key = f"model.layers.{i}.mlp.experts.{name}"
                stacks[f"{key}_blocks"] = packed.reshape(*packed.shape[:2], -1, 16).contiguous()
                stacks[f"{key}_scales"] = scales
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        del tensors[name]
    save_file({**tensors, **stacks}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="float32"), torch.device("cpu"))
    experts = loaded.model.moe_layers()
    assert all(isinstance(m.quant_method, Fp4MoEMethod) and m.w13_weight.dtype == torch.uint8 for m in experts)
    assert all(m.w13_bias.dtype == torch.float32 for m in experts)
    check_paged_parity(loaded.model, hf, "gpt-oss mxfp4", TOL, decode_steps=2, lengths=(21, 30, 12), prefix=13)


def test_fp8_quantization_keeps_the_router_and_the_expert_biases_in_the_model_dtype(tmp_path):
    """``--quantization fp8``: the projections and expert matrices go fp8, the router (it picks the experts) and the
    biases stay; the logits stay near the unquantized model's (weights of the usual scale: the module's checkpoint
    scales gate/up up to bind the clamp, which fp8's rounding then amplifies)."""
    from model_utils import PagedHarness, relative_error

    make_hf_checkpoint(tmp_path, _config())
    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="float32"), torch.device("cpu"))
    fp8 = load_model(EngineConfig(model=str(tmp_path), dtype="float32", quantization="fp8"), torch.device("cpu"))
    for layer in fp8.model.model.layers:
        assert layer.mlp.router.quant_method is None and layer.mlp.router.weight.dtype == torch.float32
        assert layer.mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
        assert layer.mlp.experts.w13_bias.dtype == layer.mlp.experts.w2_bias.dtype == torch.float32
    ids = torch.randint(4, 320, (26,), generator=torch.Generator().manual_seed(7)).tolist()
    want = PagedHarness(loaded.model).step([("a", ids)])[0]
    err = relative_error(PagedHarness(fp8.model).step([("a", ids)])[0], want)
    # fp8's rounding (up to 1/16 of each weight) flips a few top-k choices in a random model: near, not equal
    assert 0 < err < 0.25, err
