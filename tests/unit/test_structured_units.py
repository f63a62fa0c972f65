"""Structured output pieces without a model: the bitmask unpacking and its application in the sampler
(against a per-bit reference, with the other knobs still applied), request fields -> constraint, and
tool-call parsing and streaming deltas."""

from __future__ import annotations

import json

import pytest
import torch

from graphserve.engine.request import Sequence
from graphserve.engine.sampling_inputs import tensors_from_sequences
from graphserve.errors import BadRequestError
from graphserve.layers.sampler import Sampler, apply_token_mask, unpack_token_mask
from graphserve.sampling_params import SamplingParams
from graphserve.structured.requests import native_constraint, openai_constraint
from graphserve.structured.tool_calls import ToolChoice, chat_message, parse_tool_calls, tool_choice
from graphserve.structured.tool_stream import ToolCallStream


def tensors(vocab: int, params: list[SamplingParams]):
    seqs = [Sequence(f"r{i}", 0, [1, 2], p, seed=i, arrival_time=0.0) for i, p in enumerate(params)]
    return tensors_from_sequences(seqs, vocab, [0], "cpu")


def reference_unpack(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.zeros(mask.shape[0], vocab, dtype=torch.bool)
    for r in range(mask.shape[0]):
        for t in range(vocab):
            out[r, t] = bool((int(mask[r, t // 32]) >> (t % 32)) & 1)
    return out


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
def test_unpack_matches_per_bit_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(unpack_token_mask(mask, vocab), reference_unpack(mask, vocab))


def test_mask_applies_to_its_rows_only_and_sampling_stays_inside_it():
    g = torch.Generator().manual_seed(0)
    vocab, batch = 70, 4
    logits = torch.randn(batch, vocab, generator=g)
    mask = torch.randint(-(2**31), 2**31 - 1, (2, 3), generator=g, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([1, 3])
    t = tensors(vocab, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
                        SamplingParams(temperature=0.7, min_p=0.05), SamplingParams(temperature=1.3, top_k=40)])
    t.token_mask, t.mask_rows = mask, rows
    raw = logits.clone()
    masked = apply_token_mask(logits, t)
    allowed = reference_unpack(mask, vocab)
    assert torch.equal(masked[[0, 2]], raw[[0, 2]])  # unconstrained rows untouched
    assert torch.equal(torch.isinf(masked[rows]), ~allowed)
    assert torch.equal(logits, raw)  # out of place: the raw logits still feed logprobs
    for seed in range(20):
        t.seeds = torch.full((batch,), seed, dtype=torch.int64)
        ids = Sampler()(logits, t).token_ids
        assert allowed[0, ids[1]] and allowed[1, ids[3]]
    t.mask_rows, t.token_mask = None, torch.cat([mask, mask])
    ids = Sampler()(logits, t).token_ids
    assert all(reference_unpack(t.token_mask, vocab)[i, ids[i]] for i in range(batch))


def test_one_constraint_per_request_and_its_field():
    assert openai_constraint(guided_regex="a+").field == "guided_regex"
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}
    assert openai_constraint(response_format=rf).kind == "json_schema"
    assert openai_constraint(response_format={"type": "json_object"}).kind == "json_object"
    assert openai_constraint(response_format={"type": "text"}) is None
    with pytest.raises(BadRequestError, match="send at most one") as err:
        openai_constraint(guided_regex="a", guided_grammar='root ::= "a"')
    assert err.value.param == "guided_grammar"
    assert native_constraint(ebnf='root ::= "x"').field == "sampling_params.ebnf"
    with pytest.raises(BadRequestError) as err:
        native_constraint(json_schema_text="{not json")
    assert err.value.param == "sampling_params.json_schema"


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "g"}}]
AUTO = ToolChoice("auto", ("f", "g"))


def test_tool_choice_modes_and_their_constraints():
    assert tool_choice(None, None) == (None, None)
    mode, c = tool_choice(TOOLS, "required")
    assert mode.mode == "required" and json.loads(c.spec)["minItems"] == 1 and "maxItems" not in json.loads(c.spec)
    assert json.loads(tool_choice(TOOLS, "required", parallel=False)[1].spec)["maxItems"] == 1
    mode, c = tool_choice(TOOLS, {"type": "function", "function": {"name": "g"}})
    assert mode.named == "g" and json.loads(c.spec) == {"type": "object", "properties": {}}
    assert tool_choice(TOOLS, None)[0].mode == "auto" and tool_choice(TOOLS, "none")[1] is None
    with pytest.raises(BadRequestError) as err:
        tool_choice([{"type": "function", "function": {"name": "bad name!"}}], "auto")
    assert err.value.param == "tools[0].function.name"
    with pytest.raises(BadRequestError) as err:
        tool_choice(None, "required")
    assert err.value.param == "tool_choice"


@pytest.mark.parametrize("text, content, calls", [
    ('Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "Sure.", [("f", {"x": 1})]),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}'
     '</tool_call>', None, [("f", {"x": 1}), ("g", {})]),
    ('{"name": "f", "parameters": {"x": 2}}', None, [("f", {"x": 2})]),
    ('<|python_tag|>{"name": "f", "parameters": {"x": 2}}; {"name": "g", "parameters": {}}', None,
     [("f", {"x": 2}), ("g", {})]),
    ('{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}', []),
    ("just text", "just text", []),
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
])
def test_auto_parses_hermes_and_llama_formats(text, content, calls):
    got_content, got = parse_tool_calls(text, AUTO)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    message, reason = chat_message(text, "stop", AUTO)
    assert reason == ("tool_calls" if calls else "stop") and ("tool_calls" in message) == bool(calls)


def replay(choice: ToolChoice, text: str, step: int = 3) -> tuple[list[dict], str | None]:
    stream, deltas, reason = ToolCallStream(choice), [], None
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        out, reason = stream.feed(piece, i == len(pieces) - 1, "stop")
        deltas += out
    return deltas, reason


def test_streamed_deltas_rebuild_the_calls():
    text = 'Let me check.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    deltas, reason = replay(AUTO, text)
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    (call,) = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert reason == "tool_calls" and call["index"] == 0 and call["function"]["name"] == "f"
    assert json.loads(call["function"]["arguments"]) == {"x": 1} and call["id"].startswith("call_")
    deltas, reason = replay(AUTO, "plain <tool answer, no call")
    assert "".join(d["content"] for d in deltas) == "plain <tool answer, no call" and reason == "stop"
    named = ToolChoice("named", ("f",), "f")
    deltas, reason = replay(named, '{"x": 12}')
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""} and reason == "stop"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"x": 12}'


def test_noise_never_reaches_one_so_masked_tokens_never_win(monkeypatch):
    """A uniform of exactly 1.0 gives +inf Gumbel noise and NaN on a masked (-inf) logit, which argmax picks. The
    hash's extremes (every bit set, none set) are forced, so the largest and smallest draws are the ones checked,
    not whichever a sample happens to reach."""
    from graphserve.layers import sampler

    seeds, steps = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    u = sampler.uniform_noise(seeds, steps, 1 << 16)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0 and float(u.std()) > 0.25
    monkeypatch.setattr(sampler, "_mix", lambda z: torch.full_like(z, -1))  # every bit of the hash set
    assert float(sampler.uniform_noise(seeds, steps, 8).max()) < 1.0
    monkeypatch.setattr(sampler, "_mix", torch.zeros_like)  # none set
    assert float(sampler.uniform_noise(seeds, steps, 8).min()) > 0.0
