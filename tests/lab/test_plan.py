from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from graphserve.analysis import plan as plan_cmd
from graphserve.analysis.plan import build_plan, load_hf_config
from graphserve.engine.memory import GiB, plan_memory
from graphserve.errors import ModelLoadError
from graphserve.models.registry import describe_model

DATA = Path(__file__).resolve().parents[1] / "data"
LLAMA8B = load_hf_config(str(DATA / "llama3_8b_config.json"))
LLAMA70B = load_hf_config(str(DATA / "llama_70b_like_config.json"))
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": True,
        "max_position_embeddings": 512}
_DTYPE = {2: torch.bfloat16, 4: torch.float32}


def estimate_weights_bytes(hf, dtype_bytes, tp=1):
    return describe_model(hf, _DTYPE[dtype_bytes], tp).weights_bytes


def kv_bytes_per_token(hf, dtype_bytes, tp=1):
    return describe_model(hf, _DTYPE[dtype_bytes], tp).kv.bytes_per_token


def estimate_activation_bytes(hf, tokens, dtype_bytes, tp=1, **kw):
    return describe_model(hf, _DTYPE[dtype_bytes], tp).activation_bytes(tokens, **kw)


def test_llama3_8b_estimates_match_hand_counts():
    # Llama-3-8B has 8,030,261,248 parameters; bf16 = 2 bytes each.
    assert estimate_weights_bytes(LLAMA8B, 2, tp=1) == 8_030_261_248 * 2
    assert kv_bytes_per_token(LLAMA8B, 2, tp=1) == 2 * 32 * 8 * 128 * 2 == 131072
    # tp 16 > 8 KV heads: each rank keeps one KV head.
    assert kv_bytes_per_token(LLAMA8B, 2, tp=16) == 2 * 32 * 1 * 128 * 2


def test_plan_memory_llama3_8b_on_141gb_at_088():
    p = plan_memory(141 * 10**9, 0.88, 8_030_261_248 * 2, (GiB, GiB // 4), 2 * GiB, GiB // 2, 131072, 16, 8192, 256)
    # static 124,080,000,000 - weights 16,060,522,496 - (1 + 2 + 0.5) GiB 3,758,096,384 = 104,261,381,120 B
    assert p.static_bytes == 124_080_000_000
    assert p.activation_bytes == GiB  # the larger of the two peaks
    assert p.kv_pool_bytes == 104_261_381_120
    assert p.kv_tokens == 795_440  # 104,261,381,120 // 131072 = 795,451 -> whole 16-token blocks
    assert p.num_blocks == 49_715
    assert p.max_concurrent_at_max_len == 97  # 795,440 // 8192
    assert p.fits and p.refusal is None
    table = p.table()
    assert "kv tokens" in table and "795440" in table and "97" in table and "GiB" in table


def test_plan_memory_tiny_config_and_refusal_names_the_flags():
    w = estimate_weights_bytes(TINY, 4)
    assert w == 90_432 * 4
    kv = kv_bytes_per_token(TINY, 4)
    assert kv == 512
    p = plan_memory(1 << 20, 0.9, w, 10_000, 0, 0, kv, 16, 512, 8)
    # static 943,718 - 361,728 - 10,000 = 571,990 B -> 1117 tokens -> 1104 in blocks of 16
    assert (p.kv_pool_bytes, p.kv_tokens, p.num_blocks, p.max_concurrent_at_max_len) == (571_990, 1104, 69, 2)
    bad = plan_memory(1 << 20, 0.9, w, 10_000, 0, 0, kv, 16, 2048, 8)
    assert not bad.fits
    assert "--max-model-len" in bad.refusal and "at most 1104" in bad.refusal
    assert "--mem-fraction-static" in bad.refusal
    # a budget that a higher fraction fixes names the fraction to use
    close = plan_memory(1 << 20, 0.5, w, 10_000, 0, 0, kv, 16, 512, 8)
    assert not close.fits and "raise --mem-fraction-static from 0.5 to at least 0.61" in close.refusal
    assert "refused" in close.table()


def test_refusal_suggests_more_tp_when_weights_crowd_out_kv():
    w = estimate_weights_bytes(LLAMA70B, 2, tp=1)  # ~141 GB of weights on one 141 GB GPU
    p = plan_memory(141 * 10**9, 0.9, w, GiB, GiB, 0, kv_bytes_per_token(LLAMA70B, 2), 16, 8192, 64)
    assert not p.fits and "raise --tp from 1 to 2" in p.refusal


def test_activation_formula():
    t, h, i, v = 4, 64, 128, 256
    # residual + normed (2·T·h) + max(qkv+attn out, gated MLP 3·T·I) in fp32, + fp32 logits for 1 row
    attn = t * (4 + 2 * 2) * 16 + t * 4 * 16
    expect = (2 * t * h + max(attn, 3 * t * i)) * 4 + 1 * v * 4
    assert estimate_activation_bytes(TINY, t, 4, sampled_rows=1) == expect


def test_story_config_is_out_of_memory_at_64_with_max_bs_32_when_eager():
    kw = dict(gpu_memory_gb=96, tp=4, mem_fraction_static=0.70, cuda_graph_max_bs=32, max_running_requests=64,
              input_len=4096, output_len=4096, reserve_gb=0.25, concurrency=[16, 32, 64], max_model_len=32768)
    eager = {v["concurrency"]: v for v in build_plan(LLAMA70B, oversize="eager", **kw)["verdicts"]}
    assert eager[32]["verdict"] == "fits"
    assert eager[64]["verdict"] == "out of memory"
    assert eager[64]["eager_bytes"] > eager[64]["planned_bytes"]
    assert "--cuda-graph-max-bs" in " ".join(eager[64]["notes"])
    # graphserve splits the oversize batch into captured sizes: no unplanned memory, KV decides.
    split = {v["concurrency"]: v for v in build_plan(LLAMA70B, oversize="split", **kw)["verdicts"]}
    assert split[64]["verdict"] == "preempts"  # 64 × 8192 tokens exceed the KV pool
    # capturing up to 64 removes the eager batch
    raised = {v["concurrency"]: v for v in build_plan(LLAMA70B, oversize="eager", **{**kw, "cuda_graph_max_bs": 64})["verdicts"]}
    assert raised[64]["verdict"] != "out of memory"


def test_cli_text_and_json(capsys, tmp_path):
    cfg = tmp_path / "model"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(LLAMA8B))
    args = types.SimpleNamespace(model=str(cfg), gpu_memory_gb=141.0, tp=1, mem_fraction_static=0.88,
                                 cuda_graph_max_bs=256, cuda_graph_bs=None, disable_cuda_graph=False,
                                 max_running_requests=None, input_len=1024, output_len=1024, dtype="bf16",
                                 concurrency="1,8,32,64", max_model_len=8192, chunked_prefill_size=2048, block_size=16,
                                 reserve_gb=0.5, oversize="split", quantization="none", kv_cache_dtype="auto", json=False)
    assert plan_cmd.run(args) == 0
    out = capsys.readouterr().out
    assert "weights per GPU" in out and "KV bytes per token   131072" in out and "fits" in out
    args.json = True
    plan_cmd.run(args)
    data = json.loads(capsys.readouterr().out)
    assert [v["verdict"] for v in data["verdicts"]] == ["fits"] * 4
    assert data["weights_bytes"] == 8_030_261_248 * 2


def test_unknown_model_source_is_refused():
    with pytest.raises(ModelLoadError, match="MODEL"):
        load_hf_config("/nonexistent/config.json")


def test_preset_name_is_loaded_through_the_presets():
    cfg = load_hf_config("dummy:llama3-8b")
    assert estimate_weights_bytes(cfg, 2) == estimate_weights_bytes(LLAMA8B, 2)


def test_moe_plan_reads_the_family_description():
    """The MoE family describes its own weights (all experts) and names its workspace in the budget."""
    p = build_plan(load_hf_config("dummy:qwen3-30b-a3b"), gpu_memory_gb=141, concurrency=[1])
    assert p["weights_bytes"] == 30_532_122_624 * 2  # Qwen3-30B-A3B: 30,532,122,624 parameters
    assert p["kv_bytes_per_token"] == 2 * 48 * 4 * 128 * 2
    parts = dict(p["memory"]["activation_parts"])
    assert 0 < parts["MoE workspace"] <= p["prefill_activation_bytes"]
    assert "MoE workspace" in p["table"]
    dense = build_plan(LLAMA8B, gpu_memory_gb=141, concurrency=[1])
    assert "MoE" not in dense["table"]


def test_plan_and_engine_keep_one_reserve():
    """`graphserve plan` and GPU start-up hold back the same reserve, so a plan that fits is one the engine fits."""
    import argparse

    from graphserve.engine import memory, startup

    assert startup.RESERVE_BYTES is memory.RESERVE_BYTES  # imported, not a second figure
    assert build_plan(LLAMA8B, gpu_memory_gb=141)["memory"]["reserve_bytes"] == memory.RESERVE_BYTES
    parser = argparse.ArgumentParser()
    plan_cmd.add_arguments(parser)
    assert int(parser.parse_args(["dummy:llama3-8b"]).reserve_gb * GiB) == memory.RESERVE_BYTES
