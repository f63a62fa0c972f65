"""NVFP4 under tensor and expert parallelism on CPU engines (gloo, fp32): each rank cuts the checkpoint's packed
codes with their group scales and keeps every part's global scale, so --tp 2 and --ep 2 give the greedy tokens of
--tp 1. (The per-layer parts: tests/models/test_fp4_layers.py.)"""

from __future__ import annotations

from model_utils import make_hf_checkpoint
from tp_utils import generate_on_ranks
from transformers import Qwen3MoeConfig

from graphserve import SamplingParams
from graphserve.models.fp4_checkpoint import quantize_checkpoint_nvfp4

PROMPTS = ["The quick brown fox jumps over", "nvfp4 ranks agree"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _moe() -> Qwen3MoeConfig:
    # q 4x16, k/v 2x16; dense MLP 96 in layer 1 (48 down columns a rank at tp 2: 3 groups of 16); experts 32 wide
    # (16 a rank: one group) and 4 of them (2 a rank at ep 2)
    return Qwen3MoeConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])


def _layer_counts(model) -> tuple[int, int]:  # noqa: ANN001
    return len(model.model.layers), len(model.moe_shape.sparse_layers)


def _generate(folder, **kw) -> list[list[int]]:
    return generate_on_ranks(folder, PROMPTS, GREEDY, _layer_counts, num_kv_tokens=2048, chunked_prefill_size=64,
                             **kw)


def test_nvfp4_moe_checkpoint_tp2_and_ep2_match_tp1(tmp_path):
    make_hf_checkpoint(tmp_path / "bf16", _moe(), seed=6)
    quantize_checkpoint_nvfp4(tmp_path / "bf16", tmp_path / "fp4", exclude=("lm_head", "model.layers.*.mlp.gate"))
    reference = _generate(tmp_path / "fp4")
    assert _generate(tmp_path / "fp4", tp=2) == reference  # rows and K columns cut on scale groups
    assert _generate(tmp_path / "fp4", ep=2) == reference  # experts whole, 2 on each rank
