"""benchmarks/offline credits Hugging Face with the tokens each row generated up to its own length,
read off what generate returned (a padded batch runs every row to its longest; that is reported apart)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from benchmarks.offline import run_hf


def test_hf_generate_is_credited_per_row():
    config = LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=0, eos_token_id=1)
    gen = torch.Generator().manual_seed(3)
    outs = [3, 9, 1, 5, 7]
    reqs = [(torch.randint(10, 190, (n,), generator=gen).tolist(), out) for n, out in zip([4, 11, 6, 8, 3], outs)]
    seconds, credited, computed = run_hf(config, reqs, batch=2, device=torch.device("cpu"), dtype=torch.float32)
    assert credited == outs  # each row up to its own length ...
    assert computed == [9, 9, 5, 5, 7]  # ... though a padded batch [3, 9], [1, 5], [7] runs to its longest
    assert seconds > 0



def test_graphserve_side_is_credited_with_what_it_returned():
    from benchmarks.offline import run_graphserve, workload

    reqs = [(ids[:40], out) for (ids, _), out in zip(workload(4, 0, 300), [5, 1, 7, 3])]
    seconds, tokens, llm = run_graphserve("builtin:tiny-llama", reqs, max_model_len=256)
    assert tokens == 16 and seconds > 0
    # the warm-up ran on other prompts: the measured ones found nothing cached
    assert llm.engine.stats().prefix_cache_hit_rate == 0.0
