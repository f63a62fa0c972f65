"""The server's output path without a server: flat step batches, detokenized deltas, merging streams."""

from __future__ import annotations

import asyncio
import random

import pytest

from graphserve.engine.output_processor import OutputProcessor, RequestDelta
from graphserve.engine.request import CoreOutput
from graphserve.engine.step_outputs import StepOutputs
from graphserve.models.loader import load_tokenizer
from graphserve.outputs import TokenLogprob
from graphserve.sampling_params import SamplingParams
from graphserve.server.request_stream import RequestStream


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:tiny-llama")


def rows(rid: str, tokens: list[int], finish: str | None = None, logprob: bool = False,
         stop_reason: str | None = None) -> StepOutputs:
    out = StepOutputs()
    reported: set[str] = set()
    for i, t in enumerate(tokens):
        last = i == len(tokens) - 1
        lp = [TokenLogprob(t, -0.5, [(t, -0.5)])] if logprob else None
        out.add_core_outputs([CoreOutput(rid, 0, [t], lp, finish if last else None, stop_reason if last else None,
                                         3, 1)], reported)
    return out


def test_step_outputs_merge_keeps_each_rows_extras():
    a = StepOutputs()
    seen: set[str] = set()
    a.add_core_outputs([CoreOutput("r1", 0, [5], None, None, None, 3, 0, first_scheduled_time=1.0)], seen)
    b = StepOutputs()
    b.add_core_outputs([CoreOutput("r2", 1, [], None, "abort", None, 3, 0),
                        CoreOutput("r1", 0, [6], [TokenLogprob(6, -1.0, [])], "length", None, 3, 0)], seen)
    a.extend(b)
    assert a.request_ids == ["r1", "r2", "r1"] and a.indices == [0, 1, 0] and a.token_ids == [5, -1, 6]
    assert a.finishes == {1: ("abort", None), 2: ("length", None)} and a.logprobs == {2: (-1.0, [])}
    assert a.first_seen["r1"] == (1.0, 0)


@pytest.mark.parametrize("merge", [False, True])
def test_deltas_join_to_the_tokenizers_text(tokenizer, merge):
    rng = random.Random(merge)
    ids = [rng.randrange(3, 1300) for _ in range(40)]
    proc = OutputProcessor(tokenizer)
    proc.add("r", [1, 2, 3], SamplingParams(max_tokens=40, logprobs=1))
    batches = [rows("r", ids[i:i + 1], "length" if i == len(ids) - 1 else None, logprob=True)
               for i in range(len(ids))]
    if merge:  # the server fell behind: every step arrives in one batch
        merged = StepOutputs()
        for b in batches:
            merged.extend(b)
        batches = [merged]
    text, got_ids, lps, finish = "", [], 0, None
    for b in batches:
        for d in proc.process(b):
            c = d.choices[0]
            text += c.text
            got_ids += c.token_ids
            lps += len(c.logprobs or [])
            finish = c.finish_reason or finish
    assert got_ids == ids and lps == len(ids) and finish == "length"
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(proc) == 0  # finished requests are forgotten


@pytest.mark.parametrize("stream", [True, False])
def test_text_ends_where_the_engine_reported_the_stop_string(tokenizer, stream):
    """The engine finishes the request on the token that completes "world"; the text streamed before it never
    holds a piece of the stop string (it may still complete), and the final text ends just before it."""
    ids = tokenizer.encode("hello wonderful world, hello again", add_special_tokens=False)
    text = ""
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:end], skip_special_tokens=True)
        if "world" in text:
            break
    ids = ids[:end]
    proc = OutputProcessor(tokenizer)
    proc.add("r", [1], SamplingParams(max_tokens=100, stop=["world", "xyzzy"]), stream=stream)
    streamed, finish = [], None
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        for d in proc.process(rows("r", [t], "stop" if last else None, stop_reason="world" if last else None)):
            streamed.append(d.choices[0].text)
            finish = (d.choices[0].finish_reason, d.choices[0].stop_reason) if d.finished else finish
    assert "".join(streamed) == "hello wonderful " and finish == ("stop", "world") and len(proc) == 0
    # streamed: text went out while running (the join above shows none of "world" did); offline: decoded once
    assert any(streamed[:-1]) if stream else not any(streamed[:-1])


class _Engine:
    def __init__(self):
        self.aborted: list[str] = []

    def abort(self, engine_id: str) -> None:
        self.aborted.append(engine_id)


def delta(n: int, finished: bool = False) -> RequestDelta:
    from graphserve.engine.output_processor import ChoiceDelta

    return RequestDelta("e", {0: ChoiceDelta(0, "x" * n, list(range(n)))}, finished=finished)


def test_stream_merges_unread_deltas_and_honours_the_interval():
    async def run() -> None:
        eng = _Engine()
        s = RequestStream(eng, "rid", "e", 3)
        for _ in range(3):
            s.push(delta(1))
        d = await s.next()
        assert d.num_tokens == 3 and d.choices[0].text == "xxx"  # one event for what piled up
        assert s.stalled(10**9, 1.0) is False  # nothing unread
        s.push(delta(1))
        assert s.stalled(10**9, 1.0)  # unread output and nobody waiting for it

        t = RequestStream(eng, "rid", "e2", 3, stream_interval=4)
        t.push(delta(3))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(t.next(), 0.05)  # fewer than 4 tokens wait
        t.push(delta(2))
        assert (await t.next()).num_tokens == 5
        t.push(delta(1, finished=True))
        assert (await t.next()).finished  # the end goes out whatever the interval
        assert await t.next() is None and eng.aborted == []

    asyncio.run(run())


def test_an_error_naming_a_field_reaches_the_client_as_a_400_and_counts_as_an_abort(tokenizer):
    from graphserve.config import EngineConfig
    from graphserve.errors import BadRequestError, InternalError
    from graphserve.server.frontend import Frontend

    proc = OutputProcessor(tokenizer)
    for rid in ("bad", "broken"):
        proc.add(rid, [1, 2, 3], SamplingParams(max_tokens=8))
    outs = rows("bad", [9])  # a token first: the error row comes in a later, merged step
    failing = StepOutputs()
    failing.add_core_outputs([CoreOutput("bad", 0, [], None, "abort", None, 3, 0, error="guided_regex is invalid: x",
                                         error_param="guided_regex"),
                              CoreOutput("broken", 0, [], None, "abort", None, 3, 0, error="step raised")], set())
    outs.extend(failing)
    deltas = proc.process(outs)
    by_id = {d.request_id: d for d in deltas}
    assert (by_id["bad"].error_param, by_id["broken"].error_param) == ("guided_regex", None)

    async def run() -> None:
        eng = Frontend(EngineConfig(model="builtin:tiny-llama"))
        eng.client.abort = lambda ids: None  # no engine behind it
        aborted: list[tuple[str, object]] = []
        eng.on_abort = lambda rid, err: aborted.append((rid, err))
        streams = {}
        for engine_id, client_id in (("bad", "client-a"), ("broken", "client-b")):
            streams[engine_id] = eng._streams[engine_id] = RequestStream(eng, client_id, engine_id, 3)
            eng._client_ids[client_id] = engine_id
        eng._deliver(deltas, {})
        with pytest.raises(BadRequestError) as bad:
            await streams["bad"].next()
        assert bad.value.param == "guided_regex" and bad.value.http_status == 400
        with pytest.raises(InternalError):
            await streams["broken"].next()
        assert [rid for rid, _ in aborted] == ["client-a", "client-b"] and not eng._streams and not eng._client_ids

    asyncio.run(run())


def test_a_request_discarded_while_its_rows_are_processed_costs_no_other_request(tokenizer, monkeypatch):
    """The loop thread discards a failed request while the output thread processes a batch holding its rows
    (an injected engine fault did this): the batch still yields every other request's delta."""
    proc = OutputProcessor(tokenizer)
    proc.add("gone", [1, 2, 3], SamplingParams(max_tokens=4))
    proc.add("ok", [1, 2, 3], SamplingParams(max_tokens=4))
    batch = rows("gone", [7], "length")
    batch.extend(rows("ok", [8]))
    detokenize = proc._detokenize

    def discard_midway(work, outs):
        proc.discard("gone")  # what Frontend does on the loop thread when the request fails
        return detokenize(work, outs)

    monkeypatch.setattr(proc, "_detokenize", discard_midway)
    deltas = proc.process(batch)
    assert {d.request_id for d in deltas} == {"gone", "ok"}
    assert next(d for d in deltas if d.request_id == "ok").finished is False
    assert len(proc) == 1  # "ok" stays; "gone" is not brought back


def test_tool_chat_chunks_put_the_processors_pieces_in_openai_chunks(tokenizer):
    """A chat stream with tools: the role on the first chunk, one chunk per piece the output processor made, the
    call's arguments joining to the constrained text, the finish on the last piece, then the usage chunk."""
    import json

    from graphserve.server.serving_openai import _tool_chat_chunks
    from graphserve.server.streams import Job
    from graphserve.structured.tool_calls import ToolChoice

    class _Timer:
        def observe(self, d: RequestDelta) -> None:
            pass

    args = '{"city": "Paris", "days": 3}'
    ids = tokenizer.encode(args, add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add("e", [1, 2, 3], SamplingParams(max_tokens=len(ids)), tools=ToolChoice("named", ("get_weather",),
                                                                                    "get_weather"))

    async def run() -> list[dict]:
        stream = RequestStream(_Engine(), "rid", "e", 3)
        job = Job(0, stream, _Timer())
        for i, t in enumerate(ids):
            for d in proc.process(rows("e", [t], "length" if i == len(ids) - 1 else None)):
                stream.push(d)
        head = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        events = [e async for e in _tool_chat_chunks(None, [job], head, include_usage=True)]
        assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
        return [json.loads(e[len(b"data: "):]) for e in events]

    chunks = asyncio.run(run())
    *choices, tail = chunks
    deltas = [c["choices"][0]["delta"] for c in choices]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    call = deltas[0]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": ""} and call["id"].startswith("call_")
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == args
    assert [c["choices"][0]["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert tail["choices"] == [] and tail["usage"]["completion_tokens"] == len(ids)
