"""The HTTP API through real clients: the official openai client, raw httpx, Prometheus' parser."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import openai
import pytest
from server_utils import ServerProcess, metrics, wait_for
from transformers import AutoTokenizer

from graphserve.models.builtin import ensure_builtin

STEP_LINE = re.compile(
    r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] Decode batch, #running-req: \d+, #token: \d+, token usage: \d+\.\d\d, "
    r"cuda graph: (True|False), gen throughput \(token/s\): \d+\.\d\d, #queue-req: \d+$"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    # the overlap schedule, as a GPU server runs by default (on CPU it is off unless asked for): every
    # API behaviour below, disconnects and stop strings included, holds with one step in flight
    srv = ServerProcess(d, "--step-log", str(d / "steps.jsonl"), "--served-model-name", "tiny",
                        "--overlap-schedule", "on").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))


def sse_events(resp: httpx.Response) -> list[str]:
    """The data payloads of an SSE body, checking the framing of every event on the way."""
    body = resp.read().decode()
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    for ev in events:
        assert ev.startswith("data: ") and "\n" not in ev, ev
    return [ev[len("data: "):] for ev in events]


def test_completion_counts_match_tokenizer(client, tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    # Greedy output is reproducible and its text is the tokens' text.
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text


def test_completion_stream_joins_to_full_text(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_n_and_prompt_list(client):
    r = client.completions.create(model="tiny", prompt=["a b c", "d e f"], n=2, max_tokens=3, temperature=1.0,
                                  seed=1, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12


def test_completion_token_id_prompt(client, tokenizer):
    ids = tokenizer("hello there").input_ids
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids)


def test_completion_stop_string(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[4:6] if len(full) > 6 else full[-1:]
    cut = full[: full.index(stop)]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=3, logprobs=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(v <= 0 for v in lp.token_logprobs)
    # keyed by token text, so two alternatives that decode alike collapse into one entry
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)


def test_chat_matches_stream(client, tokenizer):
    messages = [{"role": "user", "content": "Say something."}]
    kw = dict(model="tiny", messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tokenizer(templated).input_ids)
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_chat_n_logprobs_max_completion_tokens(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                       max_completion_tokens=4, logprobs=True, top_logprobs=1,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(len(c.logprobs.content) == 4 for c in r.choices)
    assert r.usage.completion_tokens == 12


def test_models_health_and_sse_framing(server):
    models = httpx.get(server.base_url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    assert httpx.get(server.base_url + "/health").status_code == 200
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_generate_native(server):
    body = {"text": "The sky", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()
    assert r["meta_info"]["completion_tokens"] == 5 and r["meta_info"]["finish_reason"]["type"] == "length"
    with httpx.stream("POST", server.base_url + "/generate", json={**body, "stream": True}, timeout=60) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert texts[-1] == r["text"] and chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_metrics_and_telemetry(server):
    m = metrics(server.base_url)
    for name in ("graphserve:num_requests_running", "graphserve:num_requests_waiting",
                 "graphserve:kv_cache_usage_perc", "graphserve:prefix_cache_hit_rate",
                 "graphserve:num_preemptions_total", "graphserve:time_to_first_token_seconds_count",
                 "graphserve:inter_token_latency_seconds_count", "graphserve:e2e_request_latency_seconds_count",
                 "graphserve:request_queue_time_seconds_count"):
        assert name in m, name
    assert m["graphserve:generation_tokens_total"] > 0 and m["graphserve:prompt_tokens_total"] > 0
    assert m["graphserve:decode_steps_total{graph=false}"] > 0
    for name in ("e2e_request_latency", "time_to_first_token", "inter_token_latency", "request_queue_time"):
        assert m[f"graphserve:{name}_seconds_count"] > 0, name
    recs = httpx.get(server.base_url + "/v1/telemetry").json()["records"]
    assert recs and {"step", "batch_size", "graph", "step_ms", "kv_usage"} <= set(recs[0])
    since = recs[-2]["step"]
    later = httpx.get(server.base_url + "/v1/telemetry", params={"since": since}).json()["records"]
    assert later[0]["step"] == recs[-1]["step"] and all(r["step"] > since for r in later)


def test_step_log_line_and_jsonl(server, tmp_path_factory):
    httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 12, "ignore_eos": True},
               timeout=60)
    lines = wait_for(lambda: [ln for ln in server.log().splitlines() if "Decode batch" in ln])
    assert lines and all(STEP_LINE.match(ln) for ln in lines), lines[:3]
    jsonl = [json.loads(ln) for ln in open(server.args[server.args.index("--step-log") + 1])]
    assert jsonl and {"step", "kind", "step_ms", "graph"} <= set(jsonl[0])


def test_disconnect_mid_stream_frees_everything(server):
    body = {"prompt": "long", "max_tokens": 480, "ignore_eos": True, "stream": True}
    before = metrics(server.base_url)["graphserve:generation_tokens_total"]
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()  # held, not dropped: dropping the iterator would close the connection
        assert next(ln for ln in lines if ln.startswith("data: "))
        m = metrics(server.base_url)
        assert m["graphserve:num_requests_running"] == 1 and m["graphserve:kv_cache_usage_perc"] > 0
    # Leaving the block drops the connection mid-stream; the server must abort and free the request's blocks.
    freed = wait_for(lambda: (lambda m: m["graphserve:num_requests_running"] == 0
                              and m["graphserve:kv_cache_usage_perc"] == 0.0)(metrics(server.base_url)), timeout=5)
    assert freed
    time.sleep(0.2)
    generated = metrics(server.base_url)["graphserve:generation_tokens_total"] - before
    assert generated < 480  # stopped early, not run to max_tokens


def test_disconnect_while_waiting_for_a_full_response_aborts(server):
    before = metrics(server.base_url)["graphserve:generation_tokens_total"]
    body = json.dumps({"prompt": "long", "max_tokens": 480, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_for(lambda: metrics(server.base_url)["graphserve:num_requests_running"] == 1, timeout=10)
    freed = wait_for(lambda: metrics(server.base_url)["graphserve:num_requests_running"] == 0, timeout=5)
    assert freed
    time.sleep(0.2)
    assert metrics(server.base_url)["graphserve:generation_tokens_total"] - before < 480


def test_engine_runs_the_overlap_schedule(server):
    assert "overlap schedule=on" in server.log()
