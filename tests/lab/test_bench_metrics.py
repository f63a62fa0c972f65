"""Metric arithmetic on hand-built timelines, dataset length rules and prompt construction."""

from __future__ import annotations

import json

import numpy as np
import pytest

from graphserve.bench.datasets import (
    length_bounds,
    random_id_requests,
    random_requests,
    sample_lengths,
    sharegpt_requests,
)
from graphserve.bench.metrics import achieved_concurrency, build_record, describe, failed_record, summarize
from graphserve.bench.steady import steady_point, steady_window
from graphserve.errors import BadRequestError


def test_streamed_record_ttft_tpot_itl():
    r = build_record(0.0, 0.17, [0.10, 0.12, 0.14, 0.16], [1, 1, 1, 1], 4, stream=True, requested_tokens=4)
    assert r.ttft_ms == pytest.approx(100.0)
    assert r.e2e_ms == pytest.approx(170.0)
    assert r.tpot_ms == pytest.approx(70.0 / 3)
    assert r.itl_ms == pytest.approx([20.0, 20.0, 20.0])
    assert r.chunk_itl_ms == pytest.approx([20.0, 20.0, 20.0])


def test_multi_token_chunks_split_per_token():
    r = build_record(0.0, 0.2, [0.05, 0.10, 0.19], [1, 2, 3], 6, stream=True)
    assert r.chunk_itl_ms == pytest.approx([50.0, 90.0])
    assert r.itl_ms == pytest.approx([25.0, 25.0, 30.0, 30.0, 30.0])
    assert r.tpot_ms == pytest.approx((200.0 - 50.0) / 5)


def test_unreported_chunk_counts_spread_the_server_total():
    # 3 chunks, server says 5 tokens: the 4 tokens after the first are spread over 2 chunks.
    r = build_record(0.0, 0.1, [0.02, 0.06, 0.10], [None, None, None], 5, stream=True)
    assert r.itl_ms == pytest.approx([20.0, 20.0, 20.0, 20.0])
    assert np.mean(r.itl_ms) == pytest.approx(r.tpot_ms)


def test_early_stopped_request_uses_reported_tokens():
    # Asked for 100 tokens, the server stopped at 3: TPOT divides by 2, not 99.
    r = build_record(0.0, 0.30, [0.1, 0.2, 0.3], [1, 1, 1], 3, stream=True, requested_tokens=100)
    assert r.tpot_ms == pytest.approx(100.0)
    s = summarize([r], 0.3)
    assert s["early_stopped"] == 1
    assert s["total_output_tokens"] == 3


def test_one_token_and_non_streamed_have_no_tpot():
    one = build_record(0.0, 0.05, [0.05], [1], 1, stream=True)
    assert one.ttft_ms == pytest.approx(50.0) and one.tpot_ms is None and one.itl_ms == []
    flat = build_record(0.0, 0.5, [], [], 10, stream=False)
    assert flat.ttft_ms is None and flat.tpot_ms is None and flat.itl_ms == [] and flat.e2e_ms == pytest.approx(500)
    s = summarize([one, flat], 0.5)
    assert s["tpot_ms"] is None  # absent, never zero
    assert s["ttft_ms"]["n"] == 1 and s["e2e_ms"]["n"] == 2


def test_percentiles_and_failures():
    d = describe(list(range(1, 101)))
    assert d["median"] == pytest.approx(50.5)
    assert d["p90"] == pytest.approx(90.1)
    assert d["p99"] == pytest.approx(99.01)
    assert describe([]) is None
    ok = build_record(0.0, 1.0, [0.5, 1.0], [1, 1], 2, stream=True, input_tokens=10)
    bad = failed_record(0.0, 0.1, "http 500: boom", True)
    s = summarize([ok, bad], 2.0)
    assert (s["completed"], s["failed"]) == (1, 1)
    assert s["failure_reasons"] == {"http 500": 1}
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["total_token_throughput"] == pytest.approx(6.0)


def test_achieved_concurrency_time_average():
    recs = [build_record(0, 1, [], [], 1, stream=False), build_record(0, 2, [], [], 1, stream=False),
            build_record(1, 2, [], [], 1, stream=False), build_record(0, 0.5, [], [], 1, stream=False)]
    assert achieved_concurrency(recs, 0.0, 2.0) == pytest.approx(4.5 / 2)
    assert achieved_concurrency(recs, 0.0, 0.5) == pytest.approx(3.0)
    assert achieved_concurrency(recs, 0.5, 1.5) == pytest.approx(2.0)


def test_steady_window_excludes_ramp_and_drain():
    # C=2, 4 requests: starts 0, 0.1 | replacements at 1.0 and 1.1; ends 1.0, 1.1, 2.0, 2.3.
    spans = [(0.0, 1.0), (0.1, 1.1), (1.0, 2.0), (1.1, 2.3)]
    recs = [build_record(a, b, [a + 0.1 * k for k in range(1, 11)], [1] * 10, 10, stream=True) for a, b in spans]
    assert steady_window(recs, 2) == pytest.approx((0.1, 2.0))
    p = steady_point([r.to_dict() for r in recs], 2)
    assert p["achieved_concurrency"] == pytest.approx(2.0)
    assert p["steady_itl_ms"]["median"] == pytest.approx(100.0)
    assert steady_window(recs[:1], 2) is None


def test_length_rules():
    assert length_bounds(100, 0.5, "sglang") == (50, 100)
    assert length_bounds(100, 1.0, "sglang") == (100, 100)
    assert length_bounds(100, 0.0, "sglang") == (1, 100)
    assert length_bounds(100, 0.5, "vllm") == (50, 150)
    assert length_bounds(100, 0.0, "vllm") == (100, 100)
    with pytest.raises(BadRequestError, match="random_range_ratio"):
        length_bounds(100, 1.0, "vllm")
    rng = np.random.default_rng(0)
    lens = sample_lengths(rng, 4000, 10, 0.5, "vllm")
    assert min(lens) == 5 and max(lens) == 15
    lens = sample_lengths(rng, 4000, 10, 0.5, "sglang")
    assert min(lens) == 5 and max(lens) == 10


def test_random_ids_exact_and_text_prompts():
    rng = np.random.default_rng(1)
    reqs = random_id_requests(20, 64, 8, 0.5, "sglang", rng)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.input_len for r in reqs)
    assert all(32 <= r.input_len <= 64 and 4 <= r.output_len <= 8 for r in reqs)
    text = random_requests(5, 30, 4, 1.0, "sglang", rng)
    assert all(len(r.prompt.split()) == 30 for r in text)
    assert len({r.prompt for r in text}) == 5


def test_random_text_has_exact_token_length_with_a_tokenizer():
    from graphserve.bench.datasets import load_tokenizer

    tok = load_tokenizer("builtin:tiny-llama")
    for seed in range(6):
        targets = sample_lengths(np.random.default_rng(seed), 16, 120, 0.2, "sglang")  # the draw random_requests makes first
        reqs = random_requests(16, 120, 4, 0.2, "sglang", np.random.default_rng(seed), tok)
        assert [len(tok.encode(r.prompt, add_special_tokens=False)) for r in reqs] == targets
        assert [r.input_len for r in reqs] == targets
        assert len({r.prompt for r in reqs}) == 16


def test_sharegpt_from_local_file(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "please tell me a story about dragons"},
                           {"from": "gpt", "value": "once upon a time there was a dragon"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there friend ok"}]},
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
        {"conversations": [{"from": "human", "value": "what is two plus two"},
                           {"from": "gpt", "value": "it is four my friend"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(str(path), 5, np.random.default_rng(0))
    assert len(reqs) == 5
    assert {r.prompt for r in reqs} == {"please tell me a story about dragons", "what is two plus two"}
    assert all(r.output_len == (8 if "dragons" in r.prompt else 5) for r in reqs)
    fixed = sharegpt_requests(str(path), 2, np.random.default_rng(0), output_len=7)
    assert [r.output_len for r in fixed] == [7, 7]
    with pytest.raises(BadRequestError, match="dataset_path"):
        sharegpt_requests(str(tmp_path / "missing.json"), 1, np.random.default_rng(0))
