"""FP8 mixture-of-experts checkpoints (our quantizer, the HF layout Qwen3-30B-A3B-FP8 ships:
``experts.N.gate_proj.weight`` fp8 + ``weight_scale_inv``) load with fp8 routed experts and give the
logits of the same model dequantized; ``--quantization`` quantizes bf16 experts at load; malformed
ones are refused naming the tensor."""

from __future__ import annotations

import pytest
import torch
from model_utils import (
    PagedHarness,
    dequantized_checkpoint,
    dummy_preset,
    held_weight_bytes,
    make_hf_checkpoints,
    relative_error,
)
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, Qwen3MoeConfig

from graphserve.config import EngineConfig
from graphserve.errors import ModelLoadError
from graphserve.kernels.fp8_quant import FP8_DTYPE
from graphserve.layers.moe import FusedMoE
from graphserve.models.fp8_checkpoint import quantize_checkpoint
from graphserve.models.loader import load_model

CPU = torch.device("cpu")
TOKENS = list(range(7, 37))
_TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
CONFIGS = {
    # q 4x32, k/v 2x32, dense MLP 96 (layer 1), experts 32 wide: multiples of the 32-row test block
    "qwen3-moe": lambda: Qwen3MoeConfig(**_TINY, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                                        num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                                        mlp_only_layers=[1]),
    # experts 48 wide: the gate's and the up projection's last 32-row scale blocks are partial
    "mixtral": lambda: MixtralConfig(**_TINY, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_hf_checkpoints(tmp_path_factory, CONFIGS, seed=5)


def _load(folder, **kw):
    return load_model(EngineConfig(model=str(folder), **kw), CPU)


def _logits(loaded) -> torch.Tensor:
    return PagedHarness(loaded.model).step([("s", TOKENS)])[0]


def _experts(loaded) -> list[FusedMoE]:
    return [m for m in loaded.model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("family,block", [("qwen3-moe", (32, 32)), ("mixtral", (32, 32)), ("mixtral", None)],
                         ids=["qwen3-moe-block", "mixtral-block", "mixtral-channel"])
def test_fp8_moe_checkpoint_matches_the_same_model_dequantized(sources, tmp_path, family, block):
    quantize_checkpoint(sources[family], tmp_path / "fp8", block=block)
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    prefix = "model.layers.0.mlp.experts.1.gate_proj" if family == "qwen3-moe" else \
        "model.layers.0.block_sparse_moe.experts.1.w1"
    assert stored[f"{prefix}.weight"].dtype == FP8_DTYPE
    assert f"{prefix}.weight_scale_inv" in stored if block else f"{prefix}.weight_scale" in stored
    dequantized_checkpoint(tmp_path / "fp8", tmp_path / "deq")
    fp8 = _load(tmp_path / "fp8")
    layers = _experts(fp8)
    assert layers and all(m.w13_weight.dtype == FP8_DTYPE and m.w2_weight.dtype == FP8_DTYPE for m in layers)
    got, deq = _logits(fp8), _logits(_load(tmp_path / "deq"))
    # The CPU path multiplies by the dequantized fp32 weights, exactly those of the dequantized
    # checkpoint, in the same order of operations: only the fp32 rounding of q * scale can differ.
    torch.testing.assert_close(got, deq, rtol=1e-5, atol=1e-5)
    # and against the unquantized model: e4m3 keeps 3 mantissa bits (<= 6.25% per weight, ~2-3% rms),
    # and a token whose two best router scores lie within that of each other may pick another
    # expert; through two layers of random weights the logits move by ~10%, never by their size
    assert relative_error(got, _logits(_load(sources[family]))) < 0.25
    # the description counts one byte per expert weight plus the fp32 scales, and every other byte the model holds
    d = fp8.info.description
    assert 1.0 < d.expert_bytes / d.expert_params < 1.2
    assert d.weights_bytes == held_weight_bytes(fp8.model)


def test_quantization_flag_quantizes_the_experts_at_load(sources, tmp_path):
    """``--quantization fp8-channel`` on the bf16 checkpoint = the per-channel FP8 checkpoint dequantized."""
    quantize_checkpoint(sources["mixtral"], tmp_path / "fp8", block=None)
    dequantized_checkpoint(tmp_path / "fp8", tmp_path / "deq")
    online = _load(sources["mixtral"], quantization="fp8-channel")
    assert all(m.w13_weight.dtype == FP8_DTYPE and m.quant_method is not None for m in _experts(online))
    torch.testing.assert_close(_logits(online), _logits(_load(tmp_path / "deq")), rtol=1e-5, atol=1e-5)


def _fp8_folder(source, tmp_path, change=None):
    folder = tmp_path / "fp8"
    quantize_checkpoint(source, folder, block=(32, 32))
    if change:
        tensors = load_file(str(folder / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_missing_expert_scale_is_named(sources, tmp_path):
    folder = _fp8_folder(sources["qwen3-moe"], tmp_path,
                         lambda t: t.pop("model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"))
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensors: model\.layers\.0\.mlp\.experts\.w13_weight_scale_inv"
                                             r"#\(2, 'w3'\)"):  # fmt: skip
        _load(folder)


@pytest.mark.parametrize("value,message", [
    (torch.ones(2, 2), r"shape \(2, 2\), expected \(1, 2\)"),  # [32/32, 64/32] = [1, 2]
    (torch.full((1, 2), float("nan")), "not finite"),
    (torch.ones(1, 2, dtype=torch.int32), "expected a float32 scale"),
], ids=["shape", "nan", "dtype"])
def test_malformed_expert_scale_is_named(sources, tmp_path, value, message):
    name = "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"
    if value.shape == (2, 2):
        name = "model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv"
    folder = _fp8_folder(sources["qwen3-moe"], tmp_path, lambda t: t.__setitem__(name, value))
    with pytest.raises(ModelLoadError, match=rf"{name}.*{message}"):
        _load(folder)


def test_unquantized_expert_under_an_fp8_config_is_named(sources, tmp_path):
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    folder = _fp8_folder(sources["qwen3-moe"], tmp_path, lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(ModelLoadError, match=rf"{name}.*dtype torch.float32, expected torch.float8_e4m3fn"):
        _load(folder)


def _static_folder(source, tmp_path, amax: float = 4.0, change=None):
    """A per-channel FP8 checkpoint with static activation scales (``input_scale`` = amax / 448) on every
    projection, the experts' included, as Mixtral-8x7B-FP8 ships them."""
    names = [n for n in load_file(str(source / "model.safetensors")) if n.endswith(("_proj.weight", ".w1.weight",
                                                                                     ".w2.weight", ".w3.weight"))]
    folder = tmp_path / "fp8-static"
    quantize_checkpoint(source, folder, block=None, input_amax={n.removesuffix(".weight"): amax for n in names})
    if change:
        tensors = load_file(str(folder / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_static_activation_scales_load_for_experts(sources, family, tmp_path):
    """Each expert part's input_scale lands in its place, the layer keeps the largest (what the kernels apply),
    the description counts them, and the CPU path (activations unquantized) gives the dequantized model's
    logits."""
    per_expert = {}

    def vary(tensors):  # a different scale per expert and part: the largest must win, each must land in place
        for name in tensors:
            if ".experts." in name and name.endswith("input_scale"):
                tensors[name] = torch.tensor(0.01 * (1 + len(per_expert)), dtype=torch.float32)
                per_expert[name] = tensors[name].item()

    folder = _static_folder(sources[family], tmp_path, change=vary)
    fp8 = _load(folder)
    layers = _experts(fp8)
    assert layers
    for index, m in enumerate(layers):
        prefix = next(n for n in per_expert if f"layers.{index}." in n).split(".experts.")[0]
        w1, w2, w3 = ("gate_proj", "down_proj", "up_proj") if family == "qwen3-moe" else ("w1", "w2", "w3")
        for e in range(m.num_experts):
            assert m.w13_input_scale[e, 0].item() == pytest.approx(per_expert[f"{prefix}.experts.{e}.{w1}.input_scale"])
            assert m.w13_input_scale[e, 1].item() == pytest.approx(per_expert[f"{prefix}.experts.{e}.{w3}.input_scale"])
            assert m.w2_input_scale[e, 0].item() == pytest.approx(per_expert[f"{prefix}.experts.{e}.{w2}.input_scale"])
        assert m.w13_input_scale_max.item() == m.w13_input_scale.max().item()
        assert m.w2_input_scale_max.item() == m.w2_input_scale.max().item()
        assert "input_scales" in m.quant_method.kernel_args(m)
    assert fp8.info.description.weights_bytes == held_weight_bytes(fp8.model)
    dequantized_checkpoint(folder, tmp_path / "deq")
    torch.testing.assert_close(_logits(fp8), _logits(_load(tmp_path / "deq")), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value,message", [
    (torch.tensor(0.0), r"1 of 1 scales are not finite and > 0 \(the first, at \(\), is 0\.0\)"),
    (torch.tensor(float("nan")), r"1 of 1 scales are not finite and > 0 \(the first, at \(\), is nan\)"),
    (torch.ones(2), r"shape \(2,\), expected one value"),
], ids=["zero", "nan", "shape"])
def test_malformed_expert_input_scale_is_named(sources, tmp_path, value, message):
    name = "model.layers.0.mlp.experts.2.up_proj.input_scale"
    folder = _static_folder(sources["qwen3-moe"], tmp_path, change=lambda t: t.__setitem__(name, value))
    with pytest.raises(ModelLoadError, match=rf"{name}.*{message}"):
        _load(folder)


def test_missing_expert_input_scale_is_named(sources, tmp_path):
    folder = _static_folder(sources["qwen3-moe"], tmp_path,
                            change=lambda t: t.pop("model.layers.0.mlp.experts.1.down_proj.input_scale"))
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensors: model\.layers\.0\.mlp\.experts\.w2_input_scale"
                                             r"#\(1, 'w2'\)"):  # fmt: skip
        _load(folder)


def test_static_activation_scales_with_block_scaled_experts_are_refused():
    from graphserve.layers.quant.config import Fp8Config
    from graphserve.layers.quant.fp8_moe import Fp8MoEMethod

    with pytest.raises(ValueError, match=r"activation_scheme='static' with weight_block_size=\[32, 32\] is not "
                                         r"supported for routed experts"):  # fmt: skip
        Fp8MoEMethod(Fp8Config(block=(32, 32), activation_scheme="static", serialized=True))


def test_plan_counts_fp8_expert_bytes_and_scales():
    from graphserve.analysis.plan import build_plan, load_hf_config
    from graphserve.models.registry import describe_model

    hf = load_hf_config("dummy:qwen3-30b-a3b")
    d = describe_model(hf, torch.bfloat16, 1)
    fp8 = build_plan(hf, gpu_memory_gb=141, quantization="fp8-block")
    # one Qwen3-30B-A3B expert: gate, up [768, 2048] and down [2048, 768] = 4,718,592 fp8 bytes, and
    # 128x128 block scales 2 * 6 * 16 + 16 * 6 = 288 fp32 = 1,152 bytes; 48 layers of 128 experts
    assert d.expert_params == 4_718_592
    expert = 4_718_592 + 1_152
    # bf16: embedding, head, norms and routers (48 layers x (2 norms of 2048, the q and k norms of 128 and a
    # 128 x 2048 router) + the final norm)
    assert d.model_dtype_params == 48 * (2 * 2048 + 2 * 128 + 128 * 2048) + 2048
    kept = (d.embed_params + d.lm_head_params + d.model_dtype_params) * 2
    projections = d.dense_params - d.model_dtype_params
    # each layer's qkv [(32 + 2 x 4) x 128, 2048] and o [2048, 32 x 128]: 40 x 16 + 16 x 32 blocks of 128x128
    assert fp8["weights_bytes"] == projections + 48 * 4 * (40 * 16 + 16 * 32) + kept + 48 * 128 * expert
    # ``fp8``: the same experts, dense projections per channel (a 4-byte scale per output row: 5120 of qkv, 2048 of o)
    mixed = build_plan(hf, gpu_memory_gb=141, quantization="fp8")
    assert mixed["weights_bytes"] == projections + 48 * 4 * (5120 + 2048) + kept + 48 * 128 * expert
    assert build_plan(hf, gpu_memory_gb=141)["weights_bytes"] > 1.9 * fp8["weights_bytes"]


def test_dummy_fp8_experts_are_the_quantized_bf16_dummy(monkeypatch):
    """``dummy: --quantization fp8``: the experts draw the bf16 dummy's values (same seed), then quantize."""
    from graphserve.kernels.moe_fp8_reference import dequantize_experts
    dummy_preset(monkeypatch, "qwen3-30b-a3b", "tiny-moe-fp8", hidden_size=128, intermediate_size=256,
                 moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 num_experts=4, num_experts_per_tok=2, max_position_embeddings=256)  # fmt: skip
    plain = load_model(EngineConfig(model="dummy:tiny-moe-fp8", seed=4), CPU)
    fp8 = load_model(EngineConfig(model="dummy:tiny-moe-fp8", seed=4, quantization="fp8"), CPU)
    # ``fp8`` keeps 128x128 blocks for the experts and quantizes dense projections per channel
    assert fp8.model.model.layers[0].self_attn.qkv_proj.weight_scale.dim() == 1
    for layer, ref in zip(_experts(fp8), _experts(plain)):
        assert layer.w13_weight_scale_inv.shape == (4, 2, 1) and layer.w2_weight_scale_inv.shape == (4, 1, 1)
        back13 = dequantize_experts(layer.w13_weight, layer.w13_weight_scale_inv, (128, 128), parts=2)
        back2 = dequantize_experts(layer.w2_weight, layer.w2_weight_scale_inv, (128, 128))
        for back, w in ((back13, ref.w13_weight), (back2, ref.w2_weight)):
            assert ((back - w).abs() <= w.abs() * 2**-4 + 1e-6).all()
    a, b = _logits(plain), _logits(fp8)
    assert torch.isfinite(b).all() and relative_error(b, a) < 0.25
    assert fp8.info.description.expert_bytes < 0.51 * plain.info.description.expert_bytes


def test_plan_reserves_the_w8a8_activation_copies():
    """qwen3-30b-a3b's fp8 experts run W8A8 at every grouped-GEMM size (kernels/moe_fused.py's rule): the plan's
    MoE workspace adds the fp8 copies of x [T, H] and of the activation [pairs, I] with their scales, at a
    2048-token prefill chunk and at a decode batch of 64 alike."""
    from graphserve.analysis.plan import load_hf_config
    from graphserve.layers.quant.config import online_config, quantized_description
    from graphserve.models.registry import describe_model

    d = describe_model(load_hf_config("dummy:qwen3-30b-a3b"), torch.bfloat16, 1)
    fp8 = quantized_description(d, online_config("fp8"), torch.bfloat16)
    for t in (2048, 64):
        pairs = t * 8
        extra = t * 2048 + pairs * 768 + 4 * (t * 16 + pairs * 6)
        assert fp8.moe_workspace_bytes(t) - d.moe_workspace_bytes(t) == extra


@pytest.mark.parametrize("quantization", ["fp8", "fp8-channel"])
def test_dequantizing_in_place_leaves_the_logits(sources, quantization):
    """benchmarks/fp8_accuracy's ``rounded`` model: every FP8 projection and expert stack dequantized in place and
    run by the unquantized path gives the logits the FP8 model gives on CPU (which dequantizes per call), bit for
    bit, and no quantized module or scale is left."""
    from benchmarks.fp8_accuracy import dequantize_in_place

    loaded = _load(sources["mixtral"], quantization=quantization)
    want = _logits(loaded)
    quantized = [m for m in loaded.model.modules() if getattr(m, "quant_method", None) is not None]
    assert any(isinstance(m, FusedMoE) for m in quantized) and len(quantized) > len(_experts(loaded))
    assert dequantize_in_place(loaded.model, loaded.info.dtype) == len(quantized)
    assert all(getattr(m, "quant_method", None) is None for m in loaded.model.modules())
    held = [*loaded.model.named_parameters(), *loaded.model.named_buffers()]
    assert not any("scale" in name for name, _ in held)
    assert all(p.dtype == loaded.info.dtype for m in quantized for p in m.parameters())
    assert torch.equal(_logits(loaded), want)
