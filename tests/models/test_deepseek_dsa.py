"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) matches transformers logit for logit (CPU, float32) on a paged
latent + indexer key cache, with contexts longer than index_topk so the indexer really drops positions."""

from __future__ import annotations

import pytest
import torch
from model_utils import (
    bias_routers,
    check_paged_parity,
    engine_greedy,
    hf_greedy,
    make_hf_checkpoint,
    random_prompts,
    relative_error,
)
from transformers import DeepseekV32Config, GlmMoeDsaConfig

from graphserve import LLM
from graphserve.config import EngineConfig
from graphserve.errors import ConfigError, ModelLoadError
from graphserve.models.loader import load_model
from graphserve.models.registry import describe_model

TOL = 1e-4
TOPK = 8
_TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
             norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=256, rms_norm_eps=1e-6,
             index_n_heads=8, index_head_dim=16, index_topk=TOPK, bos_token_id=0, eos_token_id=1)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}

VARIANTS = {
    # an indexer in every layer, rope in two halves; YaRN's attention factor reaches the indexer's rope too
    "v32": lambda: DeepseekV32Config(**_TINY, num_hidden_layers=3, first_k_dense_replace=1, rope_parameters=_YARN),
    # interleaved indexer rope; "shared" layers (one after a full layer, two in a row) and dense/MoE interleaved
    "glm5": lambda: GlmMoeDsaConfig(**_TINY, num_hidden_layers=5,
                                    indexer_types=["full", "shared", "full", "shared", "shared"],
                                    mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse"]),
}


def _checkpoint(folder, name):
    return bias_routers(make_hf_checkpoint(folder, VARIANTS[name]()), folder)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = _checkpoint(folder, request.param)
    loaded = load_model(EngineConfig(model=str(folder), dtype="float32", max_model_len=128, block_size=4),
                        torch.device("cpu"))
    return request.param, hf, loaded, folder


def test_prefill_chunked_and_decode_match_transformers(variant, monkeypatch):
    """A 11-token prefill, then a batch of two whole prompts (7 and 12 tokens) with the last 8 of a 19-token one
    on its cached prefix, then decode steps: every logit row within 1e-4 of transformers' uncached forward. The
    prefills score their rows in slices of 5 (the decode steps' 3 rows in one call)."""
    from graphserve.layers import dsa_indexer

    monkeypatch.setattr(dsa_indexer, "INDEXER_ROWS", 5)
    name, hf, loaded, _ = variant
    check_paged_parity(loaded.model, hf, name, TOL)


def test_layers_follow_indexer_and_mlp_types(variant):
    name, hf, loaded, _ = variant
    cfg, layers = hf.config, loaded.model.model.layers
    types = getattr(cfg, "indexer_types", None) if name == "glm5" else ["full"] * cfg.num_hidden_layers
    assert [layer.self_attn.indexer is not None for layer in layers] == [t == "full" for t in types]
    assert [layer.is_moe for layer in layers] == [t == "sparse" for t in cfg.mlp_layer_types]
    assert all(layer.self_attn.indexer.interleaved == (name == "glm5") for layer in layers
               if layer.self_attn.indexer is not None)


def test_description_counts_the_indexer_cache_and_every_parameter(variant):
    name, hf, loaded, _ = variant
    cfg, d = hf.config, loaded.info.description
    full = sum(t == "full" for t in getattr(cfg, "indexer_types", None) or ["full"] * cfg.num_hidden_layers) \
        if name == "glm5" else cfg.num_hidden_layers
    latent = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert d.kv.index_layers == full and d.kv.index_head_dim == cfg.index_head_dim
    assert d.kv.index_bytes_per_token == full * cfg.index_head_dim * 4
    assert d.kv.bytes_per_token == latent + full * cfg.index_head_dim * 4
    hf_params = sum(p.numel() for p in hf.parameters())
    hf_params += sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert d.num_params == hf_params == sum(p.numel() for p in loaded.model.parameters())
    # the pool allocates the latents, then one key cache per indexer layer, on the same blocks
    caches = d.kv.allocate(5, 4, "cpu")
    assert len(caches) == cfg.num_hidden_layers + full
    assert all(c.shape == (5, 4, cfg.index_head_dim) for c in caches[cfg.num_hidden_layers:])


def test_greedy_matches_transformers_generate_under_continuous_batching(variant):
    """Prompts of 9, 23 and 37 tokens (chunked by 16) batched together, 12 greedy tokens each; then a prompt that
    shares the 37-token one's first 32 tokens takes its latent and index blocks from the prefix cache."""
    name, hf, _, folder = variant
    prompts = random_prompts((9, 23, 37))
    llm = LLM(str(folder), block_size=4, chunked_prefill_size=16, dtype="float32")
    assert engine_greedy(llm, prompts, 12) == [hf_greedy(hf, p, 12) for p in prompts], name
    shared = prompts[2][:32] + [7, 8, 9]
    manager = llm.engine.core.block_manager
    hits = manager.hit_tokens
    assert engine_greedy(llm, [shared], 12) == [hf_greedy(hf, shared, 12)]
    assert manager.hit_tokens - hits == 32
    manager.check_no_leak()


@pytest.mark.parametrize(("field", "value", "match"), [
    ("indexer_types", ["full", "sparse", "full"], "indexer_types='sparse'"),
    ("indexer_types", ["shared", "full", "full"], r"indexer_types\[0\]='shared'"),
    ("mlp_layer_types", ["dense", "moe", "dense"], "mlp_layer_types="),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "rope_type='dynamic'"),
    ("index_head_dim", 4, "index_head_dim=4"),
])  # fmt: skip
def test_unbuilt_config_values_are_refused_by_name(field, value, match):
    cfg = GlmMoeDsaConfig(**_TINY, num_hidden_layers=3, architectures=["GlmMoeDsaForCausalLM"])
    setattr(cfg, field, value)
    with pytest.raises(ModelLoadError, match=match):
        describe_model(cfg, torch.float32)


def test_an_unbuilt_block_size_is_refused_at_load():
    with pytest.raises(ConfigError, match="--block-size=128") as e:
        load_model(EngineConfig(model="dummy:deepseek-v3.2-l4", block_size=128), torch.device("meta"))
    assert e.value.param == "block_size"


@pytest.mark.parametrize(("preset", "layers", "indexers", "heads", "moe"), [
    ("glm-5-l5", 5, 5, 32, 2), ("deepseek-v3.2-l4", 4, 4, 64, 3),
])  # fmt: skip
def test_presets_count_their_indexer_keys(preset, layers, indexers, heads, moe):
    from graphserve.models.presets import get_preset_config

    cfg = get_preset_config(preset)
    d = describe_model(cfg, torch.bfloat16)
    assert d.kv.bytes_per_token == layers * 576 * 2 + indexers * 128 * 2
    assert d.kv.index_bytes_per_token == indexers * 256 and d.num_moe_layers == moe
    assert cfg["index_n_heads"] == heads and cfg["index_topk"] == 2048


def test_plan_sizes_the_pool_with_the_indexer_keys_and_names_them():
    """`graphserve plan` and the start-up budget table divide the KV pool by the latent and the indexer keys; with
    --kv-cache-dtype fp8_e4m3 the latent halves and each indexer key takes 128 e4m3 bytes and a 4-byte scale."""
    from graphserve.analysis.plan import build_plan, format_plan, load_hf_config

    hf = load_hf_config("dummy:glm-5-l5")
    p = build_plan(hf, gpu_memory_gb=141, cuda_graph_max_bs=8, block_size=64)
    m = p["memory"]
    assert p["kv_bytes_per_token"] == 5 * 576 * 2 + 5 * 128 * 2 and p["kv_index_bytes_per_token"] == 5 * 128 * 2
    assert m["kv_tokens"] == m["kv_pool_bytes"] // p["kv_bytes_per_token"] // 64 * 64
    assert "indexer keys        1280 B/token" in p["table"] and "latent              5760 B/token" in p["table"]
    assert "indexer keys 1280 B of it" in format_plan(p)
    # a 2048-token chunk's indexer at the 202,752-token context: 256 rows at a time, fp32 scores and int64 keys
    scores = 256 * 202752 * 12
    assert dict(m["activation_parts"])["indexer scores"] == scores
    assert p["prefill_activation_bytes"] >= scores and "indexer scores" in p["table"]
    fp8 = build_plan(hf, gpu_memory_gb=141, cuda_graph_max_bs=8, block_size=64, kv_cache_dtype_name="fp8_e4m3")
    assert fp8["kv_bytes_per_token"] == 5 * 576 + 5 * 132  # e4m3 latents; index keys in the 132-byte FP8 form


def test_decode_floor_reads_every_indexer_key_and_at_most_topk_latents():
    from graphserve.models.presets import get_preset_config

    d = describe_model(get_preset_config("glm-5-l5"), torch.bfloat16)
    fixed = d.decode_read_bytes(2, 0)
    latent, keys = 5 * 576 * 2, 5 * 128 * 2
    assert d.attn_topk == 2048
    assert d.decode_read_bytes(2, 2 * 1000) - fixed == 2 * 1000 * (latent + keys)  # short contexts: all of it
    assert d.decode_read_bytes(2, 2 * 8000) - fixed == 2 * (8000 * keys + 2048 * latent)
    assert d.decode_read_bytes(2, [1000, 15000]) - fixed == 16000 * keys + (1000 + 2048) * latent


def test_profile_names_the_indexer_and_top_k_time(monkeypatch):
    """`graphserve profile` on a sparse-attention model: the indexer's scores and key writes, the top-k and the
    sparse MLA each land in their own category, and the DSA functions are unwrapped afterwards."""
    from model_utils import dummy_preset

    from graphserve.analysis.profile import profile_in_process
    from graphserve.engine.core import EngineCore
    from graphserve.kernels import dsa_reference

    tiny = {k: v for k, v in _TINY.items() if k not in ("bos_token_id", "eos_token_id")}
    name = dummy_preset(monkeypatch, "glm-5-l5", "glm-5-tiny", **tiny, num_hidden_layers=3,
                        mlp_layer_types=["dense", "sparse", "sparse"], indexer_types=["full", "shared", "full"])
    core = EngineCore(EngineConfig(model=name, dtype="float32", max_model_len=128, num_kv_tokens=1024))
    prof = profile_in_process(core, 2, 3, 24)
    cats = prof["phases"][0]["categories_ms"]
    assert cats["indexer"] > 0 and cats["topk"] > 0 and cats["attention"] > 0, cats
    assert dsa_reference.topk_indices.__module__ == dsa_reference.__name__  # the wrapper is gone


def test_fp8_checkpoint_dequantizes_the_indexer_and_matches_the_same_model_dequantized(tmp_path):
    """DeepSeek-V3.2 ships its projections in fp8 (128 x 128 blocks; 32 x 32 here), the indexer's among them: they
    load dequantized into the model dtype (the indexer never runs an fp8 matmul), the other projections in fp8,
    and the logits over a context past index_topk are those of the same checkpoint dequantized."""
    from model_utils import PagedHarness, dequantized_checkpoint
    from safetensors.torch import load_file, save_file

    from graphserve.kernels.fp8_quant import FP8_DTYPE, quantize_weight_blocks
    from graphserve.models.fp8_checkpoint import quantize_checkpoint

    # q LoRA 32: the fused q-a / kv-a matmul's first part is whole 32-row blocks
    make_hf_checkpoint(tmp_path / "src", DeepseekV32Config(**{**_TINY, "q_lora_rank": 32}, num_hidden_layers=2,
                                                           first_k_dense_replace=1, rope_theta=10000.0))
    quantize_checkpoint(tmp_path / "src", tmp_path / "fp8", block=(32, 32))
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if ".indexer.w" in n and n.endswith(("wq_b.weight", "wk.weight"))]:
        tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = \
            quantize_weight_blocks(tensors[name], 32, 32)  # our quantizer names only *_proj modules
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert tensors["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == FP8_DTYPE
    dequantized_checkpoint(tmp_path / "fp8", tmp_path / "deq")
    tokens = list(range(7, 37))
    logits = []
    for folder in ("fp8", "deq"):
        loaded = load_model(EngineConfig(model=str(tmp_path / folder), block_size=4), torch.device("cpu"))
        attn = loaded.model.model.layers[1].self_attn
        assert attn.indexer.wq_b.weight.dtype == attn.indexer.wk.weight.dtype == torch.float32
        assert attn.o_proj.weight.dtype == (FP8_DTYPE if folder == "fp8" else torch.float32)
        logits.append(PagedHarness(loaded.model).step([("s", tokens)])[0])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_fp8_kv_cache_stores_index_keys_in_the_fp8_form(tmp_path):
    """--kv-cache-dtype fp8_e4m3 stores e4m3 latents and index keys of D e4m3 bytes plus an fp32 scale. With the
    index keys alone in that form: rows whose context fits index_topk select everything (their logits unchanged),
    the keys read back within e4m3's rounding, and the longer rows' logits move by a changed selection at most.
    (The latents' e4m3 rounding is MLA's: tests/models/test_mla_fp8_kv.py.)"""
    import dataclasses

    from model_utils import PagedHarness
    from test_mla_fp8_kv import LOGITS_TOL

    from graphserve.kernels.dsa_reference import dequantize_index_rows

    _checkpoint(tmp_path, "glm5")
    fp8 = load_model(EngineConfig(model=str(tmp_path), dtype="float32", block_size=4, kv_cache_dtype="fp8_e4m3"),
                     torch.device("cpu"))
    kv = fp8.info.kv
    assert kv.dtype == torch.float8_e4m3fn and kv.index_dtype == torch.uint8 and kv.index_bytes_per_token == 2 * 20
    caches = kv.allocate(64, 4, "cpu")
    assert caches[0].dtype == torch.float8_e4m3fn and len(caches) == 5 + 2
    assert all(c.dtype == torch.uint8 and c.shape == (64, 4, 16 + 4) for c in caches[5:])
    runs = [PagedHarness(fp8.model), PagedHarness(fp8.model)]
    runs[1].kv_caches = dataclasses.replace(kv, dtype=torch.float32).allocate(64, 4, "cpu")  # FP8 index keys only
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(4, 320, (23,), generator=gen).tolist()
    ref, got = (h.step([("a", tokens)])[0] for h in runs)
    torch.testing.assert_close(got[:TOPK], ref[:TOPK], rtol=1e-5, atol=1e-5)
    assert relative_error(got, ref) < LOGITS_TOL
    slots = torch.tensor([runs[1].tables["a"][p // 4] * 4 + p % 4 for p in range(23)])
    for plain, packed in zip(runs[0].kv_caches[5:], runs[1].kv_caches[5:]):
        keys = plain.view(-1, 16)[slots]
        assert 1e-3 < relative_error(dequantize_index_rows(packed.view(-1, 20)[slots]), keys) < 2**-4
