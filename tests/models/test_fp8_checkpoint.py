"""FP8 checkpoints (block-wise and per-channel, written by our own quantizer in the HF layout) load,
and run the same logits as the same model dequantized; malformed ones are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from model_utils import PagedHarness, dequantized_checkpoint, held_weight_bytes, make_hf_checkpoint, relative_error
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from graphserve.config import EngineConfig
from graphserve.errors import ModelLoadError
from graphserve.kernels.fp8_quant import FP8_DTYPE
from graphserve.models.fp8_checkpoint import quantize_checkpoint
from graphserve.models.loader import load_model

CPU = torch.device("cpu")
TOKENS = list(range(7, 37))


def _config() -> Qwen3Config:
    # q 4x16 = 64, k/v 2x16 = 32, MLP 96: every fused part is a multiple of the 32-row test block
    return Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                       tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16")
    make_hf_checkpoint(folder, _config(), seed=3)
    return folder


def _logits(folder, **kw) -> torch.Tensor:
    return PagedHarness(load_model(EngineConfig(model=str(folder), **kw), CPU).model).step([("s", TOKENS)])[0]


# each merged projection of a layer: its checkpoint modules, in shard order
_INPUT_SHARDS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                 "mlp.down_proj": ("mlp.down_proj",)}


@pytest.mark.parametrize("block,amax", [((32, 32), None), (None, None), (None, 4.0)],
                         ids=["block", "channel-dynamic", "channel-static"])
def test_fp8_checkpoint_matches_the_same_model_dequantized(source, tmp_path, block, amax):
    names = [n for n in load_file(str(source / "model.safetensors")) if n.endswith("_proj.weight")]
    # static: a different activation amax per projection, so that each merged shard's input_scale is told apart
    input_amax = {n.removesuffix(".weight"): amax * (1 + i / 16) for i, n in enumerate(names)} if amax else None
    quantize_checkpoint(source, tmp_path / "fp8", block=block, input_amax=input_amax)
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == FP8_DTYPE
    assert stored["model.embed_tokens.weight"].dtype == torch.float32
    dequantized_checkpoint(tmp_path / "fp8", tmp_path / "deq")
    loaded = load_model(EngineConfig(model=str(tmp_path / "fp8")), CPU)
    model = loaded.model
    # the description counts what the model holds to the byte: fp8 weights, their scales, the static input scales
    assert loaded.info.description.weights_bytes == held_weight_bytes(model)
    if amax:  # the CPU path leaves activations unquantized: the scales are checked as loaded, shard by shard
        for i, layer in enumerate(model.model.layers):
            for fused, parts in _INPUT_SHARDS.items():
                want = torch.stack([stored[f"model.layers.{i}.{part}.input_scale"] for part in parts])
                assert want.unique().numel() == len(parts)
                assert torch.equal(layer.get_submodule(fused).input_scale, want), (i, fused)
    else:
        assert not any(name.endswith("input_scale") for name, _ in model.named_parameters())
    fp8 = PagedHarness(model).step([("s", TOKENS)])[0]
    deq = _logits(tmp_path / "deq")
    # The CPU path multiplies by the dequantized fp32 weight, exactly the weights of the dequantized
    # checkpoint, in the same order of operations: only fp32 rounding of the dequantization itself
    # (q * scale, computed once per side) can differ, ~1e-7 relative per weight.
    torch.testing.assert_close(fp8, deq, rtol=1e-5, atol=1e-5)
    # and against the unquantized model: e4m3 rounds each weight with a relative error uniform in
    # +-2^-4 (RMS 2^-4/sqrt(3) = 3.6%), which a projection passes to its output; the 7 projections a
    # token crosses per layer over 2 layers add about in quadrature to ~10% (measured: 9.8%, block)
    assert relative_error(fp8, _logits(source)) < 0.15


def _fp8_folder(source, tmp_path, **kw):
    folder = tmp_path / "fp8"
    quantize_checkpoint(source, folder, block=(32, 32), **kw)
    return folder


def _rewrite(folder, change) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_missing_scale_tensor_is_named(source, tmp_path):
    folder = _fp8_folder(source, tmp_path)
    _rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.o_proj.weight_scale_inv"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight_scale_inv"):
        _logits(folder)


def test_malformed_scale_tensor_is_named(source, tmp_path):
    folder = _fp8_folder(source, tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight_scale_inv"
    _rewrite(folder, lambda t: t.__setitem__(name, torch.ones(2, 2)))  # [96/32, 64/32] = [3, 2]
    with pytest.raises(ModelLoadError, match=rf"{name}.*shape \(2, 2\), expected \(3, 2\)"):
        _logits(folder)


def test_unquantized_weight_under_an_fp8_config_is_named(source, tmp_path):
    folder = _fp8_folder(source, tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(folder, lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(ModelLoadError, match=rf"{name}.*dtype torch.float32, expected torch.float8_e4m3fn"):
        _logits(folder)


@pytest.mark.parametrize("change,field", [
    ({"quant_method": "awq"}, "quant_method='awq'"),
    ({"fmt": "e5m2"}, "fmt='e5m2'"),
    ({"activation_scheme": "static"}, "activation_scheme='static' with weight_block_size"),
    ({"weight_block_size": [128]}, "weight_block_size=\\[128\\]"),
    ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme="),
])
def test_unsupported_quantization_config_is_refused_by_name(source, tmp_path, change, field):
    folder = _fp8_folder(source, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"quantization_config.{field}"):
        _logits(folder)


def test_quantization_flag_on_an_unquantized_checkpoint(source, tmp_path):
    """--quantization fp8-channel quantizes at load: the same logits as the per-channel checkpoint."""
    quantize_checkpoint(source, tmp_path / "fp8", block=None)
    loaded = load_model(EngineConfig(model=str(source), quantization="fp8-channel"), CPU)
    assert loaded.model.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
    assert loaded.model.lm_head.weight.dtype == torch.float32
    online = PagedHarness(loaded.model).step([("s", TOKENS)])[0]
    torch.testing.assert_close(online, _logits(tmp_path / "fp8"), rtol=1e-5, atol=1e-5)
    desc, plain = loaded.info.description, load_model(EngineConfig(model=str(source)), CPU).info.description
    assert desc.dense_params == plain.dense_params
    # projections at one byte plus one fp32 scale per output row (qkv 128, o 64, gate_up 192, down 64, in each of
    # 2 layers); embedding, head and the norms (2 layers x (2 x 64 and the q and k norms of 16) and the final 64)
    # stay fp32
    assert desc.dense_scale_bytes == 2 * 4 * (128 + 64 + 192 + 64)
    assert desc.model_dtype_params == 2 * (2 * 64 + 2 * 16) + 64
    kept_loaded = sum(p.numel() for name, p in loaded.model.named_parameters()
                      if p.dtype != FP8_DTYPE and not name.endswith("_scale") and "embed_tokens" not in name
                      and "lm_head" not in name)
    assert desc.model_dtype_params == kept_loaded, "the plan keeps in fp32 what the loaded model holds in fp32"
    kept = desc.embed_params + desc.lm_head_params + desc.model_dtype_params
    assert desc.weights_bytes == desc.dense_params - desc.model_dtype_params + desc.dense_scale_bytes + kept * 4
    assert desc.weights_bytes == held_weight_bytes(loaded.model)
    assert desc.weights_bytes < plain.weights_bytes / 1.8
