"""DeepSeek-V4 matches transformers logit for logit (CPU, float32) on its paged latents and compact compressed pages:
sliding, compressed-sparse (CSA, the indexer keeping fewer entries than a query has seen) and heavily compressed
(HCA) layers, contexts several windows long, hash-routed and score-routed MoE layers, hyper-connections."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_utils import (
    PagedHarness,
    check_paged_parity,
    engine_greedy,
    held_weight_bytes,
    hf_greedy,
    hf_logits,
    make_hf_checkpoint,
    random_prompts,
    relative_error,
)
from transformers import DeepseekV4Config

from graphserve import LLM
from graphserve.config import EngineConfig
from graphserve.errors import ModelLoadError
from graphserve.layers.kv_layout import CompactCache, with_block_size
from graphserve.layers.linear import Linear
from graphserve.layers.moe import FusedMoE
from graphserve.layers.quant.fp4 import Fp4LinearMethod
from graphserve.layers.quant.fp8 import Fp8LinearMethod
from graphserve.models.loader import load_model
from graphserve.models.presets import get_preset_config
from graphserve.models.registry import describe_model

TOL = 1e-4
_TINY = dict(vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
             q_lora_rank=32, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=8, o_groups=2,
             o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=3, sliding_window=8, hc_mult=2,
             hc_sinkhorn_iters=5, max_position_embeddings=512, swiglu_limit=0.5, bos_token_id=0, eos_token_id=1,
             architectures=["DeepseekV4ForCausalLM"])
_TYPES = ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
          "compressed_sparse_attention"]


def _config(hca_rate: int = 16) -> DeepseekV4Config:
    return DeepseekV4Config(**_TINY, num_hidden_layers=4, layer_types=_TYPES,
                            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
                            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca_rate})


def _checkpoint(folder, config):
    hf = make_hf_checkpoint(folder, config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))  # large enough to change which experts win
            elif name.endswith("tid2eid"):  # distinct experts per token, as a trained table has them
                buf.copy_(torch.stack([torch.randperm(buf.shape[1] * 4, generator=gen)[: buf.shape[1]]
                                       for _ in range(buf.shape[0])]))
        for name, p in hf.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4")
    hf = _checkpoint(folder, _config())
    loaded = load_model(EngineConfig(model=str(folder), dtype="float32", max_model_len=256, block_size=4),
                        torch.device("cpu"))
    return hf, loaded, folder


def test_prefill_chunked_and_decode_match_transformers(v4):
    """Prompts of 37, 41 (the last 22 on a cached 19-token prefix: groups straddle the chunk edge) and 29 tokens,
    then decode steps across group edges: every logit row within 1e-4 of transformers' uncached forward."""
    hf, loaded, _ = v4
    check_paged_parity(loaded.model, hf, "deepseek-v4", TOL, lengths=(37, 41, 29), prefix=19, decode_steps=5,
                       num_blocks=96)


def test_a_long_context_reads_its_window_and_every_heavily_compressed_group(tmp_path):
    """HCA at its built 128:1 over a 300-token prompt (two closed groups, a partial third), chunked at 100 tokens."""
    hf = _checkpoint(tmp_path, _config(hca_rate=128))
    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="float32", max_model_len=512, block_size=8),
                        torch.device("cpu"))
    check_paged_parity(loaded.model, hf, "deepseek-v4 hca128", TOL, lengths=(9, 300, 5), prefix=100,
                       decode_steps=2, num_blocks=64, block_size=8)


def test_greedy_matches_transformers_generate_under_continuous_batching(v4):
    """Prompts of 9, 23 and 37 tokens (chunked by 16) batched together, 10 greedy tokens each; then a prompt sharing
    the 37-token one's first 36 tokens takes its latents, entries and the checkpoint at the end of its last shared
    block from the prefix cache (36 is mid-group for HCA's rate 16: the open group goes on from that checkpoint);
    then the three again on a pool too small for all of them at once (preemption by recompute)."""
    hf, _, folder = v4
    prompts = random_prompts((9, 23, 37))
    llm = LLM(str(folder), block_size=4, chunked_prefill_size=16, dtype="float32", max_model_len=256)
    want = [hf_greedy(hf, p, 10) for p in prompts]
    assert engine_greedy(llm, prompts, 10) == want
    shared = prompts[2][:36] + [7, 8, 9]
    manager = llm.engine.core.block_manager
    hits = manager.hit_tokens
    assert engine_greedy(llm, [shared], 10) == [hf_greedy(hf, shared, 10)]
    assert manager.hit_tokens - hits == 36
    manager.check_no_leak()
    # 80 tokens of cache: each prompt fits alone, not all three at once, so some are preempted and recomputed
    small = LLM(str(folder), block_size=4, chunked_prefill_size=16, dtype="float32", max_model_len=256,
                num_kv_tokens=80, enable_prefix_caching=False)
    got = engine_greedy(small, prompts, 10)
    assert small.engine.stats().num_preemptions > 0
    assert got == want


def test_description_counts_every_parameter_and_each_cache_part(v4):
    hf, loaded, _ = v4
    d, cfg = loaded.info.description, hf.config
    assert d.num_params == sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in loaded.model.parameters())
    # per token (blocks of 4, float32): a latent per layer; per block and compressed layer a page: the checkpoint
    # (CSA: cur and next accumulators of log-sum-exp and weighted mean for the latent (32) and the indexer key (16);
    # HCA: one for the latent), then one entry row per rate tokens (CSA at 4: one a block, latent + key; HCA at 16: one)
    hca, csa = 2 * 32, 4 * (32 + 16)
    assert d.kv.compact == (CompactCache(16, 32, 4 * hca), CompactCache(4, 48, 4 * csa), CompactCache(4, 48, 4 * csa))
    assert d.kv.block_size == 4
    state, entries = hca + 2 * csa, 32 + 2 * 48  # a block's, in floats
    assert d.kv.bytes_per_token == 4 * 4 * 32 + (state + entries)  # 4 bytes a float over 4 tokens a block
    assert dict(d.kv.parts()) == {"latent": 4 * 4 * 32, "compressor state": state, "compressed entries": entries}
    caches = d.kv.allocate(5, 4, "cpu")
    assert [c.shape for c in caches[cfg.num_hidden_layers:-1]] == [(5, hca + 32), (5, csa + 48), (5, csa + 48)]
    # the latents paged apart, through the block -> latent page map last in the list (identity without a page count)
    assert d.kv.latent_window == 8 and d.kv.latent_map_index == 7 and caches[-1].tolist() == [0, 1, 2, 3, 4]
    paged = d.kv.allocate(5, 4, "cpu", latent_pages=3)
    assert paged[0].shape == (3, 4, 1, 32) and paged[-1].tolist() == [0] * 5
    assert [layer.self_attn.cache_index for layer in loaded.model.model.layers] == [4, 5, None, 6]


@pytest.mark.parametrize(("field", "value", "match"), [
    ("scoring_func", "softmax", "scoring_func='softmax'"),
    ("layer_types", ["full_attention"] * 4, r"layer_types\[0\]='full_attention'"),
    ("compress_rates", {"compressed_sparse_attention": 3, "heavily_compressed_attention": 16},
     r"compress_rates\['compressed_sparse_attention'\]=3"),
    ("compress_rates", {"compressed_sparse_attention": 4, "heavily_compressed_attention": 256},
     r"compress_rates\['heavily_compressed_attention'\]=256"),
    ("mlp_layer_types", ["dense"] * 4, r"mlp_layer_types\[0\]='dense'"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
])  # fmt: skip
def test_unbuilt_config_values_are_refused_by_name(field, value, match):
    cfg = _config()
    object.__setattr__(cfg, field, value)
    with pytest.raises(ModelLoadError, match=match):
        describe_model(cfg, torch.float32)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_quantized_experts_and_projections_run_their_dequantized_weights(v4, fmt, monkeypatch):
    """``--quantization nvfp4|mxfp4|fp8`` on the checkpoint: every routed-expert layer and projection goes through
    the quantized methods (the clamped SwiGLU in the experts' reference), the grouped ``o_a_proj`` one
    ``apply_rows`` call per group, and gives the fp32 model's logits once that model holds the dequantized weights;
    the description prices the bytes held."""
    hf, _, folder = v4
    rows_calls = []
    for method in (Fp4LinearMethod, Fp8LinearMethod):
        def counted(self, layer, x, start, stop, _apply=method.apply_rows):
            rows_calls.append((start, stop))
            return _apply(self, layer, x, start, stop)
        monkeypatch.setattr(method, "apply_rows", counted)
    plain = load_model(EngineConfig(model=str(folder), dtype="float32", max_model_len=256), torch.device("cpu"))
    fp4 = load_model(EngineConfig(model=str(folder), dtype="float32", max_model_len=256, quantization=fmt),
                     torch.device("cpu"))
    assert fp4.info.description.weights_bytes == held_weight_bytes(fp4.model)
    modules, experts, linears = dict(plain.model.named_modules()), 0, 0
    for name, m in fp4.model.named_modules():
        if isinstance(m, FusedMoE):
            w13, w2 = m.quant_method.dequantized(m, torch.float32)
            modules[name].w13_weight.data.copy_(w13)
            modules[name].w2_weight.data.copy_(w2)
            experts += 1
        elif isinstance(m, Linear) and m.quant_method is not None:
            modules[name].weight.data.copy_(m.quant_method.dequantized_weight(m, torch.float32))
            linears += 1
    assert experts == 4 and linears > 40
    ids = torch.randint(4, 320, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    got, want = PagedHarness(fp4.model).step([("a", ids)])[0], PagedHarness(plain.model).step([("a", ids)])[0]
    assert relative_error(got, want) < TOL
    assert relative_error(got, hf_logits(hf, ids)) > 1e-3  # the weights really were quantized
    assert set(rows_calls) == {(0, 16), (16, 32)} and len(rows_calls) == 2 * 4  # o_groups 2, o_lora_rank 16, 4 layers


def test_fp8_blocks_that_split_an_output_group_are_refused_at_load_naming_o_lora_rank(v4):
    """``--quantization fp8-block`` (128-row scale blocks) on o_lora_rank 16: a group's rows of o_a_proj would share
    a scale block with the next group's, so its own call could not run; the load says so, not the first step."""
    _, _, folder = v4
    with pytest.raises(ModelLoadError, match=r"o_lora_rank=16: each of o_a_proj's 2 output groups .*rows \[0, 16\) "
                                             r"split the fp8 scale blocks of 128 rows"):
        load_model(EngineConfig(model=str(folder), dtype="float32", max_model_len=256, quantization="fp8-block"),
                   torch.device("cpu"))


def test_presets_are_the_published_shapes_and_count_284b_parameters():
    from transformers import AutoConfig, AutoModelForCausalLM

    full = get_preset_config("deepseek-v4-flash")
    d = describe_model(full, torch.bfloat16)
    assert abs(d.num_params / 284e9 - 1) < 0.005  # the published 284B
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**full))
    assert d.num_params == sum(p.numel() for p in hf.parameters())
    l6 = describe_model(get_preset_config("deepseek-v4-flash-l6"), torch.bfloat16)
    assert l6.num_moe_layers == 6 and l6.local_experts == 256 and l6.top_k == 6
    hca, csa = CompactCache(128, 512, 4 * 2 * 512), CompactCache(4, 640, 4 * 4 * 640)
    assert l6.kv.compact == (hca,) * 3 + (csa, hca, csa)
    # bytes a token over the six layers: 31,232 when each token's row kept its compressor state and entry columns;
    # now the latents (6 x 1024) and, per block, the pages: 9,344 at --block-size 16, 7,424 at 64
    assert with_block_size(l6.kv, 16).bytes_per_token == 6 * 1024 + (4 * (4096 + 1024) + 2 * (10240 + 4 * 1280)) // 16 \
        == 9344  # fmt: skip
    assert with_block_size(l6.kv, 64).bytes_per_token == 7424
    # as shipped, NVFP4 routed experts and the rest bf16: 23.8 GiB, so one 80 GB card holds it with a KV pool
    from graphserve.analysis.plan import build_plan, load_hf_config

    plan = build_plan(load_hf_config("dummy:deepseek-v4-flash-l6"), gpu_memory_gb=80, concurrency=[64],
                      max_model_len=65536)
    assert plan["quantization"].startswith("nvfp4") and plan["memory"]["weights_bytes"] < 25 * 2**30
    assert plan["memory"]["kv_tokens"] > 64 * 4096
    from graphserve.layers.quant.config import parse_quantization_config
    from graphserve.models.registry import ignore_list

    cfg = get_preset_config("deepseek-v4-flash-l6")
    kept = ignore_list(cfg, parse_quantization_config(cfg["quantization_config"]))
    assert all(kept.keeps(f"model.layers.3.{m}") for m in ("self_attn.q_a_proj", "self_attn.compressor.indexer.q_b_proj",
                                                         "mlp.shared_experts.down_proj", "mlp.gate"))
    assert not kept.keeps_experts("model.layers.3.mlp.experts", 256)
    # under --tp 4 the experts split (their intermediate size), and so do attention's output groups
    tp4 = describe_model(full, torch.bfloat16, tp=4)
    assert tp4.expert_params * 4 == d.expert_params and tp4.dense_params < d.dense_params
    # the MTP layer is held (one sliding-window layer of the main kind) but is no part of the published count
    assert d.kept_unused.num_moe_layers == 1 and l6.kept_unused is None
    assert d.weights_bytes == d.kept_unused.weights_bytes + dataclasses.replace(d, kept_unused=None).weights_bytes


def test_plan_answers_the_first_story_for_its_own_model():
    """``graphserve plan dummy:deepseek-v4-flash --tp 4 --gpu-memory-gb 96 --concurrency 64`` (its routed experts
    NVFP4 as shipped) sizes the pool by each cache part and gives C=64 a verdict at the story's 2048-token requests."""
    from graphserve.analysis.plan import build_plan, load_hf_config

    p = build_plan(load_hf_config("dummy:deepseek-v4-flash"), gpu_memory_gb=96, tp=4, mem_fraction_static=0.70,
                   cuda_graph_max_bs=64, concurrency=[64], max_model_len=4096, input_len=1024, output_len=1024)
    d = describe_model(get_preset_config("deepseek-v4-flash"), torch.bfloat16, tp=4)
    assert p["quantization"].startswith("nvfp4")
    assert p["kv_bytes_per_token"] == d.kv.bytes_per_token == 43 * 1024 + d.kv.row_bytes_per_token == 70592
    for part in ("latent", "compressor state", "compressed entries"):
        assert part in p["table"]
    # C=64 of 2048-token requests needs 131,072 tokens: the pool holds them at the compact layout's bytes a token
    # (at the 242,688 B a token each token's compressor state cost, the same pool held 49k)
    [v] = p["verdicts"]
    m = p["memory"]
    pool = m["kv_pool_bytes"]
    assert v["concurrency"] == 64 and v["kv_tokens_needed"] == 64 * 2048 and v["verdict"] == "fits"
    # the latents only for windows: 64 running ones (and as many cached) of 128 tokens and a chunk of 2048, in pages
    # of 16 (1,537 pages, 1.01 GiB); the blocks keep 26,560 B a token for the whole context, 2.5 times the tokens of
    # a pool where every token kept its latent (70,592 B)
    assert m["latent_pages"] == 2 * (64 * (8 + 2) + 2048 // 16) + 1 == 1537
    assert m["latent_bytes_per_token"] == 43 * 1024 and "latent pages" in p["table"]
    latent_pool = 1537 * 16 * 43 * 1024
    assert m["kv_tokens"] == (pool - latent_pool) // (70592 - 43 * 1024) // 16 * 16
    assert m["kv_tokens"] > 2.5 * (pool // 70592) >= 64 * 2048 > pool // 242688


def test_plan_cli_answers_whether_c64_fits_for_the_story_s_model(capsys):
    from graphserve.cli import main

    args = ["plan", "dummy:deepseek-v4-flash", "--tp", "4", "--gpu-memory-gb", "96", "--concurrency", "64",
            "--mem-fraction-static", "0.70", "--cuda-graph-max-bs", "64", "--max-model-len", "4096"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "70592 B/token" in out and "compressor state" in out
    assert main(args + ["--block-size", "64"]) == 0  # fewer checkpoints a token: 55,472 B
    assert "55472 B/token" in capsys.readouterr().out


def test_bf16_keeps_sinks_hyper_connections_and_position_biases_float32_as_described(v4):
    hf, _, folder = v4
    loaded = load_model(EngineConfig(model=str(folder), dtype="bfloat16", max_model_len=256), torch.device("cpu"))
    kept = {n for n, p in loaded.model.named_parameters() if p.dtype == torch.float32}
    assert kept and all(n.endswith(("sinks", "position_bias", "_hc.fn", "_hc.base", "_hc.scale", "hc_fn", "hc_base",
                                    "hc_scale")) for n in kept)  # fmt: skip
    assert loaded.info.description.weights_bytes == held_weight_bytes(loaded.model)
    ids = list(range(4, 40))
    logits = PagedHarness(loaded.model, dtype=torch.bfloat16).step([("a", ids)])[0]
    assert relative_error(logits, hf_logits(hf, ids)) < 3e-2  # bf16 rounding of the fp32 reference's weights


def test_decode_floor_reads_the_window_the_chosen_entries_and_every_indexer_key():
    d = describe_model(get_preset_config("deepseek-v4-flash-l6"), torch.bfloat16)
    # 6 layers: HCA at 0, 1, 2, 4; CSA at 3, 5 (rates 4 and 128, window 128, topk 512, latent 512, keys 128), and
    # each compressed layer's fp32 checkpoint (HCA: one accumulator of 2 x 512; CSA: two of 2 x (512 + 128))
    hca_state, csa_state = 4 * 2 * 512, 4 * 4 * 640

    def per_seq(c: int) -> int:
        hca = 4 * (min(c, 128) * 512 + c // 128 * 512)
        csa = 2 * (min(c, 128) * 512 + c // 4 * 128 + min(c // 4, 512) * 512)
        return 2 * (hca + csa) + 4 * hca_state + 2 * csa_state

    assert d.kv_read_bytes(1, 64000) == per_seq(64000)
    assert d.kv_read_bytes(2, [100, 4096]) == per_seq(100) + per_seq(4096)
    assert d.decode_read_bytes(1, 64000) - d.decode_read_bytes(1, [0]) == per_seq(64000) - per_seq(0)


def test_decode_benchmark_floor_reads_the_checkpoints_every_step_and_the_description_s_bytes():
    """benchmarks/v4_decode.py's cache bytes: the description's (above) at every position, a group's closing one or
    not (each step folds its token into the checkpoint it read), and attention's alone without the checkpoints."""
    from benchmarks.v4_decode import attention_bytes, step_cache_bytes
    from graphserve.models.deepseek_v4 import decode_kv_read
    from graphserve.models.deepseek_v4_shape import v4_shape_from_config

    s = v4_shape_from_config(_config())  # HCA at 16, CSA at 4 (index_topk 3), one sliding layer; window 8, dim 32
    for ctx in (15, 17, 63):  # position 15 closes HCA's group 0 and CSA's group 3; 17 closes nothing
        assert step_cache_bytes(s, ctx, 4) == decode_kv_read(s, 4, ctx + 1)
    # position 17: 4 windows of 8, HCA's 1 entry, each CSA layer's 4 indexer keys and 3 chosen entries
    want = 4 * (4 * 8 * 32 + 1 * 32 + 2 * (4 * 16 + 3 * 32))
    assert attention_bytes(s, 17, 4) == want
    assert step_cache_bytes(s, 17, 4) == want + 4 * (2 * 32 + 2 * 4 * (32 + 16))
