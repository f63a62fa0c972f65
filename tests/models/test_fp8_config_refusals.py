"""What an FP8 checkpoint's quantization_config and scales may say, and how the rest is refused by name.

Ignore lists name the checkpoint's modules (q_proj, gate_proj, experts.3.down_proj) while graphserve fuses them
(qkv_proj, gate_up_proj, a layer's experts): a fused layer is kept in the model dtype when all of its parts are
listed and refused when some are. Scales must be finite and positive; a block size must suit the CUDA kernels; the
keys transformers writes are accepted at their no-op values; scales graphserve does not load are named as such."""

from __future__ import annotations

import json

import pytest
import torch
from model_utils import PagedHarness, dequantized_checkpoint, held_weight_bytes, make_hf_checkpoints
from safetensors.torch import load_file, save_file
from transformers import FineGrainedFP8Config, MixtralConfig, Qwen3Config, Qwen3MoeConfig

from graphserve.config import EngineConfig
from graphserve.distributed import state
from graphserve.errors import ModelLoadError
from graphserve.kernels.fp8_quant import FP8_DTYPE
from graphserve.layers.quant.config import DEQUANTIZED_AT_LOAD, Fp8Config, parse_quantization_config
from graphserve.layers.quant.dequant_at_load import dequantize_at_load
from graphserve.models.fp8_checkpoint import quantize_checkpoint
from graphserve.models.loader import load_model

CPU = torch.device("cpu")
TOKENS = list(range(7, 37))
_TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
CONFIGS = {
    # q 4x16 = 64, k/v 2x16 = 32, MLP 96: every fused part is a multiple of the 32-row test block
    "dense": lambda: Qwen3Config(**_TINY, intermediate_size=96, head_dim=16, tie_word_embeddings=False),
    # 6 experts 32 wide in layer 0, a dense MLP in layer 1
    "qwen3-moe": lambda: Qwen3MoeConfig(**_TINY, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                                        num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                                        mlp_only_layers=[1]),
    # experts under ``block_sparse_moe`` named w1/w2/w3, which the family maps to ``mlp.experts``
    "mixtral": lambda: MixtralConfig(**_TINY, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
}
EXPERT_PARTS = {"qwen3-moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
EXPERT_PREFIX = {"qwen3-moe": "model.layers.0.mlp.experts", "mixtral": "model.layers.0.block_sparse_moe.experts"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_hf_checkpoints(tmp_path_factory, CONFIGS, seed=3)


def _fp8(src, folder, block=(32, 32), unquantized=(), quant=None, tensors=None, **kw):
    """``src`` quantized into ``folder`` (``unquantized``: module-name suffixes left in fp32), then its
    quantization_config updated by ``quant`` and its tensors changed by ``tensors``."""
    quantize_checkpoint(src, folder, block=block, unquantized=tuple(unquantized), **kw)
    if tensors is not None:
        stored = load_file(str(folder / "model.safetensors"))
        tensors(stored)
        save_file(stored, str(folder / "model.safetensors"))
    if quant is not None:
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"].update(quant)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def _load(folder):
    return load_model(EngineConfig(model=str(folder)), CPU)


def _logits(model) -> torch.Tensor:
    return PagedHarness(model).step([("s", TOKENS)])[0]


# ---- 1. ignore lists name checkpoint modules; graphserve fuses them -------------------------------------------------
@pytest.mark.parametrize("key,listed,kept", [
    ("modules_to_not_convert", [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")],
     ["model.layers.0.self_attn.qkv_proj"]),
    ("ignored_layers", [f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj")],
     ["model.layers.1.mlp.gate_up_proj"]),
    # last dotted parts name the module in every layer
    ("modules_to_not_convert", ["q_proj", "k_proj", "v_proj"],
     ["model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.qkv_proj"]),
    # a module above the parts names them all
    ("ignored_layers", ["model.layers.1.mlp"], ["model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj"]),
], ids=["qkv-full-names", "gate-up-full-names", "qkv-short-names", "parent-module"])  # fmt: skip
def test_a_fused_layer_whose_parts_are_all_listed_stays_in_the_model_dtype(sources, tmp_path, key, listed, kept):
    parts = {name: _checkpoint_modules(name) for name in kept}
    unquantized = ["." + module.removeprefix("model.") for modules in parts.values() for module in modules]
    folder = _fp8(sources["dense"], tmp_path / "fp8", unquantized=unquantized, quant={key: listed})
    model = _load(folder).model
    plain = load_file(str(sources["dense"] / "model.safetensors"))
    for name, modules in parts.items():
        layer = model.get_submodule(name)
        assert layer.quant_method is None and layer.weight.dtype == torch.float32, name
        # the checkpoint's fp32 tensors, as stored
        assert torch.equal(layer.weight, torch.cat([plain[f"{m}.weight"] for m in modules])), name
    # the layers not listed stay fp8
    assert model.get_submodule("model.layers.0.self_attn.o_proj").weight.dtype == FP8_DTYPE
    assert model.get_submodule("model.layers.0.mlp.down_proj").weight.dtype == FP8_DTYPE
    dequantized_checkpoint(folder, tmp_path / "deq")
    torch.testing.assert_close(_logits(model), _logits(_load(tmp_path / "deq").model), rtol=1e-5, atol=1e-5)


def _checkpoint_modules(layer: str) -> list[str]:
    """The checkpoint modules a dense layer of graphserve's holds."""
    prefix, _, leaf = layer.rpartition(".")
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    return [f"{prefix}.{part}" for part in fused.get(leaf, (leaf,))]


@pytest.mark.parametrize("listed,message", [
    ([f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj")],
     r"quantization_config\.modules_to_not_convert lists 'model\.layers\.0\.self_attn\.q_proj' and "
     r"'model\.layers\.0\.self_attn\.k_proj' but not 'model\.layers\.0\.self_attn\.v_proj', which graphserve fuses "
     r"with them into model\.layers\.0\.self_attn\.qkv_proj: list all of its parts"),
    (["up_proj"], r"lists 'up_proj' but not 'model\.layers\.0\.mlp\.gate_proj', which graphserve fuses with it into "
                  r"model\.layers\.0\.mlp\.gate_up_proj"),
], ids=["two-of-qkv", "up-of-gate-up"])  # fmt: skip
def test_a_fused_layer_listed_in_part_is_refused_naming_its_parts(sources, tmp_path, listed, message):
    folder = _fp8(sources["dense"], tmp_path / "fp8", quant={"modules_to_not_convert": listed})
    with pytest.raises(ModelLoadError, match=message) as e:
        _load(folder)
    assert e.value.param == "model"


def _expert_names(family: str, experts) -> list[str]:
    return [f"{EXPERT_PREFIX[family]}.{e}.{p}" for e in experts for p in EXPERT_PARTS[family]]


@pytest.mark.parametrize("family,listed", [
    ("qwen3-moe", ["model.layers.0.mlp.experts"]),
    ("qwen3-moe", _expert_names("qwen3-moe", range(6))),  # every part of every expert
    ("mixtral", ["model.layers.0.block_sparse_moe.experts"]),  # the family's own checkpoint name
], ids=["whole", "every-expert", "mixtral-whole"])  # fmt: skip
def test_routed_experts_listed_whole_stay_in_the_model_dtype(sources, tmp_path, family, listed):
    n = 6 if family == "qwen3-moe" else 4
    unquantized = ["." + name.removeprefix("model.") for name in _expert_names(family, range(n))]
    folder = _fp8(sources[family], tmp_path / "fp8", unquantized=unquantized, quant={"modules_to_not_convert": listed})
    model = _load(folder).model
    kept, other = model.model.layers[0].mlp.experts, model.model.layers[0].self_attn.qkv_proj
    assert kept.quant_method is None and kept.w13_weight.dtype == torch.float32
    assert other.weight.dtype == FP8_DTYPE
    plain = load_file(str(sources[family] / "model.safetensors"))
    down = plain[f"{EXPERT_PREFIX[family]}.2.{EXPERT_PARTS[family][2]}.weight"]
    assert torch.equal(kept.w2_weight[2], down)
    if family == "mixtral":  # its layer 1 experts are not listed: fp8
        assert model.model.layers[1].mlp.experts.w13_weight.dtype == FP8_DTYPE
    dequantized_checkpoint(folder, tmp_path / "deq")
    torch.testing.assert_close(_logits(model), _logits(_load(tmp_path / "deq").model), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,listed,named", [
    ("qwen3-moe", _expert_names("qwen3-moe", [3]), "'model.layers.0.mlp.experts.3.gate_proj', "
     "'model.layers.0.mlp.experts.3.up_proj', 'model.layers.0.mlp.experts.3.down_proj'"),
    ("qwen3-moe", ["experts.3.down_proj"], "'experts.3.down_proj'"),
    ("qwen3-moe", ["model.layers.0.mlp.experts.3"], "'model.layers.0.mlp.experts.3'"),  # one expert whole
    ("qwen3-moe", _expert_names("qwen3-moe", range(5)), "'model.layers.0.mlp.experts.0.gate_proj'"),  # 5 of 6
    ("mixtral", ["model.layers.0.block_sparse_moe.experts.1.w2"], "'model.layers.0.block_sparse_moe.experts.1.w2'"),
], ids=["one-expert-parts", "short-name", "one-expert-module", "five-of-six", "mixtral"])  # fmt: skip
def test_single_experts_listed_are_refused_by_name(sources, tmp_path, family, listed, named):
    folder = _fp8(sources[family], tmp_path / "fp8", quant={"ignored_layers": listed})
    with pytest.raises(ModelLoadError, match=rf"quantization_config\.ignored_layers lists {named}.* of the routed "
                                             r"experts model\.layers\.0\.mlp\.experts: keeping single experts "
                                             r"unquantized is not supported") as e:  # fmt: skip
        _load(folder)
    assert "list 'model.layers.0.mlp.experts' whole" in e.value.message


# ---- 2. both ignore keys are read, strictly ------------------------------------------------------------------------
def test_both_ignore_keys_are_read_as_one_list(sources, tmp_path):
    raw = {"quant_method": "fp8", "ignored_layers": ["lm_head"],
           "modules_to_not_convert": ["model.layers.0.self_attn.o_proj", "lm_head"]}
    config = parse_quantization_config(raw)
    assert config.ignored == ("lm_head", "model.layers.0.self_attn.o_proj")
    assert config.ignored_field == "quantization_config.ignored_layers / quantization_config.modules_to_not_convert"
    assert parse_quantization_config({"quant_method": "fp8", "modules_to_not_convert": None}).ignored == ()
    # and loading keeps what the second key lists
    folder = _fp8(sources["dense"], tmp_path / "fp8", unquantized=[".layers.0.self_attn.o_proj"], quant=raw)
    model = _load(folder).model
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == torch.float32
    assert model.model.layers[1].self_attn.o_proj.weight.dtype == FP8_DTYPE


@pytest.mark.parametrize("key", ["ignored_layers", "modules_to_not_convert"])
@pytest.mark.parametrize("value", ["model.layers.0.self_attn.o_proj", [None], ["lm_head", 3], {"lm_head": True}, 7])
def test_an_ignore_list_that_is_not_a_list_of_names_is_refused(key, value):
    with pytest.raises(ModelLoadError, match=rf"quantization_config\.{key}=.* is invalid: expected a list of module "
                                             r"names \(strings\)") as e:  # fmt: skip
        parse_quantization_config({"quant_method": "fp8", key: value})
    assert repr(value) in e.value.message


# ---- 3. scales must be finite and positive -------------------------------------------------------------------------
BAD_SCALES = {"nan": float("nan"), "inf": float("inf"), "zero": 0.0, "negative": -0.5}


@pytest.mark.parametrize("bad", list(BAD_SCALES))
@pytest.mark.parametrize("block,name", [
    ((32, 32), "model.layers.0.self_attn.o_proj.weight_scale_inv"),
    (None, "model.layers.1.self_attn.k_proj.weight_scale"),
    (None, "model.layers.0.mlp.up_proj.input_scale"),
], ids=["block", "channel", "input"])  # fmt: skip
def test_a_dense_scale_that_is_not_finite_and_positive_is_refused_naming_it(sources, tmp_path, block, name, bad):
    amax = None
    if name.endswith("input_scale"):
        names = [n for n in load_file(str(sources["dense"] / "model.safetensors")) if n.endswith("_proj.weight")]
        amax = {n.removesuffix(".weight"): 4.0 for n in names}

    def spoil(t):  # one value of the tensor, so the refusal points at it
        t[name] = t[name].clone()
        t[name].view(-1)[-1] = BAD_SCALES[bad]

    folder = _fp8(sources["dense"], tmp_path / "fp8", block=block, tensors=spoil, input_amax=amax)
    with pytest.raises(ModelLoadError, match=rf"checkpoint tensor '{name}' .*: 1 of \d+ scales are not finite "
                                             rf"and > 0 \(the first, at \(.*\), is {BAD_SCALES[bad]}\)"):  # fmt: skip
        _load(folder)


def test_an_expert_scale_of_zero_is_refused_naming_it(sources, tmp_path):
    name = "model.layers.0.mlp.experts.4.up_proj.weight_scale_inv"
    folder = _fp8(sources["qwen3-moe"], tmp_path / "fp8",
                  tensors=lambda t: t.__setitem__(name, torch.zeros_like(t[name])))
    # [32, 64] in 32x32 blocks: two scales
    with pytest.raises(ModelLoadError, match=rf"'{name}' .*: 2 of 2 scales are not finite and > 0 .* is 0\.0"):
        _load(folder)


def test_a_dequantized_at_load_scale_that_is_negative_is_refused_naming_it():
    kv_b = "model.layers.0.self_attn.kv_b_proj"
    stream = [(f"{kv_b}.weight", torch.ones(64, 32, dtype=FP8_DTYPE)), (f"{kv_b}.weight_scale_inv", -torch.ones(2, 1))]
    with pytest.raises(ModelLoadError, match=rf"'{kv_b}\.weight_scale_inv': 2 of 2 scales are not finite and > 0 "
                                             r"\(the first, at \(0, 0\), is -1\.0\)"):  # fmt: skip
        list(dequantize_at_load(iter(stream), DEQUANTIZED_AT_LOAD, Fp8Config(block=(32, 32))))


# ---- 4. block sizes the CUDA kernels take -------------------------------------------------------------------------
@pytest.mark.parametrize("block", [[128, 8], [8, 128], [96, 128], [True, True], [0, 128], [128.0, 128], [128]])
def test_a_block_size_the_kernels_cannot_take_is_refused(block):
    with pytest.raises(ModelLoadError, match=r"quantization_config\.weight_block_size=.* is invalid: two powers of "
                                             r"two >= 16, e\.g\. \[128, 128\]") as e:  # fmt: skip
        parse_quantization_config({"quant_method": "fp8", "weight_block_size": block})
    assert repr(block) in e.value.message


def test_the_smallest_block_the_kernels_take_is_accepted():
    assert parse_quantization_config({"quant_method": "fp8", "weight_block_size": [16, 16]}).block == (16, 16)


# ---- 5. the keys transformers writes, at their no-op values ---------------------------------------------------------
def test_a_config_written_by_transformers_loads(sources, tmp_path):
    written = json.loads(FineGrainedFP8Config(weight_block_size=(32, 32)).to_json_string())
    assert {"dequantize", "modules_to_convert", "scale_fmt"} <= set(written)
    folder = _fp8(sources["dense"], tmp_path / "fp8")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = written
    (folder / "config.json").write_text(json.dumps(config))
    model = _load(folder).model
    assert model.model.layers[0].self_attn.qkv_proj.weight_scale_inv.shape == (4, 2)  # [128/32, 64/32]


@pytest.mark.parametrize("key,value,accepted", [
    ("scale_fmt", "ue8m0", '"float"'),
    ("dequantize", True, "false"),
    ("dequantize", 0, "false"),
    ("modules_to_convert", ["model.layers.0.self_attn.o_proj"], "null"),
])  # fmt: skip
def test_a_transformers_key_that_changes_the_weights_is_refused(key, value, accepted):
    with pytest.raises(ModelLoadError, match=rf"quantization_config\.{key}=.* is not supported: graphserve accepts "
                                             rf"only {accepted}") as e:  # fmt: skip
        parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128], key: value})
    assert f"{key}={value!r}" in e.value.message


# ---- 6. scales graphserve does not load are named as such -----------------------------------------------------------
@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.k_scale", "model.layers.0.self_attn.v_scale",
                                  "model.layers.1.self_attn.kv_scale", "model.layers.0.self_attn.q_scale",
                                  "model.layers.0.self_attn.prob_scale"])
def test_kv_cache_scales_are_refused_as_such(sources, tmp_path, name):
    folder = _fp8(sources["dense"], tmp_path / "fp8", tensors=lambda t: t.__setitem__(name, torch.tensor(0.05)))
    with pytest.raises(ModelLoadError, match=rf"'{name}' is a KV-cache scale, which graphserve does not load .*: "
                                             r"graphserve loads an fp8 checkpoint's weight_scale_inv \(with "
                                             r"weight_block_size\), weight_scale .* and input_scale \(with "
                                             r"activation_scheme 'static'\)") as e:  # fmt: skip
        _load(folder)
    assert e.value.param == "model"


def test_an_input_scale_under_dynamic_activations_is_refused_as_such(sources, tmp_path):
    name = "model.layers.0.self_attn.o_proj.input_scale"
    folder = _fp8(sources["dense"], tmp_path / "fp8", block=None,
                  tensors=lambda t: t.__setitem__(name, torch.tensor(0.01)))
    with pytest.raises(ModelLoadError, match=rf"'{name}' is a static activation scale, but quantization_config\."
                                             r"activation_scheme='dynamic': input_scale needs activation_scheme "
                                             r"'static'"):  # fmt: skip
        _load(folder)


def test_a_scale_of_a_layer_kept_in_the_model_dtype_is_refused_as_such(sources, tmp_path):
    # o_proj is listed as kept, but the checkpoint still stores it in fp8 with its scale
    folder = _fp8(sources["dense"], tmp_path / "fp8", quant={"ignored_layers": ["o_proj"]})
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.\d\.self_attn\.o_proj\.weight_scale_inv' scales a "
                                             r"layer graphserve holds in the model dtype"):  # fmt: skip
        _load(folder)


def test_a_scale_of_the_other_layout_is_refused_as_such(sources, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight_scale"  # per channel, in a 32x32-block checkpoint
    folder = _fp8(sources["dense"], tmp_path / "fp8", tensors=lambda t: t.__setitem__(name, torch.ones(64)))
    with pytest.raises(ModelLoadError, match=rf"'{name}' is no scale of fp8 \(block 32x32, dynamic activations\): "
                                             r"graphserve loads an fp8 checkpoint's weight_scale_inv"):  # fmt: skip
        _load(folder)


# ---- 8. the plan counts the bytes the model holds -------------------------------------------------------------------
@pytest.mark.parametrize("preset,quantization,tp,ep", [
    ("llama3-8b", "fp8", 1, 1), ("llama3-8b", "fp8-block", 1, 1), ("llama3-8b", "fp8-channel", 1, 1),
    ("qwen3-30b-a3b", "fp8", 1, 1), ("qwen3-30b-a3b", "fp8-block", 1, 1),
    ("mixtral-8x7b", "fp8", 1, 1), ("mixtral-8x7b", "fp8-block", 1, 1),
    # deepseek-v2-lite's MLP (10944) is no multiple of 128, so fp8-block is refused at load; V3's q LoRA is blocked
    ("deepseek-v2-lite", "fp8", 1, 1), ("deepseek-v3-l4", "fp8-block", 1, 1),
    # a rank's share: its heads and MLP slices under --tp, whole experts under --ep
    ("llama3-8b", "fp8", 2, 1), ("qwen3-30b-a3b", "fp8", 2, 1), ("qwen3-30b-a3b", "fp8-block", 1, 2),
    ("deepseek-v2-lite", "fp8", 2, 1),
])  # fmt: skip
def test_the_description_counts_the_fp8_bytes_the_model_holds(monkeypatch, preset, quantization, tp, ep):
    """Built on the meta device, each rank as the loader builds it: parameters plus the scales quantized at load
    (buffers), counted to the byte, the per-channel scales by each projection's output rows."""
    world = max(tp, ep)
    for rank in range(world):
        monkeypatch.setattr(state, "_STATE", state.ParallelState(rank=rank, world_size=world, tp_size=tp, ep_size=ep))
        loaded = load_model(EngineConfig(model=f"dummy:{preset}", quantization=quantization, dtype="bfloat16"),
                            torch.device("meta"))
        assert loaded.info.description.weights_bytes == held_weight_bytes(loaded.model), rank
