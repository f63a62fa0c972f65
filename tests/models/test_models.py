"""Every Llama-family variant matches Hugging Face transformers logit for logit (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
from model_utils import check_paged_parity, make_hf_checkpoint
from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config

from graphserve.config import EngineConfig
from graphserve.errors import ConfigError, ModelLoadError
from graphserve.layers.rotary import rope_inv_freq
from graphserve.models.loader import load_model

TOL = 1e-4
_TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)

VARIANTS = {
    "llama3-rope-scaling": lambda: LlamaConfig(
        **_TINY, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}),
    "llama2-plain-rope": lambda: LlamaConfig(**{**_TINY, "num_key_value_heads": 4}, rope_theta=10000.0),
    "qwen2-bias-tied": lambda: Qwen2Config(**_TINY, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3-qknorm-headdim": lambda: Qwen3Config(**_TINY, head_dim=32, rope_theta=1000000.0),
    "mistral": lambda: MistralConfig(**{**_TINY, "max_position_embeddings": 256}, sliding_window=128),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(folder, VARIANTS[request.param]())
    loaded = load_model(EngineConfig(model=str(folder), dtype="float32", max_model_len=128), torch.device("cpu"))
    return request.param, hf, loaded


def test_prefill_chunked_and_decode_match_transformers(variant):
    name, hf, loaded = variant
    check_paged_parity(loaded.model, hf, name, TOL, decode_steps=5)


def test_loaded_shapes_follow_config(variant):
    name, hf, loaded = variant
    cfg, info = hf.config, loaded.info
    assert info.num_layers == cfg.num_hidden_layers and info.vocab_size == cfg.vocab_size
    assert info.head_dim == (32 if name.startswith("qwen3") else cfg.hidden_size // cfg.num_attention_heads)
    assert info.num_params == sum(p.numel() for p in hf.parameters())
    assert info.tie_word_embeddings == (name == "qwen2-bias-tied")
    assert info.kv_bytes_per_token == 2 * info.num_layers * info.num_kv_heads * info.head_dim * 4
    # config/generation_config eos first, then the tokenizer's "</s>" (id 1) when it differs
    expected_eos = [cfg.eos_token_id] if cfg.eos_token_id is not None else []
    assert info.eos_token_ids == expected_eos + ([1] if 1 not in expected_eos else [])


def test_sliding_window_of_a_family_without_windows_is_refused(tmp_path):
    """Mistral and Qwen2/Qwen3 attend through their windows (tests/models/test_models_window.py); a family that does not
    (Mixtral's experts) is refused when its window binds."""
    make_hf_checkpoint(tmp_path, MixtralConfig(**{**_TINY, "max_position_embeddings": 256}, sliding_window=128,
                                               num_local_experts=4, num_experts_per_tok=2))  # fmt: skip
    with pytest.raises(ConfigError, match="sliding_window=128, which graphserve does not implement for Mixtral"):
        load_model(EngineConfig(model=str(tmp_path), max_model_len=200), torch.device("cpu"))
    # without --max-model-len the model's 256 positions exceed the window too
    with pytest.raises(ConfigError, match="--max-model-len"):
        load_model(EngineConfig(model=str(tmp_path)), torch.device("cpu"))


def test_unsupported_rope_type_is_refused():
    with pytest.raises(ModelLoadError, match="dynamic"):
        rope_inv_freq(16, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ModelLoadError, match="yarn' needs rope_scaling.original_max_position_embeddings"):
        rope_inv_freq(16, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
