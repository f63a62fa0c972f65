"""Structured output and tool calls through the HTTP API with the official openai client (and httpx for
SGLang's /generate): builtin:tiny-llama's random weights produce valid output only by the constraint."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_utils import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=14)
    unit: Literal["celsius", "fahrenheit"]


def check_forecast(args: dict) -> None:
    assert set(args) == {"city", "days", "unit"}
    assert isinstance(args["city"], str) and len(args["city"]) <= 8
    assert 1 <= args["days"] <= 14 and args["unit"] in ("celsius", "fahrenheit")


def check_call(name: str, args: dict) -> None:
    if name == "get_weather":
        check_forecast(args)
    else:
        assert name == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("structured"), "--served-model-name", "tiny",
                        "--overlap-schedule", "on").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def streamed(client, **kw) -> tuple[str, dict[int, dict], str | None]:
    """(content, tool calls by index with their arguments joined, finish_reason) of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                call["id"] = tc.id
            if tc.function and tc.function.name:
                call["name"] = tc.function.name
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    for seed, temp in ((1, 0.0), (2, 1.0)):
        kw = dict(messages=MESSAGES, response_format=rf, max_tokens=80, temperature=temp, seed=seed)
        if stream:
            text, _, finish = streamed(client, **kw)
        else:
            r = client.chat.completions.create(model="tiny", **kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop"
        check_forecast(json.loads(text))


def test_parse_with_a_pydantic_model(client):
    r = client.beta.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Forecast,
                                           max_tokens=80, temperature=0.8, seed=5, n=3)
    assert len(r.choices) == 3
    for choice in r.choices:
        assert isinstance(choice.message.parsed, Forecast)
        check_forecast(choice.message.parsed.model_dump())


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required(client, stream):
    # one call (parallel_tool_calls=False): random weights would otherwise add calls until max_tokens
    kw = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0.7, seed=11,
              parallel_tool_calls=False)
    if stream:
        content, by_index, finish = streamed(client, **kw)
        calls = [(c["name"], c["arguments"], c["id"]) for _, c in sorted(by_index.items())]
    else:
        r = client.chat.completions.create(model="tiny", **kw)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        content = msg.content
        calls = [(tc.function.name, tc.function.arguments, tc.id) for tc in msg.tool_calls]
    assert finish == "tool_calls" and not content and len(calls) == 1
    for name, arguments, call_id in calls:
        assert call_id.startswith("call_")
        check_call(name, json.loads(arguments))


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice(client, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=1.0, seed=3)
    if stream:
        _, by_index, finish = streamed(client, **kw)
        assert list(by_index) == [0]
        name, arguments = by_index[0]["name"], by_index[0]["arguments"]
    else:
        r = client.chat.completions.create(model="tiny", **kw)
        finish, (tc,) = r.choices[0].finish_reason, r.choices[0].message.tool_calls
        name, arguments = tc.function.name, tc.function.arguments
    assert finish == "stop" and name == "get_weather"
    check_forecast(json.loads(arguments))


def test_guided_fields_and_tool_choice_none(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=1.0, seed=4, n=3,
                                       extra_body={"guided_choice": ["sunny", "rainy day"]})
    assert {c.message.content for c in r.choices} <= {"sunny", "rainy day"}
    r = client.completions.create(model="tiny", prompt="Code:", max_tokens=20, temperature=1.0, seed=4,
                                  extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{2}"})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                       max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_native_generate_regex_and_json_schema(server):
    body = {"text": "ID:", "sampling_params": {"max_new_tokens": 30, "temperature": 1.0, "regex": r"[0-9]{4}"}}
    r = httpx.post(server.base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200 and re.fullmatch(r"[0-9]{4}", r.json()["text"])
    body["sampling_params"] = {"max_new_tokens": 80, "json_schema": json.dumps(SCHEMA), "sampling_seed": 9}
    r = httpx.post(server.base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "stop"
    check_forecast(json.loads(r.json()["text"]))


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_constraints_are_400_naming_the_field(server, extra, param):
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
