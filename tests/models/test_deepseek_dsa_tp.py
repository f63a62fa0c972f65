"""GLM-5's sparse attention under tensor parallelism on CPU (gloo, fp32): heads split as MLA's, the indexer and
its key cache replicated, and a --tp 2 engine produces the greedy tokens of --tp 1 with contexts past index_topk."""

from __future__ import annotations

import torch
from test_deepseek_dsa import _TINY
from test_deepseek_tp import _save
from tp_utils import generate_on_ranks
from transformers import GlmMoeDsaConfig

from graphserve import SamplingParams
from graphserve.distributed import state
from graphserve.models.deepseek_dsa import GlmMoeDsaForCausalLM

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _glm() -> GlmMoeDsaConfig:
    return GlmMoeDsaConfig(**_TINY, num_hidden_layers=3, indexer_types=["full", "shared", "full"],
                           mlp_layer_types=["dense", "sparse", "sparse"], rope_theta=10000.0)


def _layer_counts(model) -> tuple[int, int]:  # noqa: ANN001
    return model.shape.num_layers, len(model.shape.moe_layers)


def test_glm5_tp2_matches_tp1(tmp_path):
    _save(tmp_path, _glm())
    gen = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(4, 320, (n,), generator=gen).tolist()} for n in (5, 21, 30)]
    reference = generate_on_ranks(tmp_path, prompts, GREEDY, _layer_counts, num_kv_tokens=1024,
                                  chunked_prefill_size=16, block_size=4)
    assert generate_on_ranks(tmp_path, prompts, GREEDY, _layer_counts, num_kv_tokens=1024, chunked_prefill_size=16,
                             block_size=4, tp=2) == reference


def test_each_rank_holds_its_heads_and_the_whole_indexer(monkeypatch):
    """A rank's modules hold exactly what its description counts: half the attention heads, and every indexer's
    projections and key cache whole."""
    config = _glm()
    whole = GlmMoeDsaForCausalLM.describe(config, torch.float32)
    for rank in range(2):
        monkeypatch.setattr(state, "_STATE", state.ParallelState(rank=rank, world_size=2, tp_size=2, ep_size=1))
        with torch.device("meta"):
            model = GlmMoeDsaForCausalLM(config, max_positions=64)
        d = GlmMoeDsaForCausalLM.describe(config, torch.float32, tp=2)
        assert d.num_params == sum(p.numel() for p in model.parameters())
        assert d.kv == whole.kv and d.kv.index_layers == 2
        attn = model.model.layers[0].self_attn
        assert attn.num_heads == config.num_attention_heads // 2
        assert attn.indexer.wq_b.weight.shape == (config.index_n_heads * config.index_head_dim, config.q_lora_rank)
