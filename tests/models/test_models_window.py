"""Sliding-window checkpoints (Mistral v0.1 style, Qwen2 with ``use_sliding_window``) against transformers, in
float32 on CPU, with contexts three to five windows long: paged logits and greedy generation under continuous
batching."""

from __future__ import annotations

import pytest
import torch
from model_utils import check_paged_parity, engine_greedy, hf_greedy, make_hf_checkpoint, random_prompts
from transformers import MistralConfig, Qwen2Config

from graphserve import LLM
from graphserve.config import EngineConfig
from graphserve.errors import ModelLoadError
from graphserve.models.loader import load_model

WINDOW = 8
_TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
CONFIGS = {
    # every layer windowed
    "mistral": lambda: MistralConfig(**_TINY, sliding_window=WINDOW, rope_theta=10000.0),
    # layers from max_window_layers on windowed: layer 0 full, layers 1 and 2 windowed
    "qwen2": lambda: Qwen2Config(**_TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                 rope_theta=1000000.0),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, make_hf_checkpoint(folder, CONFIGS[request.param]())


def test_layers_take_their_windows_as_transformers_builds_them(checkpoint):
    name, folder, hf = checkpoint
    loaded = load_model(EngineConfig(model=str(folder), dtype="float32"), torch.device("cpu"))
    got = [layer.self_attn.attn.window for layer in loaded.model.model.layers]
    # transformers' Mistral windows every layer with the config's window; Qwen2 sets each layer's own
    want = [hf.config.sliding_window if name == "mistral" else layer.self_attn.sliding_window
            for layer in hf.model.layers]  # fmt: skip
    assert got == want == ([WINDOW] * 3 if name == "mistral" else [None, WINDOW, WINDOW])
    # a window no sequence can outgrow never binds: those layers attend in full
    short = load_model(EngineConfig(model=str(folder), dtype="float32", max_model_len=WINDOW), torch.device("cpu"))
    assert [layer.self_attn.attn.window for layer in short.model.model.layers] == [None] * 3


def test_prefill_chunked_prefill_and_decode_match_transformers_past_the_window(checkpoint):
    name, folder, hf = checkpoint
    loaded = load_model(EngineConfig(model=str(folder), dtype="float32"), torch.device("cpu"))
    check_paged_parity(loaded.model, hf, name, 1e-4, decode_steps=4, lengths=(21, 37, 26), prefix=13)


def test_greedy_generation_matches_transformers_under_continuous_batching(checkpoint):
    name, folder, hf = checkpoint
    prompts = random_prompts((20, 29, 40))
    new_tokens = 12
    expected = [hf_greedy(hf, ids, new_tokens) for ids in prompts]
    # 16-token chunks: the 29 and 40-token prompts prefill across steps beside other requests' decodes
    llm = LLM(str(folder), block_size=4, chunked_prefill_size=16, dtype="float32")
    assert engine_greedy(llm, prompts, new_tokens) == expected
    llm.engine.core.block_manager.check_no_leak()


def test_bad_window_declarations_are_refused(tmp_path):
    cfg = CONFIGS["qwen2"]()
    cfg.layer_types = ["full_attention", "sliding_attention", "chunked_attention"]
    make_hf_checkpoint(tmp_path, cfg)
    with pytest.raises(ModelLoadError, match=r"layer_types holds \['chunked_attention'\]"):
        load_model(EngineConfig(model=str(tmp_path), dtype="float32"), torch.device("cpu"))
