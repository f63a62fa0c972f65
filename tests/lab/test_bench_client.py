"""`graphserve bench` against the simulated server: three wire formats, streamed and not."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from fake_server import FakeServer  # noqa: E402

from graphserve.bench import client  # noqa: E402
from graphserve.bench.scrape import normalize  # noqa: E402


@pytest.fixture(scope="module")
def server_url():
    with FakeServer("--a-ms", "5", "--b-ms", "1") as url:
        yield url


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    client.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("backend,client_mode", [("openai", "lines"), ("openai-chat", "lines"), ("native", "lines"),
                                                 ("openai", "every-event"), ("native", "every-event")])
@pytest.mark.parametrize("stream", [True, False])
def test_bench_backends(server_url, backend, client_mode, stream):
    argv = ["--base-url", server_url, "--backend", backend, "--num-prompts", "12", "--max-concurrency", "4",
            "--random-input-len", "16", "--random-output-len", "6", "--random-range-ratio", "0.5",
            "--disable-tqdm", "--client", client_mode] + ([] if stream else ["--disable-stream"])
    res = client.bench_once(_args(*argv), server_url, 12)
    assert set(res) == {"config", "environment", "summary", "requests", "server_metrics", "client_health"}
    s = res["summary"]
    assert (s["completed"], s["failed"]) == (12, 0)
    assert res["config"]["model"] == (None if backend == "native" else "fake-model")  # from /v1/models
    for r in res["requests"]:
        assert {"ttft_ms", "tpot_ms", "e2e_ms", "itl_ms", "chunk_itl_ms", "output_tokens", "input_tokens",
                "start", "end", "ok", "error"} <= set(r)
        assert r["output_tokens"] == r["requested_tokens"] and 3 <= r["output_tokens"] <= 6  # ignore_eos
        assert r["output_tokens_source"] == "server"
        if stream:
            assert r["ttft_ms"] > 0 and r["tpot_ms"] > 0
            assert len(r["itl_ms"]) == r["output_tokens"] - 1
        else:
            assert r["ttft_ms"] is None and r["tpot_ms"] is None and r["itl_ms"] == []
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in res["requests"])
    assert (s["tpot_ms"] is not None) == stream
    assert 1.0 < s["achieved_concurrency"] <= 4.0
    sm = res["server_metrics"]
    assert sm["engine"] == "graphserve" and sm["error"] is None
    assert sm["deltas"]["generation_tokens_total"] >= s["total_output_tokens"]
    assert res["client_health"]["loop_lag_ms"]["n"] > 0
    json.dumps(res)  # the result is plain JSON


def test_every_event_reader_splits_events_at_any_chunk_boundary():
    import asyncio
    import random

    from graphserve.bench.backends import iter_sse_data

    events = [json.dumps({"choices": [{"text": "x" * i}]}).encode() for i in range(30)] + [b"[DONE]"]
    body = b"".join(b"data: " + e + b"\n\n" for e in events)

    class Content:  # aiohttp's StreamReader, as far as the reader uses it: raw chunks of any size
        def __init__(self, cuts: list[int]):
            self.parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]

        async def iter_any(self):
            for part in self.parts:
                yield part

    async def read(content: Content) -> list[bytes]:
        return [d async for d in iter_sse_data(content)]

    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(body)), rng.randrange(1, 40)))
        assert asyncio.run(read(Content(cuts))) == events
    assert asyncio.run(read(Content([]))) == events


def test_cli_writes_and_appends(server_url, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    argv = ["--base-url", server_url, "--backend", "native", "--dataset-name", "random-ids", "--num-prompts", "4",
            "--random-input-len", "8", "--random-output-len", "3", "--random-range-ratio", "1", "--disable-tqdm",
            "--request-rate", "200", "--output-file", str(out), "--append"]
    assert client.run(_args(*argv)) == 0
    assert client.run(_args(*argv)) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["config"]["request_rate"] == 200 and first["config"]["dataset_name"] == "random-ids"
    assert all(r["input_tokens"] == 8 for r in first["requests"])
    assert "output throughput" in capsys.readouterr().out


def test_scrape_series_during_a_longer_run(server_url):
    argv = ["--base-url", server_url, "--num-prompts", "8", "--max-concurrency", "2", "--random-input-len", "4",
            "--random-output-len", "60", "--random-range-ratio", "1", "--disable-tqdm", "--warmup-requests", "0"]
    res = client.bench_once(_args(*argv), server_url, 8)
    series = res["server_metrics"]["series"]
    # scraped every second during the run (plus before/after): at least one point per elapsed second
    assert len(series) >= int(res["summary"]["duration_s"])
    assert any(p["running"] >= 1 for p in series)


def test_normalize_engine_names():
    vllm = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
            '# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{model_name="m"} 120\n')
    values, engine = normalize(vllm)
    assert engine == "vllm" and values == {"running": 3.0, "kv_usage": 0.25, "generation_tokens_total": 120.0}
    sglang = ("# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs 5\n"
              "# TYPE sglang:token_usage gauge\nsglang:token_usage 0.5\n")
    values, engine = normalize(sglang)
    assert engine == "sglang" and values == {"waiting": 5.0, "kv_usage": 0.5}
    pages = ("# TYPE graphserve:latent_pages_used gauge\ngraphserve:latent_pages_used 12\n"
             "# TYPE graphserve:latent_pages_total gauge\ngraphserve:latent_pages_total 40\n"
             "# TYPE graphserve:num_preemptions_latent_pages counter\ngraphserve:num_preemptions_latent_pages_total 2\n")
    values, engine = normalize(pages)
    assert engine == "graphserve"
    assert values == {"latent_pages_used": 12.0, "latent_pages_total": 40.0, "preemptions_for_latent_pages": 2.0}


def test_random_ids_sent_as_text_as_bench_serving_sends_them():
    import numpy as np

    from graphserve.bench.datasets import build_requests
    from graphserve.errors import GraphserveError
    from graphserve.models.loader import load_tokenizer

    base = ["--dataset-name", "random-ids", "--num-prompts", "3", "--random-input-len", "8",
            "--random-range-ratio", "1", "--random-ids-as", "text"]
    with pytest.raises(GraphserveError, match="random_ids_as.*--tokenizer"):
        client.check_load_args(_args(*base))
    with pytest.raises(GraphserveError, match="random_ids_as.*random-ids"):
        client.check_load_args(_args("--random-ids-as", "text", "--tokenizer", "builtin:tiny-llama"))
    args = _args(*base, "--tokenizer", "builtin:tiny-llama")
    client.check_load_args(args)
    tok = load_tokenizer("builtin:tiny-llama")
    ids = build_requests(_args(*base[:-2]), 3, np.random.default_rng(0), tok)
    texts = build_requests(args, 3, np.random.default_rng(0), tok)
    assert [r.prompt for r in texts] == [tok.decode(r.prompt) for r in ids]
    assert all(isinstance(r.prompt, str) and r.prompt for r in texts)
