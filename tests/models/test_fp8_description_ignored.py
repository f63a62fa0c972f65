"""An FP8 checkpoint's ignore list in the description: the projections and routed-expert layers it keeps in the
model dtype are priced at the model dtype's bytes with no scales, by the rule the loader quantizes by
(layers/quant/config.py IgnoreList), so the memory plan and the decode floors count the bytes the model holds.

Each description is held equal to the bytes of the model the loader builds with the same config (on the meta device
at the presets' sizes, loaded from a checkpoint on CPU at tiny ones), rank by rank; ``graphserve plan`` reads a
checkpoint folder's config.json to the same figure."""

from __future__ import annotations

import json
import types

import pytest
import torch
from model_utils import dummy_preset, held_weight_bytes, make_hf_checkpoints
from transformers import Qwen3Config, Qwen3MoeConfig

from graphserve.analysis import plan as plan_cmd
from graphserve.analysis.plan import build_plan, load_hf_config
from graphserve.config import EngineConfig
from graphserve.distributed import state
from graphserve.errors import ModelLoadError
from graphserve.kernels.fp8_quant import FP8_DTYPE
from graphserve.layers.linear import Linear
from graphserve.layers.moe import FusedMoE
from graphserve.layers.quant.config import (
    EXPERT_PARTS,
    MODEL_DTYPE_LAYERS,
    parse_quantization_config,
    quantized_description,
)
from graphserve.models import loader
from graphserve.models.fp8_checkpoint import quantize_checkpoint
from graphserve.models.loader import load_model
from graphserve.models.registry import describe_model, hf_config_object, ignore_list, resolve_model_class

BLOCK = {"quant_method": "fp8", "weight_block_size": [128, 128]}
CHANNEL = {"quant_method": "fp8"}
STATIC = {"quant_method": "fp8", "activation_scheme": "static"}
QKV0 = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]


def _load_meta(monkeypatch, model: str, raw_quant: dict, tp: int = 1, ep: int = 1, rank: int = 0):
    """``dummy:`` ``model`` built on the meta device by the loader as rank ``rank`` would, quantized as a checkpoint
    whose quantization_config is ``raw_quant`` (its ignore list included) would be."""
    world = max(tp, ep)
    monkeypatch.setattr(state, "_STATE", state.ParallelState(rank=rank, world_size=world, tp_size=tp, ep_size=ep))
    monkeypatch.setattr(loader, "online_config", lambda _: parse_quantization_config(raw_quant))
    return load_model(EngineConfig(model=model, dtype="bfloat16"), torch.device("meta"))


def _plan_description(model: str, raw_quant: dict, tp: int = 1, ep: int = 1):
    """What ``graphserve plan`` prices for a checkpoint of ``model``'s config with ``raw_quant``: the family's
    description through the config's ignore list."""
    hf = load_hf_config(model)
    quant = parse_quantization_config(raw_quant)
    return quantized_description(describe_model(hf, torch.bfloat16, tp, ep), quant, torch.bfloat16,
                                 ignore_list(hf, quant))


# ---- 1. at the presets' sizes, every rank: the description counts the bytes the meta model holds ---------------------
@pytest.mark.parametrize("preset,raw,ignored,tp,ep", [
    # a dense Llama: layer 0's q/k/v (all three parts of qkv_proj) and layer 1's MLP whole
    ("llama3-8b", BLOCK, [*QKV0, "model.layers.1.mlp"], 1, 1),
    ("llama3-8b", BLOCK, [*QKV0, "model.layers.1.mlp"], 2, 1),
    # per channel with static input scales: a kept projection holds neither
    ("llama3-8b", STATIC, [*QKV0, "model.layers.1.mlp"], 1, 1),
    # one MoE layer's experts and one attention whole
    ("qwen3-30b-a3b", BLOCK, ["model.layers.2.mlp.experts", "model.layers.5.self_attn"], 1, 1),
    ("qwen3-30b-a3b", BLOCK, ["model.layers.2.mlp.experts", "model.layers.5.self_attn"], 2, 1),
    ("qwen3-30b-a3b", BLOCK, ["model.layers.2.mlp.experts", "model.layers.5.self_attn"], 1, 2),
    # every layer's experts by their last parts: none fp8
    ("qwen3-30b-a3b", BLOCK, ["mlp.experts"], 1, 1),
    # the family's own checkpoint names (block_sparse_moe), per channel
    ("mixtral-8x7b", CHANNEL, ["model.layers.0.block_sparse_moe.experts", "model.layers.3.self_attn.o_proj"], 1, 1),
    # q_a_proj with kv_a_proj_with_mqa (fused_qkv_a_proj), a layer's shared experts and another's routed experts
    ("deepseek-v3-l4", BLOCK, ["model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa",
                               "model.layers.2.mlp.shared_experts", "model.layers.1.mlp.experts"], 1, 1),
])  # fmt: skip
def test_the_description_counts_the_bytes_an_ignore_list_keeps(monkeypatch, preset, raw, ignored, tp, ep):
    raw_quant = {**raw, "ignored_layers": ignored}
    for rank in range(max(tp, ep)):
        loaded = _load_meta(monkeypatch, f"dummy:{preset}", raw_quant, tp, ep, rank)
        held = held_weight_bytes(loaded.model)
        assert loaded.info.description.weights_bytes == held, rank
        assert _plan_description(f"dummy:{preset}", raw_quant, tp, ep).weights_bytes == held, rank
        # and more than the same model with nothing kept
        plain = _plan_description(f"dummy:{preset}", raw, tp, ep)
        assert plain.weights_bytes < held, rank


@pytest.mark.parametrize("preset", ["llama3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "qwen1.5-moe-a2.7b", "olmoe-1b-7b",
                                    "deepseek-v2-lite", "deepseek-v3-l4"])  # fmt: skip
def test_the_description_names_the_modules_an_ignore_list_is_matched_against(preset):
    """Every projection FP8 may quantize and every routed-expert layer, by the name the model's module carries."""
    hf = load_hf_config(f"dummy:{preset}")
    d = describe_model(hf, torch.bfloat16)
    config = hf_config_object(hf)
    with torch.device("meta"):
        model = resolve_model_class(hf["architectures"])(config, config.max_position_embeddings)
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, Linear) and not name.endswith(MODEL_DTYPE_LAYERS)}
    assert sorted(name for p in d.projections for name in p.names) == sorted(linears)
    for p in d.projections:
        for name in p.names:
            shards = linears[name].weight_shards("weight") if hasattr(linears[name], "weight_shards") else None
            assert p.shards == shards, name
    experts = [(name, m) for name, m in model.named_modules() if isinstance(m, FusedMoE)]
    assert list(d.expert_layers) == [name for name, _ in experts]
    # the expert parts an ignore list is matched by are those the layers load
    for _, m in experts:
        assert {part for w in ("w13_weight", "w2_weight") for _, part in m.weight_shards(w)} == set(EXPERT_PARTS)


# ---- 2. by hand at small sizes: what a kept layer adds to the weights and to a decode step ---------------------------
_SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              vocab_size=152064, max_position_embeddings=256)  # the presets' special tokens lie in the vocabulary


def _kept_minus_fp8(n: int, k: int) -> int:
    """What a [n, k] projection kept in bf16 holds beyond its fp8 self with 128x128 block scales: one byte a
    parameter, less its fp32 scales."""
    return n * k - 4 * -(-n // 128) * -(-k // 128)


def test_a_dense_model_reads_exactly_the_bytes_its_kept_projections_add(monkeypatch):
    model = dummy_preset(monkeypatch, "llama3-8b", "small-llama", num_hidden_layers=3, **_SMALL)
    kept = _plan_description(model, {**BLOCK, "ignored_layers": [*QKV0, "model.layers.1.mlp"]})
    fp8 = _plan_description(model, BLOCK)
    # layer 0's qkv_proj [4*64 + 2*2*64, 256], layer 1's gate_up_proj [2*512, 256] and down_proj [256, 512]
    added = _kept_minus_fp8(512, 256) + _kept_minus_fp8(1024, 256) + _kept_minus_fp8(256, 512)
    assert added == 524_160
    assert kept.weights_bytes - fp8.weights_bytes == added
    assert kept.decode_read_bytes(8, 4096) - fp8.decode_read_bytes(8, 4096) == added
    # the loader's description of the same config says so too
    loaded = _load_meta(monkeypatch, model, {**BLOCK, "ignored_layers": [*QKV0, "model.layers.1.mlp"]})
    assert loaded.info.description.decode_read_bytes(8, 4096) == kept.decode_read_bytes(8, 4096)
    assert loaded.info.description.weights_bytes == held_weight_bytes(loaded.model)


def test_a_moe_model_reads_its_kept_experts_at_the_model_dtype(monkeypatch):
    model = dummy_preset(monkeypatch, "qwen3-30b-a3b", "small-moe", num_hidden_layers=4, moe_intermediate_size=128,
                         num_experts=8, num_experts_per_tok=2, **_SMALL)
    raw = {**BLOCK, "ignored_layers": ["model.layers.1.mlp.experts", "model.layers.2.self_attn"]}
    kept, fp8 = _plan_description(model, raw), _plan_description(model, BLOCK)
    assert kept.kept_expert_layers == ("model.layers.1.mlp.experts",)
    # layer 2's qkv_proj [512, 256] and o_proj [256, 256]; one expert: gate and up [128, 256], down [256, 128]
    attention = _kept_minus_fp8(512, 256) + _kept_minus_fp8(256, 256)
    expert = 2 * _kept_minus_fp8(128, 256) + _kept_minus_fp8(256, 128)
    assert (attention, expert) == (196_560, 98_280)
    assert kept.weights_bytes - fp8.weights_bytes == attention + 8 * expert  # the layer holds all 8 experts
    # the floor: top_k = 2 experts read in each layer
    assert kept.decode_read_bytes(1, 100) - fp8.decode_read_bytes(1, 100) == attention + 2 * expert
    # counted per layer, the kept layer's experts at 2 bytes a parameter, the others' at 1 plus scales
    fp8_expert, bf16_expert = 3 * 256 * 128 + 4 * 6, 2 * 3 * 256 * 128
    assert kept.expert_bytes == fp8_expert
    touched = [3, 5, 1, 2]
    assert kept.decode_read_bytes(1, 100, touched) - kept.decode_read_bytes(1, 100, [0] * 4) == \
        6 * fp8_expert + 5 * bf16_expert
    # one sum over the layers cannot say which layer's experts it counts
    with pytest.raises(ValueError, match=r"experts_touched=11 sums the MoE layers, but 1 of the 4 keep their "
                                         r"experts in the model dtype: pass one count per MoE layer"):
        kept.decode_read_bytes(1, 100, 11)
    with pytest.raises(ValueError, match=r"experts_touched has 3 counts: expected one per MoE layer \(4\)"):
        kept.decode_read_bytes(1, 100, [1, 1, 1])
    # without kept layers a sum is exact, and equals the per-layer count
    assert fp8.decode_read_bytes(1, 100, 11) == fp8.decode_read_bytes(1, 100, touched)
    loaded = _load_meta(monkeypatch, model, raw)
    assert loaded.info.description.decode_read_bytes(1, 100, touched) == kept.decode_read_bytes(1, 100, touched)
    assert loaded.info.description.weights_bytes == held_weight_bytes(loaded.model)


def test_a_description_without_the_familys_names_refuses_an_ignore_list():
    hf = load_hf_config("dummy:llama3-8b")
    quant = parse_quantization_config({**BLOCK, "modules_to_not_convert": ["model.layers.0.mlp"]})
    with pytest.raises(ValueError, match=r"quantization_config\.modules_to_not_convert names modules kept in the "
                                         r"model dtype: pricing them needs the family's names \(IgnoreList\)"):
        quantized_description(describe_model(hf, torch.bfloat16), quant, torch.bfloat16)


# ---- 3. a checkpoint on disk: the loader and `graphserve plan` read its config.json alike ---------------------------
# every fused part a multiple of the 32-row test block on each of 2 ranks: q 4x32, k/v 2x32, MLPs 128 and 64
_TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, head_dim=32,
             intermediate_size=128, tie_word_embeddings=False)
CONFIGS = {
    "dense": lambda: Qwen3Config(**_TINY),
    # 4 experts 64 wide in layers 0 and 1, a dense MLP in layer 2
    "qwen3-moe": lambda: Qwen3MoeConfig(**_TINY, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                        norm_topk_prob=True, mlp_only_layers=[2]),
}
# checkpoint modules written unquantized (their last parts) and the ignore list naming them
KEPT = {
    "dense": ([".layers.0.self_attn.q_proj", ".layers.0.self_attn.k_proj", ".layers.0.self_attn.v_proj",
               ".layers.1.mlp.gate_proj", ".layers.1.mlp.up_proj", ".layers.1.mlp.down_proj"],
              [*QKV0, "model.layers.1.mlp"]),
    "qwen3-moe": ([f".layers.0.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
                  + [".layers.1.self_attn.q_proj", ".layers.1.self_attn.k_proj", ".layers.1.self_attn.v_proj",
                     ".layers.1.self_attn.o_proj"],
                  ["model.layers.0.mlp.experts", "model.layers.1.self_attn"]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    sources = make_hf_checkpoints(tmp_path_factory, CONFIGS, seed=5)
    folders = {}
    for family, (unquantized, listed) in KEPT.items():
        folder = folders[family] = tmp_path_factory.mktemp(f"{family}-fp8")
        quantize_checkpoint(sources[family], folder, block=(32, 32), unquantized=tuple(unquantized))
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"]["ignored_layers"] = listed
        (folder / "config.json").write_text(json.dumps(config))
    return folders


@pytest.mark.parametrize("family,tp,ep", [("dense", 1, 1), ("dense", 2, 1), ("qwen3-moe", 1, 1),
                                          ("qwen3-moe", 2, 1), ("qwen3-moe", 1, 2)])  # fmt: skip
def test_a_checkpoint_with_an_ignore_list_is_described_as_it_loads(monkeypatch, checkpoints, family, tp, ep):
    for rank in range(max(tp, ep)):
        monkeypatch.setattr(state, "_STATE", state.ParallelState(rank=rank, world_size=max(tp, ep), tp_size=tp,
                                                                 ep_size=ep))  # fmt: skip
        loaded = load_model(EngineConfig(model=str(checkpoints[family])), torch.device("cpu"))
        layer = loaded.model.model.layers[0]
        kept = layer.mlp.experts.w13_weight if family == "qwen3-moe" else layer.self_attn.qkv_proj.weight
        assert kept.dtype == torch.float32 and layer.self_attn.o_proj.weight.dtype == FP8_DTYPE
        d = loaded.info.description
        assert d.weights_bytes == held_weight_bytes(loaded.model), rank
        # `graphserve plan` on the folder: the same bytes per rank (fp32, the model dtype on CPU)
        monkeypatch.setattr(state, "_STATE", state.ParallelState())
        p = build_plan(load_hf_config(str(checkpoints[family])), gpu_memory_gb=1.0, tp=tp, dtype="fp32")
        if ep == 1:  # plan splits by --tp only
            assert p["weights_bytes"] == d.weights_bytes, rank


def test_plan_prints_the_weights_of_a_checkpoint_folder_with_an_ignore_list(capsys, checkpoints):
    args = types.SimpleNamespace(model=str(checkpoints["qwen3-moe"]), gpu_memory_gb=1.0, tp=1,
                                 mem_fraction_static=0.88, cuda_graph_max_bs=8, cuda_graph_bs=None,
                                 disable_cuda_graph=False, max_running_requests=None, input_len=16, output_len=16,
                                 dtype="fp32", concurrency="1", max_model_len=128, chunked_prefill_size=64,
                                 block_size=16, reserve_gb=0.0, oversize="split", quantization="none",
                                 kv_cache_dtype="auto", json=True)  # fmt: skip
    assert plan_cmd.run(args) == 0
    data = json.loads(capsys.readouterr().out)
    loaded = load_model(EngineConfig(model=str(checkpoints["qwen3-moe"])), torch.device("cpu"))
    assert data["weights_bytes"] == held_weight_bytes(loaded.model)
    assert data["quantization"] == "fp8 (block 32x32, dynamic activations)"


def test_plan_refuses_a_fused_layer_listed_in_part_as_the_loader_does(tmp_path):
    hf = {**load_hf_config("dummy:llama3-8b"), "quantization_config": {**BLOCK, "ignored_layers": QKV0[:2]}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ModelLoadError, match=r"quantization_config\.ignored_layers lists "
                                             r"'model\.layers\.0\.self_attn\.q_proj' and "
                                             r"'model\.layers\.0\.self_attn\.k_proj' but not "
                                             r"'model\.layers\.0\.self_attn\.v_proj'") as e:  # fmt: skip
        build_plan(load_hf_config(str(tmp_path)), gpu_memory_gb=141.0)
    assert e.value.param == "model"
