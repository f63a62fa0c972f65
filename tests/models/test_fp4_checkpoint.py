"""NVFP4 checkpoints in ModelOpt's layout (our writer: config.json's quantization_config or hf_quant_config.json)
load with FP4 projections and experts, hold the bytes their description counts, and give the greedy tokens of the
same model whose weights are the dequantized values; an exclude list keeps modules in the model dtype; malformed
checkpoints are refused naming the tensor or field."""

from __future__ import annotations

import json

import pytest
import torch
from model_utils import PagedHarness, held_weight_bytes, make_hf_checkpoints, relative_error
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, Qwen3MoeConfig

from graphserve.analysis.plan import build_plan, load_hf_config
from graphserve.config import EngineConfig
from graphserve.errors import ModelLoadError
from graphserve.kernels.fp4_reference import nvfp4_dequantize
from graphserve.layers.linear import Linear
from graphserve.layers.moe import FusedMoE
from graphserve.models.fp4_checkpoint import quantize_checkpoint_nvfp4
from graphserve.models.loader import load_model

CPU = torch.device("cpu")
PROMPT = list(range(7, 23))
_TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, head_dim=16,
             tie_word_embeddings=False)
CONFIGS = {
    "llama": lambda: LlamaConfig(**_TINY, intermediate_size=96),
    # experts 32 wide in layer 0, a dense MLP in layer 1
    "qwen3-moe": lambda: Qwen3MoeConfig(**_TINY, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_hf_checkpoints(tmp_path_factory, CONFIGS, seed=7)


def dequantized(fp4, dst) -> None:
    """``fp4`` with every NVFP4 weight replaced by its fp32 dequantized values, no scales, no quantization config."""
    dst.mkdir()
    tensors = load_file(str(fp4 / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_2", "input_scale")):
            continue
        module = name.removesuffix(".weight")
        if f"{module}.weight_scale_2" in tensors:
            t = nvfp4_dequantize(t, tensors[f"{module}.weight_scale"], tensors[f"{module}.weight_scale_2"])
        out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((fp4 / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config))
    for f in fp4.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "hf_quant_config.json"):
            (dst / f.name).write_bytes(f.read_bytes())


@torch.no_grad()
def greedy(model, steps: int = 6) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after PROMPT, and the prompt's logits."""
    harness = PagedHarness(model)
    logits = harness.step([("s", PROMPT)])[0]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        tokens.append(int(harness.step([("s", tokens[-1:])])[0][-1].argmax()))
    return tokens, logits


def _load(folder, **kw):
    return load_model(EngineConfig(model=str(folder), **kw), CPU)


@pytest.mark.parametrize("family,exclude,in_file", [
    ("llama", ("lm_head",), False),
    ("qwen3-moe", ("lm_head", "model.layers.*.mlp.gate"), True),
    # layer 1's attention whole (q/k/v and o) and layer 0's experts, by globs
    ("qwen3-moe", ("lm_head", "model.layers.1.self_attn*", "model.layers.0.mlp.experts*"), False),
], ids=["llama", "qwen3-moe-file", "qwen3-moe-excluded"])  # fmt: skip
def test_nvfp4_checkpoint_gives_the_tokens_of_the_dequantized_model(sources, tmp_path, family, exclude, in_file):
    quantize_checkpoint_nvfp4(sources[family], tmp_path / "fp4", exclude=exclude, in_file=in_file)
    stored = load_file(str(tmp_path / "fp4" / "model.safetensors"))
    assert stored["model.layers.1.mlp.down_proj.weight"].shape == (64, 48)
    assert stored["model.layers.1.mlp.down_proj.weight_scale"].dtype == torch.float8_e4m3fn
    dequantized(tmp_path / "fp4", tmp_path / "deq")
    loaded = _load(tmp_path / "fp4")
    model = loaded.model
    assert loaded.info.description.weights_bytes == held_weight_bytes(model)
    # `graphserve plan` reads the folder's quantization (config.json's or hf_quant_config.json) to the same bytes
    assert build_plan(load_hf_config(str(tmp_path / "fp4")), gpu_memory_gb=80, dtype="fp32")["weights_bytes"] == \
        held_weight_bytes(model)
    fp4_linears = {n for n, m in model.named_modules() if isinstance(m, Linear) and m.quant_method is not None}
    fp4_experts = {n for n, m in model.named_modules() if isinstance(m, FusedMoE) and m.quant_method is not None}
    assert "model.layers.0.self_attn.qkv_proj" in fp4_linears and "model.layers.1.mlp.gate_up_proj" in fp4_linears
    if family == "qwen3-moe":
        assert not any(n.endswith(".gate") for n in fp4_linears)
    if "model.layers.1.self_attn*" in exclude:
        assert not {"model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj"} & fp4_linears
        assert model.get_submodule("model.layers.1.self_attn.qkv_proj").weight.dtype == torch.float32
        assert fp4_experts == set()
    elif family == "qwen3-moe":
        assert fp4_experts == {"model.layers.0.mlp.experts"}
        experts = model.get_submodule("model.layers.0.mlp.experts")
        want = torch.stack([stored[f"model.layers.0.mlp.experts.{e}.{p}.weight_scale_2"]
                            for e in range(4) for p in ("gate_proj", "up_proj")]).view(4, 2)
        assert torch.equal(experts.w13_weight_scale_2, want)
    # each fused part keeps its own global scale
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    want = torch.stack([stored[f"model.layers.0.self_attn.{p}_proj.weight_scale_2"] for p in "qkv"])
    assert torch.equal(qkv.weight_scale_2, want) and want.unique().numel() == 3
    fp4_tokens, fp4_logits = greedy(model)
    deq_tokens, deq_logits = greedy(_load(tmp_path / "deq").model)
    assert fp4_tokens == deq_tokens
    # the CPU path multiplies by the same fp32 dequantized weights: only summation order differs
    torch.testing.assert_close(fp4_logits, deq_logits, rtol=1e-5, atol=1e-5)
    # and it stays near the unquantized model (E2M1 steps with e4m3 scales: ~10% per weight, RMS)
    assert relative_error(fp4_logits, greedy(_load(sources[family]).model)[1]) < 0.5


def _write(folder, tensors, config=None) -> None:
    save_file(tensors, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def llama_fp4(sources, tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-fp4")
    quantize_checkpoint_nvfp4(sources["llama"], folder)
    return folder


def _broken(llama_fp4, tmp_path, edit, config_edit=None):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(llama_fp4, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    config = json.loads((folder / "config.json").read_text())
    if config_edit:
        config_edit(config["quantization_config"])
    _write(folder, tensors, config)
    return folder


OPROJ = "model.layers.0.self_attn.o_proj"
Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.__setitem__(f"{OPROJ}.weight", t[f"{OPROJ}.weight"][:, :16].contiguous()),
     rf"'{OPROJ}.weight' does not fit .*o_proj.weight: packed codes have shape \(64, 16\), expected \(64, 32\)"),
    (lambda t: t.__setitem__(f"{OPROJ}.weight", t[f"{OPROJ}.weight"].to(torch.int8)),
     rf"'{OPROJ}.weight' .*dtype torch.int8, expected torch.uint8 \(two E2M1 codes a byte; nvfp4\)"),
    (lambda t: t.__setitem__(f"{OPROJ}.weight_scale", t[f"{OPROJ}.weight_scale"].float()),
     rf"'{OPROJ}.weight_scale' .*dtype torch.float32, expected torch.float8_e4m3fn \(nvfp4 group scales\)"),
    (lambda t: t.__setitem__(f"{OPROJ}.weight_scale", t[f"{OPROJ}.weight_scale"][:, :2].contiguous()),
     rf"'{OPROJ}.weight_scale' .*scales have shape \(64, 2\), expected \(64, 4\)"),
    (lambda t: t.__setitem__(f"{Q}.weight_scale_2", torch.tensor(0.0)),
     rf"'{Q}.weight_scale_2' .*1 of 1 scales are not finite and > 0 .* is 0.0\)"),
    (lambda t: t.__setitem__(f"{Q}.weight_scale_2", torch.tensor(float("inf"))),
     rf"'{Q}.weight_scale_2' .*not finite and > 0 .* is inf\)"),
    (lambda t: t.__setitem__(f"{Q}.input_scale", torch.tensor(float("nan"))),
     rf"'{Q}.input_scale' .*not finite and > 0"),
    (lambda t: t.__setitem__(f"{Q}.weight_scale_2", torch.ones(2)),
     rf"'{Q}.weight_scale_2' .*shape \(2,\), expected one value"),
    (lambda t: t.pop(f"{Q}.weight_scale_2"), r"lacks 1 tensors: model.layers.0.self_attn.qkv_proj.weight_scale_2#0"),
], ids=["packed-shape", "packed-dtype", "scale-dtype", "scale-shape", "global-zero", "global-inf", "input-nan",
        "global-shape", "global-missing"])  # fmt: skip
def test_a_malformed_nvfp4_checkpoint_is_refused_naming_the_tensor(llama_fp4, tmp_path, edit, message):
    with pytest.raises(ModelLoadError, match=message):
        _load(_broken(llama_fp4, tmp_path, edit))


@pytest.mark.parametrize("config_edit,message", [
    (lambda q: q["config_groups"]["group_0"]["weights"].__setitem__("group_size", 32),
     r"quantization_config.config_groups.group_0.weights.group_size=32 is not supported: NVFP4 scales groups of 16"),
    (lambda q: q.__setitem__("quant_algo", "FP8"), r"quantization_config.quant_algo='FP8' is not supported"),
    (lambda q: q.__setitem__("kv_cache_quant_algo", "FP8"), r"quantization_config.kv_cache_quant_algo='FP8'"),
    (lambda q: q.__setitem__("ignore", ["model.layers.0.self_attn.q_proj"]),
     r"lists 'model.layers.0.self_attn.q_proj' but not 'model.layers.0.self_attn.k_proj' and "
     r"'model.layers.0.self_attn.v_proj', which graphserve fuses .* or none \(FP4\)"),
    (lambda q: q.__setitem__("smoothing", True), r"quantization_config.smoothing=True is not supported"),
], ids=["group-32", "algo", "kv-cache", "partly-fused", "unknown-key"])  # fmt: skip
def test_a_bad_modelopt_config_is_refused_naming_the_field(llama_fp4, tmp_path, config_edit, message):
    with pytest.raises(ModelLoadError, match=message):
        _load(_broken(llama_fp4, tmp_path, lambda t: None, config_edit))


def test_hf_quant_config_group_size_and_a_flag_conflict_are_refused(sources, tmp_path):
    quantize_checkpoint_nvfp4(sources["llama"], tmp_path / "fp4", in_file=True)
    path = tmp_path / "fp4" / "hf_quant_config.json"
    raw = json.loads(path.read_text())
    with pytest.raises(Exception, match=r"--quantization=mxfp4 conflicts with the checkpoint's nvfp4"):
        _load(tmp_path / "fp4", quantization="mxfp4")
    raw["quantization"]["group_size"] = 32
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"hf_quant_config.json quantization.group_size=32 is not supported"):
        _load(tmp_path / "fp4")


def test_deepseek_nvfp4_checkpoint_dequantizes_kv_b_proj_at_load(tmp_path):
    """DeepSeek-V3 in NVFP4 with its quantization in hf_quant_config.json: projections, shared and routed experts
    load in FP4 (q_a_proj and kv_a_proj_with_mqa fused, each with its own global), kv_b_proj (read directly by
    latent attention) dequantized into the model dtype; the greedy tokens of the dequantized model."""
    from model_utils import make_hf_checkpoint
    from test_deepseek import _TINY as DEEPSEEK
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**{**DEEPSEEK, "num_hidden_layers": 2, "kv_lora_rank": 48, "v_head_dim": 16},
                              q_lora_rank=32, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                              rope_theta=10000.0)
    make_hf_checkpoint(tmp_path / "src", config, seed=5)
    quantize_checkpoint_nvfp4(tmp_path / "src", tmp_path / "fp4", exclude=("lm_head", "model.layers.*.mlp.gate"),
                              in_file=True)
    stored = load_file(str(tmp_path / "fp4" / "model.safetensors"))
    assert stored["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.uint8
    dequantized(tmp_path / "fp4", tmp_path / "deq")
    loaded = _load(tmp_path / "fp4")
    attn = loaded.model.model.layers[0].self_attn
    assert attn.kv_b_proj.quant_method is None and attn.kv_b_proj.weight.dtype == torch.float32
    assert attn.fused_qkv_a_proj.weight.dtype == torch.uint8 and attn.fused_qkv_a_proj.weight_scale_2.unique().numel() == 2
    assert loaded.info.description.weights_bytes == held_weight_bytes(loaded.model)
    fp4_tokens, fp4_logits = greedy(loaded.model)
    deq_tokens, deq_logits = greedy(_load(tmp_path / "deq").model)
    assert fp4_tokens == deq_tokens
    torch.testing.assert_close(fp4_logits, deq_logits, rtol=1e-5, atol=1e-5)


def test_an_nvfp4_kv_b_proj_without_its_global_is_refused_naming_it():
    from graphserve.kernels.fp4_reference import nvfp4_quantize
    from graphserve.layers.quant.fp4_dequant_at_load import dequantize_fp4_at_load

    kv_b = "model.layers.0.self_attn.kv_b_proj"
    packed, scale, g = nvfp4_quantize(torch.randn(32, 48))
    tensors = [(f"{kv_b}.weight_scale", scale), ("model.norm.weight", torch.ones(4)), (f"{kv_b}.weight", packed)]
    with pytest.raises(ModelLoadError, match=rf"checkpoint has '{kv_b}.weight_scale', '{kv_b}.weight' but not "
                                             rf"'{kv_b}.weight_scale_2'"):
        list(dequantize_fp4_at_load(tensors, (".kv_b_proj",)))
    out = dict(dequantize_fp4_at_load([*tensors, (f"{kv_b}.weight_scale_2", g)], (".kv_b_proj",)))
    assert torch.equal(out[f"{kv_b}.weight"], nvfp4_dequantize(packed, scale, g)) and "model.norm.weight" in out
    with pytest.raises(ModelLoadError, match=rf"'{kv_b}.weight_scale_2': .* is 0.0"):
        list(dequantize_fp4_at_load([(f"{kv_b}.weight_scale_2", torch.tensor(0.0))], (".kv_b_proj",)))


def test_quantization_flag_on_a_bf16_folder_is_the_nvfp4_checkpoint(sources, llama_fp4):
    """``--quantization nvfp4`` on the unquantized folder holds the codes, scales and globals the ModelOpt-layout
    checkpoint stores (one recipe), so both give the same logits; the checkpoint alone holds input scales."""
    online = _load(sources["llama"], quantization="nvfp4").model
    stored = _load(llama_fp4).model
    for name, module in stored.named_modules():
        if isinstance(module, Linear) and module.quant_method is not None:
            twin = online.get_submodule(name)
            assert torch.equal(twin.weight, module.weight), name
            assert torch.equal(twin.weight_scale.view(torch.uint8), module.weight_scale.view(torch.uint8)), name
            assert torch.equal(twin.weight_scale_2, module.weight_scale_2), name
            assert not hasattr(twin, "input_scale") and module.input_scale.shape == module.weight_scale_2.shape
    assert torch.equal(greedy(online)[1], greedy(stored)[1])
