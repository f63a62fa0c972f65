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
    assert not [name for name in m if "latent_page" in name]  # a model without latent pages exports none
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
    aborted = "graphserve:request_aborted_total{reason=cancelled}"
    aborted_before = metrics(server.base_url).get(aborted, 0.0)
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()  # held, not dropped: dropping the iterator would close the connection
        assert next(ln for ln in lines if ln.startswith("data: "))
        m = metrics(server.base_url)
        assert m["graphserve:num_requests_running"] == 1 and m["graphserve:kv_cache_usage_perc"] > 0
    # Leaving the block drops the connection mid-stream; the server must abort and free the request's blocks.
    freed = wait_for(lambda: (lambda m: m["graphserve:num_requests_running"] == 0
                              and m["graphserve:kv_cache_usage_perc"] == 0.0)(metrics(server.base_url)), timeout=15)
    assert freed
    time.sleep(0.2)
    generated = metrics(server.base_url)["graphserve:generation_tokens_total"] - before
    assert generated < 480  # stopped early, not run to max_tokens
    assert metrics(server.base_url)[aborted] == aborted_before + 1  # counted, not lost


def test_disconnect_while_waiting_for_a_full_response_aborts(server):
    before = metrics(server.base_url)["graphserve:generation_tokens_total"]
    body = json.dumps({"prompt": "long", "max_tokens": 480, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_for(lambda: metrics(server.base_url)["graphserve:num_requests_running"] == 1, timeout=10)
    # a loaded machine may take seconds to notice; the token count below tells an abort from a run to the end
    freed = wait_for(lambda: metrics(server.base_url)["graphserve:num_requests_running"] == 0, timeout=15)
    assert freed
    time.sleep(0.2)
    assert metrics(server.base_url)["graphserve:generation_tokens_total"] - before < 480


def test_engine_runs_the_overlap_schedule(server):
    assert "overlap schedule=on" in server.log()


# -- drop-in for existing clients ---------------------------------------------------------------------------


def test_chat_stream_first_chunk_carries_role_and_first_content(server):
    # vLLM's bench times TTFT from the first chunk: a role-only chunk sent before any token would cut it short
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "n": 2,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        chunks = [json.loads(e) for e in sse_events(resp)[:-1]]
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant" and mine[0]["delta"]["content"], mine[0]
        assert all("role" not in c["delta"] for c in mine[1:])


def test_chat_content_parts_join_and_images_are_refused(client):
    kw = dict(model="tiny", max_tokens=1, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(messages=[{"role": "user", "content": "Say something."}], **kw)
    parts = client.chat.completions.create(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Say "}, {"type": "text", "text": "something."}]}], **kw)
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], **kw)
    err = exc.value.body
    assert err["param"] == "messages[0].content" and "images are not supported" in err["message"], err


def test_chat_logprob_bytes_are_the_tokens_own(client):
    # A byte-level token inside a multi-byte character decodes alone to U+FFFD; its bytes must be its own.
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Write in any language"}],
                                       max_tokens=16, temperature=1.0, seed=3, logprobs=True, top_logprobs=20,
                                       extra_body={"ignore_eos": True})
    entries = [e for tok in r.choices[0].logprobs.content for e in [tok, *tok.top_logprobs]]
    partial = [e for e in entries if "\ufffd" in e.token]
    assert partial, "no partial-character token among 336 alternatives: pick another seed"
    for e in entries:
        raw = bytes(e.bytes)
        assert raw.decode("utf-8", errors="replace") == e.token, (e.token, raw)
        if "\ufffd" in e.token:
            assert raw != "\ufffd".encode(), e  # not the replacement character's bytes


def test_tiny_top_p_keeps_the_top_token(client):
    # 1e-46 is a valid float64 top_p that rounds to 0 in float32: it once masked every token and sampled id 0
    kw = dict(model="tiny", prompt="The sky is", max_tokens=8, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    assert client.completions.create(temperature=1.0, top_p=1e-46, seed=5, **kw).choices[0].text == greedy


def test_generate_prefill_only_then_flush_cache(server, tokenizer):
    prompt = "A long enough prompt to fill a few KV blocks of sixteen tokens each, for the prefix cache. " * 2
    assert len(tokenizer(prompt).input_ids) > 32
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 0}}
    first = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()
    assert first["text"] == "" and first["output_ids"] == []
    meta = first["meta_info"]
    assert meta["completion_tokens"] == 0 and meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["prompt_tokens"] == len(tokenizer(prompt).input_ids)
    again = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()
    assert again["meta_info"]["cached_tokens"] >= 32  # the prefill ran and its blocks were cached
    assert httpx.post(server.base_url + "/flush_cache", timeout=10).status_code == 200
    after = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()
    assert after["meta_info"]["cached_tokens"] == 0


def test_generate_logprobs(server):
    body = {"text": "The sky", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True, "logprob_start_len": -1}
    r = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()
    meta = r["meta_info"]
    out = meta["output_token_logprobs"]
    assert [tid for _, tid, _ in out] == r["output_ids"] and len(out) == 4
    assert all(lp <= 0 and isinstance(text, str) for lp, _, text in out)
    assert "".join(text for _, _, text in out) == r["text"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == 4 and all(len(t) == 3 for t in tops)
    assert all(t[0][1] == tid for t, (_, tid, _) in zip(tops, out))  # greedy: the chosen token is the top one
    assert meta["input_token_logprobs"] == []
    streamed = httpx.post(server.base_url + "/generate", json={**body, "logprob_start_len": 10**6}, timeout=60)
    assert streamed.json()["meta_info"]["output_token_logprobs"] == out


@pytest.mark.parametrize("extra, param", [
    ({"lora_path": "adapter-a"}, "lora_path"),
    ({"image_data": "data:image/png;base64,AAAA"}, "image_data"),
    ({"return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
])
def test_generate_refuses_what_it_does_not_implement(server, extra, param):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    body.update({k: ({**body[k], **v} if isinstance(v, dict) else v) for k, v in extra.items()})
    r = httpx.post(server.base_url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_generate_takes_sglang_bench_fields_that_ask_for_nothing(server):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True,
                                             "json_schema": None},
            "stream": False, "lora_path": None, "return_logprob": False, "logprob_start_len": -1, "log_metrics": True}
    r = httpx.post(server.base_url + "/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2


def test_side_routes(server, client, tokenizer):
    from transformers import AutoTokenizer

    info = httpx.get(server.base_url + "/get_model_info", timeout=10).json()
    assert info["model_path"] == "builtin:tiny-llama" and info["max_model_len"] == 512
    loaded = AutoTokenizer.from_pretrained(info["tokenizer_path"])
    assert loaded("hello there").input_ids == tokenizer("hello there").input_ids
    sinfo = httpx.get(server.base_url + "/get_server_info", timeout=10).json()
    assert sinfo["max_model_len"] == 512 and sinfo["max_total_num_tokens"] > 0 and sinfo["version"]
    assert httpx.get(server.base_url + "/health_generate", timeout=60).status_code == 200
    cards = httpx.get(server.base_url + "/v1/models").json()["data"]
    assert all(isinstance(c["created"], int) and c["max_model_len"] == 512 for c in cards)
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.created == cards[0]["created"]
    assert httpx.get(server.base_url + "/v1/models/gpt-9").status_code == 404


def test_telemetry_pages(server):
    first = httpx.get(server.base_url + "/v1/telemetry", params={"limit": 2}).json()
    assert len(first["records"]) == 2 and first["more"] and first["next_since"] == first["records"][-1]["step"]
    more = httpx.get(server.base_url + "/v1/telemetry", params={"since": first["next_since"], "limit": 2}).json()
    assert more["records"][0]["step"] > first["next_since"]
    assert httpx.get(server.base_url + "/v1/telemetry", params={"limit": 10**6}).status_code == 400


def test_errors_are_counted_and_logged_without_the_prompt(server):
    key = "graphserve:request_errors_total{code=400,reason=invalid_request_error}"
    before = metrics(server.base_url).get(key, 0.0)
    secret = "do-not-log-this-prompt"
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": secret, "max_tokens": 0},
                   headers={"x-request-id": "req-abc-123"}, timeout=10)
    assert r.status_code == 400 and r.headers["x-request-id"] == "req-abc-123"
    assert metrics(server.base_url)[key] == before + 1
    line = wait_for(lambda: [ln for ln in server.log().splitlines() if "request_id=req-abc-123" in ln])
    assert line and "status=400" in line[0] and "field=max_tokens" in line[0]
    assert secret not in server.log()
