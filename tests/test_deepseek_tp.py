"""DeepSeek under tensor and expert parallelism on CPU (gloo, fp32): heads split over ranks over a replicated
latent cache, and --tp 2 / --ep 2 engines produce the greedy tokens of --tp 1 on tiny random checkpoints."""

from __future__ import annotations

import argparse

import pytest
import torch
from model_utils import make_hf_checkpoint
from test_deepseek import _TINY
from transformers import DeepseekV2Config, DeepseekV3Config

from graphserve import LLM, SamplingParams
from graphserve.config import add_engine_args, config_from_args
from graphserve.distributed import state
from graphserve.errors import ConfigError
from graphserve.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

PROMPTS = ["Hello world", "The quick brown fox jumps over", "a", "latent caches agree on every rank"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _v2() -> DeepseekV2Config:
    # no q LoRA: q_proj's heads are split inside the fused q/kv-a matmul whose kv-a part is whole on every
    # rank; MLP biases (dense and shared experts) must be added once; a vocabulary that does not split evenly
    return DeepseekV2Config(**{**_TINY, "vocab_size": 321}, q_lora_rank=None, topk_method="greedy",
                            routed_scaling_factor=1.0, mlp_bias=True, rope_theta=10000.0)


def _v3() -> DeepseekV3Config:
    # q LoRA (q_a_proj whole, q_b_proj split by heads), grouped sigmoid routing, o_proj's bias added once
    return DeepseekV3Config(**_TINY, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                            routed_scaling_factor=2.5, attention_bias=True, rope_theta=10000.0)


def _save(folder, config) -> None:
    hf = make_hf_checkpoint(folder, config)
    buffers = [b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
    if buffers:  # zero as transformers leaves it; large enough here to change which experts win
        with torch.no_grad():
            for b in buffers:
                b.copy_(0.3 * torch.randn_like(b))
        hf.save_pretrained(folder)


def _generate(folder, **kw) -> list[list[int]]:
    llm = LLM(str(folder), dtype="float32", num_kv_tokens=1024, chunked_prefill_size=32, **kw)
    core = llm.engine.core
    try:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        _check_collectives(core, kw.get("tp", 1), kw.get("ep", 1))
    finally:
        core.shutdown()
    assert core.ranks is None or all(p.poll() is not None for p in core.ranks.procs), "ranks outlived shutdown"
    return tokens


def _check_collectives(core, tp: int, ep: int) -> None:
    """A decode step's collectives: at --tp N one all-reduce after attention and one after the MLP or MoE
    block per layer, plus the embedding's all-reduce and the logits' gather; at --ep N alone, one per
    MoE layer (attention and dense MLPs are replicated)."""
    model = core.runner.model
    layers, moe = model.shape.num_layers, len(model.shape.moe_layers)
    expected = 2 * layers + 2 if tp > 1 else moe if ep > 1 else 0
    decode = [r for r in core.telemetry.records() if r.kind == "decode"]
    assert decode
    hidden, vocab_rows = core.info.hidden_size, -(-core.info.vocab_size // tp) * tp
    for r in decode:
        assert r.comm_ops == expected, (r.comm_ops, expected)
        reduced = expected - 1 if tp > 1 else expected  # every collective but the logits' gather is [B, hidden]
        gathered = vocab_rows if tp > 1 else 0
        assert r.comm_bytes == r.batch_size * 4 * (hidden * reduced + gathered)


def test_v2_without_q_lora_tp2_matches_tp1(tmp_path):
    _save(tmp_path, _v2())
    reference = _generate(tmp_path)
    assert _generate(tmp_path, tp=2) == reference
    assert _generate(tmp_path, tp=2, ep=2) == reference  # heads split, experts placed whole


def test_v3_tp2_and_ep2_match_tp1(tmp_path):
    _save(tmp_path, _v3())
    reference = _generate(tmp_path)
    assert _generate(tmp_path, tp=2) == reference
    assert _generate(tmp_path, ep=2) == reference  # attention replicated, 4 of the 8 experts on each rank


@pytest.mark.parametrize(("cls", "make", "tp", "ep"), [
    (DeepseekV2ForCausalLM, _v2, 2, 1), (DeepseekV2ForCausalLM, _v2, 4, 1),
    (DeepseekV3ForCausalLM, _v3, 2, 1), (DeepseekV3ForCausalLM, _v3, 1, 2), (DeepseekV3ForCausalLM, _v3, 2, 2),
])  # fmt: skip
def test_each_rank_holds_its_heads_and_the_whole_latent_cache(monkeypatch, cls, make, tp, ep):
    """The modules a rank builds hold exactly the parameters its description counts, its heads' slice of
    kv_b_proj (the absorbed W_UK / W_UV), and one latent head of the tp-1 width."""
    config = make()
    whole = cls.describe(config, torch.float32)
    world = max(tp, ep)
    for rank in range(world):
        monkeypatch.setattr(state, "_STATE", state.ParallelState(rank=rank, world_size=world, tp_size=tp, ep_size=ep))
        with torch.device("meta"):
            model = cls(config, max_positions=64)
        d = cls.describe(config, torch.float32, tp=tp, ep=ep)
        assert d.num_params == sum(p.numel() for p in model.parameters())
        assert d.kv == whole.kv and d.kv.num_heads == 1
        attn = model.model.layers[0].self_attn
        assert attn.num_heads == config.num_attention_heads // tp
        assert attn.w_uk().shape == (attn.num_heads, config.qk_nope_head_dim, config.kv_lora_rank)
        assert attn.w_uv().shape == (attn.num_heads, config.v_head_dim, config.kv_lora_rank)
        assert attn.fused_qkv_a_proj.output_sizes[1] == config.kv_lora_rank + config.qk_rope_head_dim
        assert d.local_experts == whole.local_experts // ep
        if tp == 1:  # --ep alone: attention, dense MLPs and shared experts whole on every rank
            assert d.dense_params == whole.dense_params


def _refusal(folder, *flags: str) -> ConfigError:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(ConfigError) as e:
        config_from_args(parser.parse_args(list(flags)), str(folder))
    return e.value


def test_a_split_that_does_not_divide_is_refused_naming_the_field_and_the_values_that_work(tmp_path):
    config = _v3()
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(tmp_path)  # config.json is all the check reads
    e = _refusal(tmp_path, "--tp", "3")
    assert e.param == "tp" and "num_attention_heads=4" in e.message and "[1, 2, 4]" in e.message
    e = _refusal(tmp_path, "--ep", "3")
    assert e.param == "ep" and "n_routed_experts=8" in e.message and "[1, 2, 4, 8]" in e.message
