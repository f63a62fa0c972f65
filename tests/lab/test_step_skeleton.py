"""benchmarks.step_skeleton's list of what a decode step reads: each layer's projection weights in the order the
step reads them (not their scales), then the lm_head; a model with routed experts refused by name."""

from __future__ import annotations

import pytest
import torch
from model_utils import dummy_preset

from benchmarks.step_skeleton import step_weights
from graphserve.config import EngineConfig
from graphserve.models.loader import load_model

CPU = torch.device("cpu")
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 128, "max_position_embeddings": 256}


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_every_projection_weight_in_step_order_then_the_lm_head(monkeypatch, quantization):
    name = dummy_preset(monkeypatch, "llama3-8b", "tiny-skeleton", **TINY)
    model = load_model(EngineConfig(model=name, quantization=quantization), CPU).model
    groups = step_weights(model)
    assert len(groups) == len(model.model.layers) + 1
    for layer, group in zip(model.model.layers, groups, strict=False):
        want = [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight,
                layer.mlp.down_proj.weight]
        assert [id(w) for w in group] == [id(w) for w in want]
        if quantization == "fp8":
            assert {w.dtype for w in group} == {torch.float8_e4m3fn}  # the scales are not among them
    assert [id(w) for w in groups[-1]] == [id(model.lm_head.weight)]


def test_a_model_with_routed_experts_is_refused_naming_the_layer(monkeypatch):
    name = dummy_preset(monkeypatch, "qwen3-30b-a3b", "tiny-skeleton-moe", **TINY, moe_intermediate_size=64,
                        num_experts=4, num_experts_per_tok=2)  # fmt: skip
    model = load_model(EngineConfig(model=name), CPU).model
    with pytest.raises(ValueError, match="layer 0 has routed experts"):
        step_weights(model)
