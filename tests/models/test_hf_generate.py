"""End to end: greedy generation through the whole engine equals transformers' generate()."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_hf_checkpoint
from transformers import LlamaConfig, Qwen3Config

from graphserve import LLM, SamplingParams

_TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
CONFIGS = {
    "llama": lambda: LlamaConfig(**_TINY, rope_theta=10000.0),
    "qwen3": lambda: Qwen3Config(**_TINY, head_dim=32, rope_theta=1000000.0),
}
NEW_TOKENS = 32


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_greedy_matches_transformers_generate(arch, tmp_path):
    hf = make_hf_checkpoint(tmp_path, CONFIGS[arch]())
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 320, (n,), generator=gen).tolist() for n in (3, 11, 26)]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)
        expected.append(out[0, len(ids):].tolist())
    llm = LLM(str(tmp_path), block_size=4, chunked_prefill_size=16)
    # min_tokens bans eos exactly as min_new_tokens does in transformers
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for got, want in zip(outs, expected):
        assert got.token_ids == want
        assert got.finish_reason == "length"
    llm.engine.core.block_manager.check_no_leak()
