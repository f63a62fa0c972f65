"""benchmarks/offline credits Hugging Face with the tokens each row generated up to its own length,
read off what generate returned (a padded batch runs every row to its longest; that is reported apart)."""

from __future__ import annotations

import pytest
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
    from graphserve import LLM

    reqs = [(ids[:40], out) for (ids, _), out in zip(workload(4, 0, 300), [5, 1, 7, 3])]
    llm = LLM("builtin:tiny-llama", max_model_len=256, enable_prefix_caching=False)
    seconds, tokens, per_request = run_graphserve(llm, reqs)
    assert per_request == [5, 1, 7, 3] and tokens == 16 and seconds > 0


def test_the_declared_subset_is_the_first_requests_with_outputs_cut():
    from benchmarks.offline import hf_subset

    reqs = [([1, 2], 300), ([3], 90), ([4, 5, 6], 1000), ([7], 256)]
    assert hf_subset(reqs, 3, 256) == [([1, 2], 256), ([3], 90), ([4, 5, 6], 256)]
    with pytest.raises(SystemExit, match="--hf-requests=5 is invalid"):
        hf_subset(reqs, 5, 256)
    with pytest.raises(SystemExit, match="--hf-max-output-len=0 is invalid"):
        hf_subset(reqs, 2, 0)


def test_a_model_row_runs_both_sides_on_the_subset_and_credits_what_each_produced():
    from benchmarks.offline import hf_subset, measure_model, workload

    reqs = [(ids[:24], out) for (ids, _), out in zip(workload(5, 1, 300), [6, 2, 9, 4, 3])]
    subset = hf_subset(reqs, 3, 5)  # outputs 5, 2, 5
    row = measure_model("builtin:tiny-llama", reqs, subset, 2, torch.device("cpu"))
    assert row["out_tokens"] == row["requested_tokens"] == 24  # graphserve alone, on all five
    assert row["subset_out_tokens"] == row["subset_requested_tokens"] == row["hf_out_tokens"] == 12
    assert row["hf_computed_tokens"] == 5 + 5 + 5  # batches [5, 2] and [5] each run to their longest
    assert (row["hf_requests"], row["hf_max_output_len"], row["hf_batch"]) == (3, 5, 2)
    assert row["ratio_vs_hf"] == pytest.approx((12 / row["subset_seconds"]) / (12 / row["hf_seconds"]))
    assert row["tok_s"] == pytest.approx(24 / row["seconds"])
