"""``--fp4-load-as fp8``: FP4 weights (``--quantization nvfp4/mxfp4`` on a model-dtype model, or an NVFP4
checkpoint) converted at load to FP8 e4m3 as ``--quantization fp8`` lays it out (dense per channel, experts in
128x128 blocks), held at the bytes the description counts, giving the FP4 model's logits within e4m3's rounding
(MXFP4: exactly); the option without FP4 weights is refused naming the flag."""

from __future__ import annotations

import pytest
import torch
from model_utils import dummy_preset, held_weight_bytes, relative_error

from graphserve.analysis.plan import build_plan, load_hf_config
from graphserve.config import EngineConfig
from graphserve.errors import ConfigError
from graphserve.kernels.fp4_reference import fp4_dequantize, mxfp4_quantize, nvfp4_quantize
from graphserve.kernels.fp8_quant import FP8_DTYPE
from graphserve.layers.linear import Linear
from graphserve.layers.moe import FusedMoE
from graphserve.layers.quant.fp4_to_fp8 import exactness, pow2_fp8
from graphserve.layers.quant.fp8 import Fp8LinearMethod
from graphserve.layers.quant.fp8_moe import Fp8MoEMethod
from graphserve.models.fp4_checkpoint import quantize_checkpoint_nvfp4
from graphserve.models.loader import load_model, meta_model

from test_fp4_checkpoint import greedy, sources  # noqa: F401  isort: skip

CPU = torch.device("cpu")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def _tiny(monkeypatch) -> str:
    """Dense attention projections and routed experts in each layer: both kinds of layer convert."""
    return dummy_preset(monkeypatch, "qwen3-30b-a3b", "tiny-moe-fp4fp8", **SMALL, moe_intermediate_size=64,
                        num_experts=4, num_experts_per_tok=2)


def _weights(model) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each quantized layer's dequantized fp32 weights (a Linear's, or an expert layer's w13 and w2)."""
    out = {}
    for name, m in model.named_modules():
        method = getattr(m, "quant_method", None)
        if isinstance(m, Linear) and method is not None:
            out[name] = (method.dequantized_weight(m, torch.float32),)
        elif isinstance(m, FusedMoE) and method is not None:
            out[name] = tuple(w.float() for w in method.dequantized(m, torch.float32))
    return out


def _check_converted(fp4, fp8, exact: bool, source: str, quantization: str = "none") -> None:
    """The same layers, now FP8 (per channel / 128x128 blocks), within e4m3's half-ulp of the FP4 weights (``exact``:
    equal), held at the bytes the description counts, about twice FP4's."""
    fp4_w, fp8_w = _weights(fp4.model), _weights(fp8.model)
    assert fp4_w.keys() == fp8_w.keys() and fp4_w
    for name, m in fp8.model.named_modules():
        if name not in fp8_w:
            continue
        method = m.quant_method
        assert isinstance(method, Fp8LinearMethod if isinstance(m, Linear) else Fp8MoEMethod), name
        weights = (m.weight,) if isinstance(m, Linear) else (m.w13_weight, m.w2_weight)
        assert all(w.dtype == FP8_DTYPE for w in weights), name
        assert not hasattr(m, "weight_scale_2") and not hasattr(m, "w13_weight_scale_2"), name
        for a, b in zip(fp8_w[name], fp4_w[name]):
            if exact:
                assert torch.equal(a, b), name
            else:  # e4m3 rounds a product of 2 and 4 significant bits to 4: half an ulp, 2^-4 relative at most
                assert ((a - b).abs() <= b.abs() * 2**-4 + 1e-30).all(), name
                assert relative_error(a, b) < 3e-2, name
    held = held_weight_bytes(fp8.model)
    assert fp8.info.description.weights_bytes == held
    assert build_plan(load_hf_config(source), gpu_memory_gb=80, dtype="fp32", quantization=quantization,
                      fp4_load_as="fp8")["weights_bytes"] == held  # `graphserve plan --fp4-load-as fp8` prices the same
    assert fp4.info.description.weights_bytes < held < fp8.info.description.weights_bytes + 1  # noqa: PLR2004


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dummy_fp4_as_fp8_gives_the_fp4_models_logits(monkeypatch, fmt):
    model = _tiny(monkeypatch)
    fp4 = load_model(EngineConfig(model=model, seed=4, quantization=fmt), CPU)
    fp8 = load_model(EngineConfig(model=model, seed=4, quantization=fmt, fp4_load_as="fp8"), CPU)
    exact = fmt == "mxfp4"  # E8M0 group scales are powers of two: every value lands in e4m3 (the module's note)
    _check_converted(fp4, fp8, exact, model, fmt)
    # the host-memory check before a load sizes the FP8 model too
    meta = meta_model(EngineConfig(model=model, seed=4, quantization=fmt, fp4_load_as="fp8"))
    assert held_weight_bytes(meta) == held_weight_bytes(fp8.model)
    fp4_tokens, fp4_logits = greedy(fp4.model)
    fp8_tokens, fp8_logits = greedy(fp8.model)
    if exact:
        assert fp8_tokens == fp4_tokens
        torch.testing.assert_close(fp8_logits, fp4_logits, rtol=1e-5, atol=1e-5)
    else:  # e4m3's rounding of the FP4 values: a few times smaller than FP4's own error against the unquantized model
        plain_logits = greedy(load_model(EngineConfig(model=model, seed=4), CPU).model)[1]
        assert relative_error(fp8_logits, fp4_logits) < 0.35 * relative_error(fp4_logits, plain_logits)


def test_nvfp4_checkpoint_as_fp8_folds_each_parts_global(sources, tmp_path):  # noqa: F811
    """A ModelOpt checkpoint whose q, k, v (and each expert's gate, up) carry their own globals: each row's FP8
    scale is a power of two times its part's global, and the router gates it excludes stay in the model dtype."""
    quantize_checkpoint_nvfp4(sources["qwen3-moe"], tmp_path / "fp4", exclude=("lm_head", "model.layers.*.mlp.gate"),
                              in_file=True)
    fp4 = load_model(EngineConfig(model=str(tmp_path / "fp4")), CPU)
    fp8 = load_model(EngineConfig(model=str(tmp_path / "fp4"), fp4_load_as="fp8"), CPU)
    _check_converted(fp4, fp8, False, str(tmp_path / "fp4"))
    qkv4 = fp4.model.get_submodule("model.layers.0.self_attn.qkv_proj")
    qkv8 = fp8.model.get_submodule("model.layers.0.self_attn.qkv_proj")
    ratio = qkv8.weight_scale / qkv4.quant_method.global_rows(qkv4)
    assert torch.equal(torch.exp2(torch.round(torch.log2(ratio))), ratio)  # powers of two
    assert fp8.model.get_submodule("model.layers.0.mlp.gate").weight.dtype == torch.float32
    fp4_logits, plain_logits = greedy(fp4.model)[1], greedy(load_model(EngineConfig(model=str(sources["qwen3-moe"])),
                                                                       CPU).model)[1]
    assert relative_error(greedy(fp8.model)[1], fp4_logits) < 0.35 * relative_error(fp4_logits, plain_logits)


def test_pow2_conversion_is_exact_for_mxfp4_and_bounded_for_nvfp4():
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(3, 48, 256, generator=gen) * torch.rand(3, 48, 1, generator=gen)
    mx = fp4_dequantize(*mxfp4_quantize(w), None, "mxfp4")
    for block in (None, (32, 128)):
        q, s = pow2_fp8(mx, block)
        assert exactness(mx, q, s, block) == {"inexact": 0.0, "max_rel": 0.0}
    packed, scale, _ = nvfp4_quantize(w)
    nv = fp4_dequantize(packed, scale, torch.ones(3), "nvfp4")  # codes times group scales, the global apart
    q, s = pow2_fp8(nv, None)
    seen = exactness(nv, q, s, None)
    assert 0.0 < seen["inexact"] < 0.5 and seen["max_rel"] <= 2**-4
    assert torch.equal(torch.exp2(torch.round(torch.log2(s))), s)


def test_fp4_load_as_without_fp4_weights_is_refused_naming_the_flag(monkeypatch):
    model = _tiny(monkeypatch)
    for quantization, has in (("none", "no quantization"), ("fp8", r"fp8 \(per-channel")):
        with pytest.raises(ConfigError, match=rf"--fp4-load-as=fp8 needs FP4 weights .* loads with {has}") as e:
            load_model(EngineConfig(model=model, quantization=quantization, fp4_load_as="fp8"), CPU)
        assert e.value.param == "fp4_load_as"
    with pytest.raises(ConfigError, match="--fp4-load-as=fp8 needs FP4 weights .* no quantization"):
        build_plan(load_hf_config(model), gpu_memory_gb=80, fp4_load_as="fp8")
    with pytest.raises(ConfigError, match="--fp4-load-as='fp16' is invalid"):
        EngineConfig(model=model, fp4_load_as="fp16")


def test_gpt_oss_mxfp4_experts_as_fp8(monkeypatch):
    """gpt-oss's preset ships MXFP4 experts only (biases, swiglu_oai) and keeps every dense projection in the model
    dtype: only the experts convert, exactly (E8M0 scales), keeping their biases and activation, and the description
    prices just them as FP8."""
    model = dummy_preset(monkeypatch, "gpt-oss-20b", "tiny-gpt-oss-fp4fp8", hidden_size=64, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_local_experts=4, num_experts_per_tok=2, experts_per_token=2, max_position_embeddings=256,
                         layer_types=["sliding_attention", "full_attention"])
    fp4 = load_model(EngineConfig(model=model, seed=2, max_model_len=64), CPU)
    fp8 = load_model(EngineConfig(model=model, seed=2, max_model_len=64, fp4_load_as="fp8"), CPU)
    assert fp8.model.get_submodule("model.layers.0.self_attn.qkv_proj").quant_method is None
    _check_converted(fp4, fp8, True, model)  # equal weights: the CPU path's logits are the FP4 model's
    experts = fp8.model.get_submodule("model.layers.0.mlp.experts")
    assert experts.w13_bias is not None and experts.activation == "swiglu_oai"
