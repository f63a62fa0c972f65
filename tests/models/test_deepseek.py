"""DeepSeek-V2/V3 match transformers logit for logit (CPU, float32) on a paged latent cache."""

from __future__ import annotations

import pytest
import torch
from model_utils import bias_routers, check_paged_parity, make_hf_checkpoint
from transformers import DeepseekV2Config, DeepseekV3Config

from graphserve import LLM, SamplingParams
from graphserve.config import EngineConfig
from graphserve.errors import ModelLoadError
from graphserve.layers.attention import TorchAttentionBackend
from graphserve.layers.forward_batch import contiguous_batch
from graphserve.layers.moe import SoftmaxTopK
from graphserve.models.loader import load_model
from graphserve.models.registry import describe_model

TOL = 1e-4
_TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
             max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

VARIANTS = {
    # V2-Lite's shape of things: no q LoRA, greedy softmax routing, YaRN with mscale on the softmax scale
    "v2-greedy-yarn": lambda: DeepseekV2Config(**_TINY, q_lora_rank=None, topk_method="greedy",
                                               routed_scaling_factor=1.0, rope_scaling=_YARN),
    # greedy with a scaling factor, which scales the routed output (folded into the shared experts' add)
    "v2-greedy-scaled": lambda: DeepseekV2Config(**{**_TINY, "first_k_dense_replace": 0},
                                                 q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.7,
                                                 rope_theta=10000.0),
    "v2-group-limited": lambda: DeepseekV2Config(**{**_TINY, "n_shared_experts": 2}, q_lora_rank=24,
                                                 topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                 routed_scaling_factor=16.0, rope_theta=10000.0),
    # V3: q LoRA, sigmoid + correction bias over groups, renormalised and scaled; interleaved rope
    "v3-noaux": lambda: DeepseekV3Config(**_TINY, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                         routed_scaling_factor=2.5, rope_interleave=True,
                                         rope_scaling={**_YARN, "mscale": 1.0, "mscale_all_dim": 0.8}),
    "v3-rotate-half": lambda: DeepseekV3Config(**{**_TINY, "first_k_dense_replace": 0}, q_lora_rank=24, n_group=2,
                                               topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.5,
                                               rope_interleave=False, rope_theta=10000.0),
}


def _checkpoint(folder, name):
    return bias_routers(make_hf_checkpoint(folder, VARIANTS[name]()), folder)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = _checkpoint(folder, request.param)
    loaded = load_model(EngineConfig(model=str(folder), dtype="float32", max_model_len=128), torch.device("cpu"))
    return request.param, hf, loaded


def test_prefill_chunked_and_decode_match_transformers(variant):
    name, hf, loaded = variant
    check_paged_parity(loaded.model, hf, name, TOL)


def test_padded_decode_rows_route_nowhere_and_leave_the_batch_unchanged(variant):
    """A CUDA-graph-padded decode batch gives its real row count as a device scalar; the model builds the
    experts' row mask from it once per step: real rows come out as without padding, padding rows reach no
    expert, and the caller's batch still holds the count (the graph runner refills it every replay)."""
    name, _, loaded = variant
    model = loaded.model
    kv = loaded.info.kv.allocate(16, 16, torch.device("cpu"), fill="random")
    batch = contiguous_batch([1, 1, 1, 1], [9, 20, 5, 30], kv, TorchAttentionBackend(), vocab_size=320)
    layers = model.moe_layers()
    top_k = layers[0].top_k
    with torch.no_grad():
        full = model(batch.input_ids, batch.positions, batch)
        assert all(int(m.expert_counts.sum()) == 4 * top_k for m in layers)
        batch.num_valid_tokens = count = torch.tensor(3)
        padded = model(batch.input_ids, batch.positions, batch)
    assert batch.num_valid_tokens is count
    torch.testing.assert_close(padded[:3], full[:3], rtol=0, atol=0, msg=name)
    assert all(int(m.expert_counts.sum()) == 3 * top_k for m in layers)


def test_greedy_routing_takes_the_fused_gate_router_and_scales_the_output(variant):
    """Greedy V2 routing is the plain softmax top-k the fused gate kernel computes (it decides the fusion by
    the router's type), its scaling factor left to the routed output; the grouped modes keep their own."""
    name, hf, loaded = variant
    blocks = [layer.mlp for layer in loaded.model.model.layers if layer.is_moe]
    greedy = name.startswith("v2-greedy")
    assert blocks and all(isinstance(b.experts.router, SoftmaxTopK) == greedy for b in blocks)
    assert all(not b.experts.router.renormalize for b in blocks if greedy)
    scale = hf.config.routed_scaling_factor if greedy else 1.0
    assert all(b.routed_scale == scale for b in blocks)


def test_description_counts_the_latent_cache_and_every_parameter(variant):
    name, hf, loaded = variant
    cfg, d = hf.config, loaded.info.description
    assert d.kv.kind == "latent" and d.kv.num_heads == 1 and d.kv.head_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert d.kv.bytes_per_token == cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    hf_params = sum(p.numel() for p in hf.parameters())
    hf_params += sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert d.num_params == hf_params == sum(p.numel() for p in loaded.model.parameters())
    moe = sum(i >= cfg.first_k_dense_replace for i in range(cfg.num_hidden_layers))
    assert d.num_moe_layers == moe and d.num_experts == cfg.n_routed_experts


def test_v2_lite_preset_cache_is_nine_times_smaller_than_expanded_heads():
    from graphserve.models.presets import get_preset_config

    d = describe_model(get_preset_config("deepseek-v2-lite"), torch.bfloat16)
    assert d.kv.bytes_per_token == 27 * 576 * 2
    expanded = 27 * 16 * (192 + 128) * 2  # K (nope + rope) and V per head
    assert expanded / d.kv.bytes_per_token > 8.8
    v3 = describe_model(get_preset_config("deepseek-v3-l4"), torch.bfloat16)
    assert v3.kv.bytes_per_token == 4 * 576 * 2 and v3.num_moe_layers == 3 and v3.top_k == 8


@pytest.mark.parametrize(("field", "value", "cls"), [
    ("topk_method", "noaux_tc", DeepseekV2Config), ("scoring_func", "sigmoid", DeepseekV2Config),
    ("topk_method", "group_limited_greedy", DeepseekV3Config), ("norm_topk_prob", True, DeepseekV2Config),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, DeepseekV3Config),
    ("hidden_act", "gelu", DeepseekV3Config),
])  # fmt: skip
def test_unimplemented_config_values_are_refused_by_name(field, value, cls):
    cfg = cls(**_TINY, q_lora_rank=24, n_group=4, topk_group=2, architectures=[cls.__name__[:-6] + "ForCausalLM"])
    setattr(cfg, field, value)
    if field == "rope_scaling":
        cfg.rope_parameters = {**value, "rope_theta": 10000.0}
    with pytest.raises(ModelLoadError, match=field if field != "rope_scaling" else "rope_type"):
        describe_model(cfg, torch.float32)


def test_greedy_matches_transformers_generate_under_continuous_batching(tmp_path):
    hf = _checkpoint(tmp_path, "v3-noaux")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 320, (n,), generator=gen).tolist() for n in (3, 11, 26)]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              pad_token_id=0)
        expected.append(out[0, len(ids):].tolist())
    llm = LLM(str(tmp_path), block_size=4, chunked_prefill_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for got, want in zip(outs, expected):
        assert got.token_ids == want
    # a prompt sharing the 26-token prompt's first 24 tokens: its first 6 latent blocks come from the prefix cache
    shared = prompts[2][:24] + [7, 8, 9]
    with torch.no_grad():
        want = hf.generate(torch.tensor([shared]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                           pad_token_id=0)[0, len(shared):].tolist()
    manager = llm.engine.core.block_manager
    hits = manager.hit_tokens
    assert llm.generate([{"prompt_token_ids": shared}], params, use_tqdm=False)[0].token_ids == want
    assert manager.hit_tokens - hits == 24
    manager.check_no_leak()


def test_moe_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    """As DeepSeek's own modeling code counts them (transformers ignores moe_layer_freq, so there is
    no parity check for freq > 1): MoE from layer first_k_dense_replace on, every freq-th layer."""
    from graphserve.models.deepseek_shape import shape_from_config

    cfg = DeepseekV2Config(**{**_TINY, "num_hidden_layers": 7, "first_k_dense_replace": 2}, q_lora_rank=None,
                           moe_layer_freq=2)
    assert shape_from_config(cfg, 2).moe_layers == {2, 4, 6}
    cfg.n_routed_experts = 0  # no routed experts: every layer dense
    assert shape_from_config(cfg, 2).moe_layers == set()


def test_synthetic_batches_read_the_latent_cache_shape():
    """Start-up profiling and the benchmarks build batches on consecutive blocks of whatever cache the
    layout allocated; a latent cache is [blocks, block_size, 1, dim], not the K/V [2, blocks, ...]."""
    from graphserve.layers.forward_batch import contiguous_batch
    from graphserve.layers.kv_layout import KVLayout

    caches = KVLayout("latent", 2, 1, 40, torch.float32).allocate(9, 4, "cpu")
    batch = contiguous_batch([1, 5], [6, 5], caches, None, vocab_size=320)
    assert batch.block_tables.tolist() == [[1, 2], [3, 4]]
    assert batch.slot_mapping.tolist() == [9, 12, 13, 14, 15, 16]
    with pytest.raises(ValueError, match="pool has 9"):
        contiguous_batch([1], [40], caches, None, vocab_size=320)


@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "deepseek-v3-l4"])
def test_the_expert_tuner_knows_the_presets_expert_shapes(preset):
    """benchmarks.moe_tune --model dummy:PRESET tunes the table the preset's routed experts look up."""
    from benchmarks.moe_tune import SHAPES
    from graphserve.models.presets import get_preset_config

    cfg = get_preset_config(preset)
    expected = (cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"])
    assert SHAPES[preset] == expected
