"""DeepSeek-V4's MTP layer: loaded from DeepSeek's names or transformers', kept with the checkpoint's values, described
apart from what a step reads, and refused by tensor name when malformed."""

from __future__ import annotations

import logging

import pytest
import torch
from model_utils import held_weight_bytes
from safetensors.torch import save_file
from test_deepseek_v4 import _checkpoint, _config

from graphserve.config import EngineConfig
from graphserve.errors import ModelLoadError
from graphserve.models.deepseek_v4_mtp import mtp_module_name
from graphserve.models.loader import load_model

# transformers' module names in a decoder layer -> DeepSeek's checkpoint names (the inverse of deepseek_v4_names.py)
_DEEPSEEK = (("self_attn.q_a_proj.", "attn.wq_a."), ("self_attn.q_a_norm.", "attn.q_norm."),
             ("self_attn.q_b_proj.", "attn.wq_b."), ("self_attn.kv_proj.", "attn.wkv."),
             ("self_attn.kv_norm.", "attn.kv_norm."), ("self_attn.o_a_proj.", "attn.wo_a."),
             ("self_attn.o_b_proj.", "attn.wo_b."), ("self_attn.sinks", "attn.attn_sink"),
             ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"), ("mlp.gate.", "ffn.gate."),
             ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
             ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
             ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."), ("input_layernorm.", "attn_norm."),
             ("post_attention_layernorm.", "ffn_norm."), ("attn_hc.", "hc_attn_"), ("ffn_hc.", "hc_ffn_"))  # fmt: skip


def _mtp_tensors(hf, deepseek: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:  # noqa: ANN001
    """Random MTP tensors shaped as the checkpoint's layer 2 (sliding window, score-routed MoE) plus the MTP's own,
    in DeepSeek's names or transformers' (with ``model.``); and the values each model parameter must then hold."""
    gen = torch.Generator().manual_seed(3)
    cfg, h = hf.config, hf.config.hidden_size
    layer = {n.removeprefix("model.layers.2."): t for n, t in hf.state_dict().items() if n.startswith("model.layers.2.")}
    layer.update({"e_proj.weight": torch.empty(h, h), "h_proj.weight": torch.empty(h, h), "enorm.weight": torch.empty(h),
                  "hnorm.weight": torch.empty(h), "norm.weight": torch.empty(h),
                  "hc_head.hc_fn": torch.empty(cfg.hc_mult, cfg.hc_mult * h), "hc_head.hc_base": torch.empty(cfg.hc_mult),
                  "hc_head.hc_scale": torch.empty(1)})  # fmt: skip
    ckpt, want = {}, {}
    for name, t in layer.items():
        value = torch.randn(t.shape, generator=gen) if t.is_floating_point() else t
        if name.endswith("e_score_correction_bias"):
            ckpt[("mtp.0." + _deepseek(name)) if deepseek else f"model.mtp.0.{name}"] = value
            continue  # a buffer: checked apart
        if name.startswith("mlp.experts."):
            inter = cfg.moe_intermediate_size
            if deepseek:
                for e in range(cfg.n_routed_experts):
                    parts = [("w1", value[e, :inter]), ("w3", value[e, inter:])] if "gate_up" in name else \
                        [("w2", value[e])]  # fmt: skip
                    ckpt.update({f"mtp.0.ffn.experts.{e}.{p}.weight": v.contiguous() for p, v in parts})
            else:
                ckpt[f"model.mtp.0.{name}"] = value
            want["mtp.0.mlp.experts." + ("w13_weight" if "gate_up" in name else "w2_weight")] = value
            continue
        if deepseek:
            ckpt["mtp.0." + ("hc_head_" + name.removeprefix("hc_head.hc_") if name.startswith("hc_head.")
                             else _deepseek(name))] = value  # fmt: skip
        else:
            ckpt[f"model.mtp.0.{name}"] = value
        want[f"mtp.0.{name}"] = value
    return ckpt, want


def _deepseek(name: str) -> str:
    for a, b in _DEEPSEEK:
        if name.startswith(a):
            return b + name[len(a) :]
    return name


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4mtp")
    return path, _checkpoint(path, _config())


def _load(path):  # noqa: ANN001
    return load_model(EngineConfig(model=str(path), dtype="float32", max_model_len=64, block_size=4),
                      torch.device("cpu"))


@pytest.mark.parametrize("deepseek", [True, False], ids=["deepseek-names", "transformers-names"])
def test_the_mtp_layer_is_loaded_kept_and_described(folder, deepseek, caplog):
    path, hf = folder
    ckpt, want = _mtp_tensors(hf, deepseek)
    assert all(mtp_module_name(n) is not None for n in ckpt)
    save_file(ckpt, str(path / "mtp.safetensors"))
    try:
        with caplog.at_level(logging.INFO, logger="graphserve.models.deepseek_v4"):
            loaded = _load(path)
    finally:
        (path / "mtp.safetensors").unlink()
    assert "1 MTP layer(s) loaded and kept: unused until speculative decoding exists" in caplog.text
    params = dict(loaded.model.named_parameters())
    assert sorted(n for n in params if n.startswith("mtp.")) == sorted(want)
    for name, value in want.items():
        assert torch.equal(params[name], value.view(params[name].shape)), name
    bias = next(v for n, v in ckpt.items() if n.endswith(("gate.bias", "e_score_correction_bias")))
    assert torch.equal(loaded.model.mtp[0].mlp.experts.router.e_score_correction_bias, bias)
    d = loaded.info.description
    assert d.kept_unused.num_params == sum(v.numel() for v in want.values())
    assert d.num_params == sum(p.numel() for p in hf.parameters())  # the main model's count is transformers'
    assert d.weights_bytes == held_weight_bytes(loaded.model)  # the memory plan holds it


def test_a_checkpoint_without_an_mtp_layer_keeps_none(folder):
    loaded = _load(folder[0])
    assert loaded.model.mtp is None and loaded.info.description.kept_unused is None


@pytest.mark.parametrize(("edit", "match"), [
    (lambda c: c.update({"mtp.0.e_proj.weight": torch.randn(3, 3)}), r"'mtp.0.e_proj.weight' does not fit"),
    (lambda c: c.pop("mtp.0.h_proj.weight"), r"lacks 1 tensors: mtp.0.h_proj.weight"),
    (lambda c: c.update({"mtp.0.attn.compressor.wkv.weight": torch.randn(4, 4)}),
     r"'mtp.0.attn.compressor.wkv.weight' has no place"),
    (lambda c: c.update({"mtp.1.enorm.weight": torch.randn(64)}), r"'mtp.1.enorm.weight' has no place"),
])  # fmt: skip
def test_a_malformed_mtp_layer_is_refused_naming_the_tensor(folder, edit, match):
    path, hf = folder
    ckpt, _ = _mtp_tensors(hf, deepseek=True)
    edit(ckpt)
    save_file(ckpt, str(path / "mtp.safetensors"))
    try:
        with pytest.raises(ModelLoadError, match=match):
            _load(path)
    finally:
        (path / "mtp.safetensors").unlink()
