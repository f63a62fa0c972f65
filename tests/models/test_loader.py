"""Model sources: HF folders (single and sharded), errors, builtin:tiny-llama, dummy presets."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import PagedHarness, dummy_preset, hf_logits, make_hf_checkpoint, relative_error
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from graphserve.config import EngineConfig
from graphserve.errors import ModelLoadError
from graphserve.models.builtin import ensure_builtin
from graphserve.models.loader import load_model, resolve_dtype
from graphserve.models.presets import get_preset_config
from graphserve.models.registry import supported_architectures

CPU = torch.device("cpu")


def _tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    make_hf_checkpoint(folder, _tiny_llama_config(), seed=5)
    return folder


def _load(folder) -> object:
    return load_model(EngineConfig(model=str(folder)), CPU)


def _prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    return PagedHarness(model).step([("s", tokens)])[0]


def test_sharded_checkpoint_gives_identical_logits(checkpoint, tmp_path):
    make_hf_checkpoint(tmp_path, _tiny_llama_config(), seed=5, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    tokens = list(range(10, 40))
    assert torch.equal(_prefill_logits(_load(tmp_path).model, tokens), _prefill_logits(_load(checkpoint).model, tokens))


def _copy_without(src, dst, skip: str) -> None:
    for f in src.iterdir():
        if f.name != skip:
            (dst / f.name).write_bytes(f.read_bytes())


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named_with_its_folder(checkpoint, tmp_path, missing):
    _copy_without(checkpoint, tmp_path, missing)
    if missing == "tokenizer.json":
        (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(ModelLoadError) as e:
        _load(tmp_path)
    assert missing in e.value.message and str(tmp_path) in e.value.message


def test_missing_shard_listed_in_index_is_named(tmp_path):
    make_hf_checkpoint(tmp_path, _tiny_llama_config(), max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        _load(tmp_path)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    _copy_without(checkpoint, tmp_path, "model.safetensors")
    weights = load_file(checkpoint / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight#1"):
        _load(tmp_path)


def test_path_that_is_not_a_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="is not a folder"):
        _load(tmp_path / "nowhere")
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is not a folder"):
        _load(tmp_path / "file.bin")


def test_unknown_architecture_lists_the_supported(checkpoint, tmp_path):
    _copy_without(checkpoint, tmp_path, "config.json")
    raw = json.loads((checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError) as e:
        _load(tmp_path)
    assert "GPT2LMHeadModel" in e.value.message
    assert all(arch in e.value.message for arch in supported_architectures())
    assert set(supported_architectures()) == {
        "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
        "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM",
        "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
        "GptOssForCausalLM", "DeepseekV4ForCausalLM"}


def test_unknown_builtin_and_dummy_names_list_the_choices():
    with pytest.raises(ModelLoadError, match="builtin:tiny-llama"):
        load_model(EngineConfig(model="builtin:huge"), CPU)
    with pytest.raises(ModelLoadError, match="dummy:qwen3-0.6b"):
        load_model(EngineConfig(model="dummy:gpt5"), CPU)


def test_builtin_tiny_llama_is_made_once_and_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    folder = ensure_builtin("tiny-llama")
    stamps = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(stamps)
    loaded = load_model(EngineConfig(model="builtin:tiny-llama"), CPU)
    assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == stamps
    assert [p.name for p in folder.parent.iterdir()] == ["tiny-llama"]  # no temporary folder left

    tok = loaded.tokenizer
    assert 1000 <= len(tok) == loaded.info.vocab_size
    text = "Hello, wörld! Ünïcode 日本語 — naïve café 🙂"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token_id in loaded.info.eos_token_ids
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True, chat_template=loaded.chat_template)
    assert chat == "<s><|user|>\nWhat is the capital of France?</s>\n<|assistant|>\n"

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = tok.encode("The engineer opened her laptop and looked at the graph.")
    ours = _prefill_logits(loaded.model, tokens)
    assert relative_error(ours, hf_logits(hf, tokens)) < 1e-4
    assert ours[-1].std() > 0.1  # logits differ across the vocabulary


def test_builtin_generation_is_deterministic(tmp_path, monkeypatch, graphserve_cache):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    fresh = ensure_builtin("tiny-llama")
    monkeypatch.setenv("GRAPHSERVE_CACHE", graphserve_cache)
    shared = ensure_builtin("tiny-llama")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (fresh / name).read_bytes() == (shared / name).read_bytes(), name


def test_dummy_qwen3_shapes_on_meta_device():
    loaded = load_model(EngineConfig(model="dummy:qwen3-0.6b"), torch.device("meta"))
    info, raw = loaded.info, get_preset_config("qwen3-0.6b")
    assert (info.architecture, info.num_layers, info.num_heads, info.num_kv_heads) == ("Qwen3ForCausalLM", 28, 16, 8)
    assert (info.head_dim, info.hidden_size, info.vocab_size) == (128, 1024, raw["vocab_size"])
    assert info.tie_word_embeddings and 590e6 < info.num_params < 600e6
    assert info.kv_bytes_per_token == 2 * 28 * 8 * 128 * 4
    assert len(loaded.tokenizer) == info.vocab_size
    assert loaded.tokenizer.convert_ids_to_tokens(151645) == "<|im_end|>" and info.eos_token_ids == [151645]
    assert loaded.model.model.layers[0].self_attn.q_norm is not None
    assert "<|im_start|>assistant" in loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_dummy_weights_are_random_finite_and_seeded(monkeypatch):
    dummy_preset(monkeypatch, "qwen2.5-0.5b", "tiny-test", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    a = load_model(EngineConfig(model="dummy:tiny-test", seed=1), CPU)
    b = load_model(EngineConfig(model="dummy:tiny-test", seed=1), CPU)
    wa = a.model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(wa, b.model.model.layers[1].mlp.down_proj.weight)
    assert 0.015 < float(wa.std()) < 0.025
    logits = _prefill_logits(a.model, list(range(100, 120)))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_auto_dtype():
    def cfg(dtype: str) -> PretrainedConfig:
        return PretrainedConfig(dtype=dtype)

    assert resolve_dtype("auto", cfg("bfloat16"), CPU) == torch.float32
    assert resolve_dtype("auto", cfg("float16"), torch.device("cuda")) == torch.float16
    assert resolve_dtype("auto", cfg("float32"), torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", cfg("bfloat16"), CPU) == torch.float16
    assert os.environ["GRAPHSERVE_CACHE"]  # the session fixture keeps builtins out of the home folder
