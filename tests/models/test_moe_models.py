"""The mixture-of-experts families match Hugging Face transformers (CPU, float32): logits on prefill,
a chunked prefix and decode steps, greedy tokens under continuous batching, and bad checkpoints
refused with the field named."""

from __future__ import annotations

import json

import pytest
import torch
from model_utils import check_paged_parity, engine_greedy, hf_greedy, make_hf_checkpoint, random_prompts
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from graphserve import LLM
from graphserve.config import EngineConfig
from graphserve.errors import ModelLoadError
from graphserve.layers.attention import TorchAttentionBackend
from graphserve.layers.forward_batch import contiguous_batch
from graphserve.models.loader import load_model
from graphserve.models.moe import MoEForCausalLM
from graphserve.models.registry import describe_model

TOL = 1e-4
_TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)

VARIANTS = {
    # layer 1 dense (mlp_only_layers), top-2 of 6 renormalised
    "qwen3-moe": lambda: Qwen3MoeConfig(**_TINY, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                                        num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                                        mlp_only_layers=[1], rope_theta=1000000.0),
    "mixtral": lambda: MixtralConfig(**_TINY, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                     rope_theta=1000000.0),
    "olmoe": lambda: OlmoeConfig(**_TINY, intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                                 norm_topk_prob=False, clip_qkv=2.5, rope_theta=10000.0),
    # every second layer sparse, a shared expert behind its sigmoid gate, top-k not renormalised
    "qwen2-moe": lambda: Qwen2MoeConfig(**_TINY, intermediate_size=96, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=48, num_experts=5, num_experts_per_tok=2,
                                        norm_topk_prob=False, decoder_sparse_step=2, rope_theta=1000000.0),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(folder, VARIANTS[request.param](), max_shard_size="40KB")  # sharded safetensors
    loaded = load_model(EngineConfig(model=str(folder), dtype="float32", max_model_len=256), torch.device("cpu"))
    return request.param, hf, loaded, folder


def test_prefill_chunked_prefix_and_decode_match_transformers(variant):
    name, hf, loaded, _ = variant
    assert isinstance(loaded.model, MoEForCausalLM)
    check_paged_parity(loaded.model, hf, name, TOL)


def test_description_counts_the_checkpoint(variant):
    name, hf, loaded, _ = variant
    d = loaded.info.description
    assert d.num_params == sum(p.numel() for p in hf.parameters()), name
    assert loaded.info.num_params == d.num_params
    assert d.is_moe and d.num_experts == loaded.model.moe_layers()[0].num_experts
    assert d.num_moe_layers == len(loaded.model.moe_layers())
    assert d.kv.bytes_per_token == 2 * 3 * 2 * loaded.info.head_dim * 4
    # a step that touches every expert reads more than one that touches the fewest
    assert d.decode_read_bytes(8, 100, experts_touched=d.num_moe_layers * d.num_experts) > d.decode_read_bytes(8, 100)


def test_greedy_matches_transformers_generate_under_continuous_batching(variant):
    name, hf, _, folder = variant
    prompts = random_prompts((3, 11, 26))
    new_tokens = 12
    expected = [hf_greedy(hf, ids, new_tokens) for ids in prompts]
    llm = LLM(str(folder), block_size=4, chunked_prefill_size=16)
    assert engine_greedy(llm, prompts, new_tokens) == expected, name
    llm.engine.core.block_manager.check_no_leak()
    # every step's record carries its routing: k pairs per token in each MoE layer
    moe = llm.engine.core.runner.expert_probe.layers
    k, experts = moe[0].top_k, moe[0].num_experts
    for rec in llm.engine.core.telemetry.records():
        assert rec.layer_routed_pairs == [rec.num_tokens * k] * len(moe), name
        assert len(rec.layer_max_expert_load) == len(moe)
        assert len(moe) * k <= rec.experts_touched <= len(moe) * experts
        assert -(-rec.num_tokens * k // experts) <= rec.max_expert_load <= rec.num_tokens


def _rewrite(folder, edit_config=None, edit_tensors=None):
    if edit_config:
        cfg = json.loads((folder / "config.json").read_text())
        edit_config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        for f in folder.glob("*.safetensors"):
            tensors = load_file(f)
            edit_tensors(tensors)
            save_file(tensors, f, metadata={"format": "pt"})


@pytest.fixture()
def mixtral_folder(tmp_path):
    make_hf_checkpoint(tmp_path, VARIANTS["mixtral"]())
    return tmp_path


def _load(folder):
    return load_model(EngineConfig(model=str(folder), dtype="float32", max_model_len=64), torch.device("cpu"))


def test_expert_count_disagreeing_with_config_is_refused(mixtral_folder):
    _rewrite(mixtral_folder, edit_config=lambda c: c.update(num_local_experts=3))
    with pytest.raises(ModelLoadError, match="expert index 3 is out of range for num_experts=3"):
        _load(mixtral_folder)


def test_missing_expert_is_refused(mixtral_folder):
    def drop(t):
        for k in [k for k in t if ".experts.2.w2." in k]:
            del t[k]
    _rewrite(mixtral_folder, edit_tensors=drop)
    with pytest.raises(ModelLoadError, match=r"lacks \d+ tensors.*w2_weight#\(2, 'w2'\)"):
        _load(mixtral_folder)


def test_expert_shape_disagreeing_with_config_is_refused(mixtral_folder):
    def shrink(t):
        for k in [k for k in t if ".experts.1.w1." in k]:
            t[k] = t[k][:-1].contiguous()
    _rewrite(mixtral_folder, edit_tensors=shrink)
    with pytest.raises(ModelLoadError, match=r"expert 1 w1: checkpoint shape \(47, 64\).*\(48, 64\)"):
        _load(mixtral_folder)


def test_top_k_above_expert_count_is_refused():
    cfg = VARIANTS["mixtral"]().to_dict() | {"architectures": ["MixtralForCausalLM"], "num_experts_per_tok": 5}
    with pytest.raises(ModelLoadError, match="num_experts_per_tok=5"):
        describe_model(cfg, torch.float32)


def test_unsupported_scoring_func_is_refused_by_name():
    cfg = VARIANTS["qwen3-moe"]().to_dict() | {"architectures": ["Qwen3MoeForCausalLM"], "scoring_func": "sigmoid"}
    with pytest.raises(ModelLoadError, match="scoring_func='sigmoid'"):
        describe_model(cfg, torch.float32)


@pytest.mark.parametrize("preset, params_b", [("qwen3-30b-a3b", 30.53), ("mixtral-8x7b", 46.70),
                                              ("olmoe-1b-7b", 6.92), ("qwen1.5-moe-a2.7b", 14.32)])
def test_presets_have_the_published_parameter_counts(preset, params_b):
    from graphserve.models.presets import get_preset_config

    d = describe_model(get_preset_config(preset), torch.bfloat16)
    assert abs(d.num_params / 1e9 - params_b) < 0.01
    # expert parallelism keeps a share of the experts on each rank; the dense part is replicated
    ep2 = describe_model(get_preset_config(preset), torch.bfloat16, ep=2)
    assert ep2.local_experts * 2 == d.local_experts and ep2.dense_params == d.dense_params


def test_uniform_routing_is_for_dummy_moe_models_only():
    from graphserve.errors import ConfigError
    from graphserve.layers.moe import FusedMoE

    with pytest.raises(ConfigError, match="moe-routing=uniform is for dummy: models only"):
        EngineConfig(model="builtin:tiny-llama", moe_routing="uniform")
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model; dummy:llama3-8b is dense"):
        load_model(EngineConfig(model="dummy:llama3-8b", moe_routing="uniform"), torch.device("meta"))
    loaded = load_model(EngineConfig(model="dummy:olmoe-1b-7b", moe_routing="uniform"), torch.device("meta"))
    layers = [m for m in loaded.model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 16 and all(m.routing_override == "uniform" for m in layers)


def test_materializing_zeroes_the_fused_gate_counters(variant):
    """The loader allocates with to_empty (garbage buffers); the gate kernels' done-counters must start at 0."""
    _, _, loaded, _ = variant
    layers = loaded.model.moe_layers()
    for layer in layers:
        layer.gate_counters.fill_(5)
    loaded.model.finish_materialize(torch.device("cpu"))
    assert layers and all(not layer.gate_counters.any() for layer in layers)


def test_padded_decode_rows_route_nowhere_and_leave_the_batch_unchanged(variant):
    """A CUDA-graph-padded decode batch gives its real row count as a device scalar; the model builds the
    experts' row mask from it once per step: real rows come out as without padding, padding rows reach no
    expert, and the caller's batch still holds the count (the graph runner refills it every replay)."""
    name, _, loaded, _ = variant
    model = loaded.model
    kv = loaded.info.kv.allocate(16, 16, torch.device("cpu"), fill="random")
    batch = contiguous_batch([1, 1, 1, 1], [9, 20, 5, 30], kv, TorchAttentionBackend(), vocab_size=320)
    top_k = model.moe_layers()[0].top_k
    with torch.no_grad():
        full = model(batch.input_ids, batch.positions, batch)
        assert all(int(m.expert_counts.sum()) == 4 * top_k for m in model.moe_layers())
        batch.num_valid_tokens = count = torch.tensor(3)
        padded = model(batch.input_ids, batch.positions, batch)
    assert batch.num_valid_tokens is count
    torch.testing.assert_close(padded[:3], full[:3], rtol=0, atol=0, msg=name)
    assert all(int(m.expert_counts.sum()) == 3 * top_k for m in model.moe_layers())


def test_each_routed_block_reads_the_next_layers_qkv_next(variant):
    """The slot sum's L2 link (kernels/l2_prefetch.py): each MoE layer's experts name the following layer's qkv
    projection, the last names nothing, and the link holds the loaded module (its current weight), not a copy."""
    _, _, loaded, _ = variant
    layers = loaded.model.model.layers
    linked = 0
    for i, layer in enumerate(layers):
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is None or not hasattr(experts, "read_next"):
            continue
        if i + 1 < len(layers):
            assert experts.read_next == (layers[i + 1].self_attn.qkv_proj,)
            assert experts.read_next[0].weight is layers[i + 1].self_attn.qkv_proj.weight
            linked += 1
        else:
            assert experts.read_next == ()
    assert linked >= 1
    # the link is no submodule: the module tree and the state dict are as before
    assert not any(".read_next" in name for name, _ in loaded.model.named_modules())
