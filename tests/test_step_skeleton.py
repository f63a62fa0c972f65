"""benchmarks.step_skeleton's list of what a decode step reads: each layer's projection weights in the order the
step reads them (not their scales), then the lm_head; a model with routed experts refused by name."""

from __future__ import annotations

import pytest
import torch

from benchmarks.step_skeleton import as_wide, step_weights
from graphserve.config import EngineConfig
from graphserve.models.loader import load_model
from graphserve.models.presets import PRESETS

CPU = torch.device("cpu")


def tiny(monkeypatch, preset: str, **fields) -> str:
    spec = {**PRESETS[preset]}
    spec["config"] = {**spec["config"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
                      "max_position_embeddings": 256, **fields}
    monkeypatch.setitem(PRESETS, f"tiny-{preset}", spec)
    return f"dummy:tiny-{preset}"


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_every_projection_weight_in_step_order_then_the_lm_head(monkeypatch, quantization):
    model = load_model(EngineConfig(model=tiny(monkeypatch, "llama3-8b"), quantization=quantization), CPU).model
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
    name = tiny(monkeypatch, "qwen3-30b-a3b", moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2)
    model = load_model(EngineConfig(model=name), CPU).model
    with pytest.raises(ValueError, match="layer 0 has routed experts"):
        step_weights(model)


def test_one_byte_weights_are_read_as_16_bit_elements_of_the_same_bytes():
    w = torch.randn(8, 6).to(torch.float8_e4m3fn)
    wide = as_wide(w)
    assert wide.dtype == torch.bfloat16 and wide.numel() * 2 == w.numel()
    assert wide.data_ptr() == w.data_ptr()  # a view: the same bytes, no copy
    h = torch.randn(8, 6, dtype=torch.bfloat16)
    assert as_wide(h) is h
