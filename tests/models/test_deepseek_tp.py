"""DeepSeek under tensor and expert parallelism on CPU (gloo, fp32): heads split over ranks over a replicated
latent cache, and --tp 2 / --ep 2 engines produce the greedy tokens of --tp 1 on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_hf_checkpoint
from test_deepseek import _TINY
from tp_utils import generate_on_ranks, refusal
from transformers import DeepseekV2Config, DeepseekV3Config

from graphserve import SamplingParams
from graphserve.distributed import state
from graphserve.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

PROMPTS = ["Hello world", "The quick brown fox jumps over", "a", "latent caches agree on every rank"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _v2() -> DeepseekV2Config:
    # no q LoRA: q_proj's heads are split inside the fused q/kv-a matmul whose kv-a part is whole on every
    # rank; MLP biases (dense and shared experts) must be added once; a vocabulary that does not split evenly
    # greedy routing's scaling factor applies to each rank's partial routed sum
    return DeepseekV2Config(**{**_TINY, "vocab_size": 321}, q_lora_rank=None, topk_method="greedy",
                            routed_scaling_factor=1.7, mlp_bias=True, rope_theta=10000.0)


def _v3(q_lora_rank: int = 24) -> DeepseekV3Config:
    # q LoRA (q_a_proj whole, q_b_proj split by heads), grouped sigmoid routing, o_proj's bias added once
    return DeepseekV3Config(**_TINY, q_lora_rank=q_lora_rank, n_group=4, topk_group=2, norm_topk_prob=True,
                            routed_scaling_factor=2.5, attention_bias=True, rope_theta=10000.0)


def _save(folder, config) -> None:
    hf = make_hf_checkpoint(folder, config)
    buffers = [b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
    if buffers:  # zero as transformers leaves it; large enough here to change which experts win
        with torch.no_grad():
            for b in buffers:
                b.copy_(0.3 * torch.randn_like(b))
        hf.save_pretrained(folder)


def _layer_counts(model) -> tuple[int, int]:  # noqa: ANN001
    return model.shape.num_layers, len(model.shape.moe_layers)


def _generate(folder, **kw) -> list[list[int]]:
    return generate_on_ranks(folder, PROMPTS, GREEDY, _layer_counts, num_kv_tokens=1024, chunked_prefill_size=32,
                             **kw)


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


def test_a_split_that_does_not_divide_is_refused_naming_the_field_and_the_values_that_work(tmp_path):
    config = _v3()
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(tmp_path)  # config.json is all the check reads
    e = refusal(tmp_path, "--tp", "3")
    assert e.param == "tp" and "num_attention_heads=4" in e.message and "[1, 2, 4]" in e.message
    e = refusal(tmp_path, "--ep", "3")
    assert e.param == "ep" and "n_routed_experts=8" in e.message and "[1, 2, 4, 8]" in e.message


def test_v3_fp8_checkpoint_tp2_and_ep2_match_tp1(tmp_path):
    """A V3 FP8 checkpoint in 16x16 blocks, the smallest the FP8 kernels take (q_a 32 and kv_a 40 rows fused, q_b 48
    rows a rank, experts 16 rows a rank: whole blocks but kv_a's last): projections and experts cut with their
    scales, kv_b_proj dequantized whole and then cut by heads."""
    from graphserve.models.fp8_checkpoint import quantize_checkpoint

    _save(tmp_path / "bf16", _v3(q_lora_rank=32))
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp8", block=(16, 16))
    reference = _generate(tmp_path / "fp8")
    assert _generate(tmp_path / "fp8", tp=2) == reference
    assert _generate(tmp_path / "fp8", ep=2) == reference
