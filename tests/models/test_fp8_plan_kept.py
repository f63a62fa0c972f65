"""The memory plan under FP8 prices at the model dtype exactly the dense parameters the loaded model keeps in it
(norms, q/k norms, biases, router gates, MLA's kv_b_proj): ``ModelDescription.model_dtype_params`` of every family
against the parameters of the same tiny model quantized at load on CPU."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_hf_checkpoint
from transformers import DeepseekV3Config, OlmoeConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from graphserve.config import EngineConfig
from graphserve.kernels.fp8_quant import FP8_DTYPE
from graphserve.models.loader import load_model

_TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, intermediate_size=96)
FAMILIES = {
    # q/k/v biases
    "qwen2": lambda: Qwen2Config(**_TINY),
    # per-head q/k norms, and q/k/v and output biases
    "qwen3-bias": lambda: Qwen3Config(**_TINY, head_dim=32, attention_bias=True),
    # q/k norms over the whole projections, and routers
    "olmoe": lambda: OlmoeConfig(**_TINY, num_experts=4, num_experts_per_tok=2),
    "qwen3-moe": lambda: Qwen3MoeConfig(**_TINY, head_dim=32, moe_intermediate_size=32, num_experts=4,
                                        num_experts_per_tok=2, mlp_only_layers=[1]),
    # q-a and kv-a norms, kv_b_proj, attention biases, routers with a correction bias, a shared expert and a dense
    # first layer
    "deepseek-v3": lambda: DeepseekV3Config(**{**_TINY, "intermediate_size": 96}, kv_lora_rank=32, q_lora_rank=32,
                                            qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                                            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                            attention_bias=True, rope_theta=10000.0),
}


def _kept_by_the_model(model: torch.nn.Module) -> int:
    """Dense parameters the loaded model holds in the model dtype (the embedding, the head and the routed experts
    are priced apart)."""
    return sum(p.numel() for name, p in model.named_parameters()
               if p.dtype != FP8_DTYPE and "embed_tokens" not in name and "lm_head" not in name
               and not name.endswith((".experts.w13_weight", ".experts.w2_weight")))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_plan_keeps_what_the_fp8_model_keeps(family: str, tmp_path) -> None:
    make_hf_checkpoint(tmp_path, FAMILIES[family](), seed=1)
    loaded = load_model(EngineConfig(model=str(tmp_path), quantization="fp8"), torch.device("cpu"))
    desc = loaded.info.description
    assert desc.model_dtype_params > 0
    assert desc.model_dtype_params == _kept_by_the_model(loaded.model)
