"""Incremental detokenization and the output processor (stop strings, hold-back, logprobs)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from graphserve.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, earliest_stop
from graphserve.engine.output_processor import OutputProcessor
from graphserve.engine.request import CoreOutput
from graphserve.engine.step_outputs import StepOutputs
from graphserve.engine.stop_strings import StopChecker
from graphserve.models.synthetic_tokenizer import build_synthetic_tokenizer
from graphserve.outputs import TokenLogprob
from graphserve.sampling_params import SamplingParams
from graphserve.structured.tool_calls import ToolChoice

TEXT = "héllo wörld: 日本語 🙂 ok"


@pytest.fixture(scope="module")
def byte_tok() -> PreTrainedTokenizerFast:
    """Byte-level tokens only (no merges): every multi-byte character spans several ids."""
    return build_synthetic_tokenizer(400, {0: "<s>", 1: "</s>"}, "<s>", "</s>")


def _feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([t]) for t in ids]


def test_token_by_token_equals_full_decode_and_never_breaks_a_character(byte_tok):
    ids = byte_tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT)  # multi-byte characters really are split
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("prompt:", add_special_tokens=False))
    deltas = _feed(detok, ids)
    assert "".join(deltas) == TEXT == detok.text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_incomplete_character_is_held_back(byte_tok):
    ids = byte_tok.encode("日", add_special_tokens=False)
    assert len(ids) == 3
    detok = IncrementalDetokenizer(byte_tok, [5])
    assert _feed(detok, ids) == ["", "", "日"]


def test_flush_at_finish_returns_a_tail_no_token_can_complete(byte_tok):
    ids = byte_tok.encode("ok日", add_special_tokens=False)[:-1]  # "ok" + two of the three bytes of 日
    detok = IncrementalDetokenizer(byte_tok, [5])
    assert "".join(_feed(detok, ids)) == "ok"
    tail = detok.flush()
    assert tail and set(tail) == {REPLACEMENT_CHAR}
    assert detok.text == byte_tok.decode(ids)


def test_special_tokens_skipped_or_kept(byte_tok):
    ids = byte_tok.encode("ab", add_special_tokens=False) + [1]
    assert "".join(_feed(IncrementalDetokenizer(byte_tok, [0]), ids)) == "ab"
    kept = IncrementalDetokenizer(byte_tok, [0], skip_special_tokens=False)
    assert "".join(_feed(kept, ids)) == "ab</s>"


def test_leading_space_survives_sentencepiece_style_decoding():
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert hf.decode([2]) == "world"  # decoded alone the space is lost...
    detok = IncrementalDetokenizer(hf, [1])
    assert _feed(detok, [2, 3]) == [" world", " again"]  # ...but not with context


# ---- OutputProcessor (the one output path of LLM and the server) -----------------------------------------


def _rows(*outputs: CoreOutput) -> StepOutputs:
    rows = StepOutputs()
    rows.add_core_outputs(list(outputs), set())
    return rows


def test_core_finish_reason_and_logprobs_pass_through(byte_tok):
    proc = OutputProcessor(byte_tok)
    proc.add("r1", [0], SamplingParams(logprobs=1, max_tokens=2))
    (a,) = byte_tok.encode("a", add_special_tokens=False)
    lp = TokenLogprob(a, -0.5, [(a, -0.5), (7, -1.5)])
    (d,) = proc.process(_rows(CoreOutput("r1", 0, [a], new_logprobs=[lp], finish_reason="length",
                                         num_cached_tokens=3)))
    c = d.choices[0]
    assert d.finished and c.finish_reason == "length" and c.text == "a"
    assert c.logprobs == [lp] and d.num_cached_tokens == 3 and len(proc) == 0


def test_n_choices_finish_independently(byte_tok):
    proc = OutputProcessor(byte_tok)
    proc.add("r1", [0], SamplingParams(n=2, stop=["x"], max_tokens=5))
    a, x = byte_tok.encode("ax", add_special_tokens=False)
    (d,) = proc.process(_rows(CoreOutput("r1", 0, [a]), CoreOutput("r1", 1, [x], finish_reason="stop",
                                                                      stop_reason="x")))
    assert (d.choices[1].finish_reason, d.choices[1].stop_reason, d.choices[1].text) == ("stop", "x", "")
    assert d.choices[0].finish_reason is None and d.choices[0].text == "a" and not d.finished
    (d,) = proc.process(_rows(CoreOutput("r1", 0, [a], finish_reason="length")))
    assert d.finished and d.choices[0].text == "a" and 1 not in d.choices and len(proc) == 0


def test_error_output_finishes_the_request(byte_tok):
    proc = OutputProcessor(byte_tok)
    proc.add("r1", [0], SamplingParams(n=2))
    (d,) = proc.process(_rows(CoreOutput("r1", 0, [], finish_reason="abort", error="RuntimeError: boom")))
    assert d.finished and d.error == "RuntimeError: boom" and len(proc) == 0


@pytest.mark.parametrize("text", [TEXT, "ok日"[:3]])
def test_offline_outputs_decode_once_at_the_end_to_the_streamed_text(byte_tok, text):
    params = SamplingParams(max_tokens=100)
    ids = byte_tok.encode(text, add_special_tokens=False)
    if text != TEXT:
        ids = ids[:-1]  # ends inside a multi-byte character: the flush shows it as U+FFFD
    finals = {}
    for stream in (True, False):
        proc = OutputProcessor(byte_tok)
        proc.add("r", [0], params, stream=stream)
        pieces = [proc.process(_rows(CoreOutput("r", 0, [t], finish_reason="length" if i == len(ids) - 1 else None)))
                  for i, t in enumerate(ids)]
        texts = [d[0].choices[0].text if d and 0 in d[0].choices else "" for d in pieces]
        assert any(texts[:-1]) if stream else not any(texts[:-1])
        finals[stream] = "".join(texts)
    assert finals[False] == finals[True] == byte_tok.decode(ids)


def _stream_tool_pieces(tok, tools: ToolChoice | None, text: str, merge: bool, step: int = 3):
    """(every delta's tool pieces in order, the last delta) of ``text`` streamed ``step`` tokens a step, the last
    step finishing with "stop"; ``merge``: a consumer that fell behind merges the deltas (RequestStream)."""
    proc = OutputProcessor(tok)
    proc.add("r", [0], SamplingParams(max_tokens=200), tools=tools)
    ids = tok.encode(text, add_special_tokens=False)
    steps = [ids[i:i + step] for i in range(0, len(ids), step)]
    deltas = [d.choices[0] for k, s in enumerate(steps)
              for d in proc.process(_rows(CoreOutput("r", 0, s, finish_reason="stop" if k == len(steps) - 1 else None)))]
    if merge:
        for later in deltas[1:]:
            deltas[0].merge(later)
        deltas = deltas[:1]
    pieces = [p for c in deltas for p in (c.tool_deltas or [])]
    return pieces, deltas, len(proc)


@pytest.mark.parametrize("merge", [False, True])
def test_tool_call_deltas_come_out_of_the_processor(byte_tok, merge):
    auto = ToolChoice("auto", ("f", "g"))
    text = 'Let me check.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    pieces, deltas, left = _stream_tool_pieces(byte_tok, auto, text, merge)
    assert "".join(p.get("content", "") for p in pieces) == "Let me check." and left == 0
    (call,) = [p["tool_calls"][0] for p in pieces if "tool_calls" in p]
    assert call["index"] == 0 and call["function"]["name"] == "f" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"x": 1}
    # the engine's reason stays on the choice (usage, metrics); the chat stream reports the call
    assert (deltas[-1].finish_reason, deltas[-1].tool_finish_reason) == ("stop", "tool_calls")
    assert "".join(c.text for c in deltas) == text  # the text itself is untouched
    if not merge:  # "<tool_call>" is held back from the start of the marker, never sent as content
        sent = "".join(p.get("content", "") for c in deltas[:6] for p in c.tool_deltas)
        assert sent == "Let me check." and "".join(c.text for c in deltas[:6]).endswith("<tool")

    pieces, deltas, _ = _stream_tool_pieces(byte_tok, auto, "plain <tool answer, no call", merge)
    assert "".join(p["content"] for p in pieces) == "plain <tool answer, no call"
    assert deltas[-1].tool_finish_reason == "stop"

    named = ToolChoice("named", ("f",), "f")
    pieces, deltas, _ = _stream_tool_pieces(byte_tok, named, '{"x": 12, "y": "z"}', merge)
    assert pieces[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert "".join(p["tool_calls"][0]["function"].get("arguments", "") for p in pieces) == '{"x": 12, "y": "z"}'
    assert deltas[-1].tool_finish_reason == "stop"

    for plain in (None, ToolChoice("none", ("f",))):
        _, deltas, _ = _stream_tool_pieces(byte_tok, plain, text, merge)
        assert all(c.tool_deltas is None and c.tool_finish_reason is None for c in deltas)


# ---- the engine's stop-string check --------------------------------------------------------------------------


def _first_stop(tok, ids: list[int], stops: list[str]) -> tuple[int, str] | None:
    """Brute force: the first token after which the decoded output holds a stop string, and which one."""
    for i in range(len(ids)):
        best = earliest_stop(tok.decode(ids[: i + 1], skip_special_tokens=True), stops)
        if best is not None:
            return i, best[1]
    return None


def _check_each(checker: StopChecker, prompt: list[int], ids: list[int], stops: list[str]):
    watch = checker.watch(prompt, stops, True)
    for i, t in enumerate(ids):
        (found,) = checker.check([(watch, t)])
        if found is not None:
            return i, found
    return None


@pytest.mark.parametrize("seed", range(4))
def test_stop_check_finds_the_token_that_completes_a_stop_string(byte_tok, seed):
    rng = random.Random(seed)
    alphabet = "ab日ö🙂 \n"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = [text[k : k + rng.randint(1, 4)] for k in (rng.randrange(20, 55), rng.randrange(5, 55))]
    ids = byte_tok.encode(text, add_special_tokens=False)
    want = _first_stop(byte_tok, ids, stops)
    assert want is not None
    assert _check_each(StopChecker(byte_tok), [5], ids, stops) == want


def test_stop_check_decodes_only_tokens_holding_part_of_a_character(byte_tok, monkeypatch):
    from graphserve.engine import stop_strings

    checker = StopChecker(byte_tok)
    checker.prepare()  # the token table: one decode of the whole vocabulary, before the count
    calls = []
    real = stop_strings.decode_windows
    monkeypatch.setattr(stop_strings, "decode_windows", lambda tok, w, skip: calls.append(len(w)) or real(tok, w, skip))
    ids = byte_tok.encode("aaaa aaaa aaaa aaXd", add_special_tokens=False)
    assert _check_each(checker, [5], ids, ["Xd"]) == (len(ids) - 1, "Xd")
    assert calls == []  # whole characters: each token reads as its table text
    ids = byte_tok.encode("a日Xd", add_special_tokens=False)
    assert len(ids) == 6 and _check_each(checker, [5], ids, ["日X"]) == (4, "日X")
    assert calls == [2, 2, 2]  # the three bytes of 日 each decode a window; "a", "X" and "d" do not


def test_stop_check_keeps_a_sentencepiece_tokens_leading_space():
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    checker = StopChecker(hf)
    assert _check_each(checker, [1], [3, 2, 3], ["n world"]) == (1, "n world")  # " world": its space counts
    assert _check_each(checker, [1], [3, 3], ["n "]) == (1, "n ")  # the space that ends "n " is the 2nd token's


def test_earliest_stop_takes_the_first_occurrence_from_start():
    assert earliest_stop("say END or STOP", ["STOP", "END"]) == (4, "END")  # earliest wins, not first listed
    assert earliest_stop("abcab", ["ab", "b"], start=1) == (1, "b")  # the "ab" at 0 lies before start
    assert earliest_stop("xx", ["x", "xx"]) == (0, "x")  # a tie goes to the one listed first
    assert earliest_stop("nothing here", ["END"]) is None
