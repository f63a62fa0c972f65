"""Incremental detokenization and the output processor (stop strings, hold-back, logprobs)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from graphserve.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, earliest_stop
from graphserve.engine.request import CoreOutput, EngineRequest
from graphserve.models.synthetic_tokenizer import build_synthetic_tokenizer
from graphserve.outputs import TokenLogprob
from graphserve.sampling_params import SamplingParams

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


# ---- OutputProcessor --------------------------------------------------------------------------


def _processor(tok, params: SamplingParams, rid="r1"):
    from graphserve.engine.processor import OutputProcessor

    proc = OutputProcessor(tok)
    proc.add(EngineRequest(rid, [0], params, arrival_time=0.0, prompt_text="p"))
    return proc


def _stream(proc, tok, text: str, rid="r1", index=0, finish_last=None):
    outs = []
    ids = tok.encode(text, add_special_tokens=False)
    for i, t in enumerate(ids):
        finish = finish_last if i == len(ids) - 1 else None
        outs.append(proc.process([CoreOutput(rid, index, [t], finish_reason=finish)]))
    return outs


def test_stop_string_cuts_text_and_asks_the_core_to_abort(byte_tok):
    proc = _processor(byte_tok, SamplingParams(stop=["STOP", "wörld"], max_tokens=100))
    results = _stream(proc, byte_tok, "hello wörld and more")
    texts = [r[0][0].text for r in results if r[0]]
    finished = [(r[0][0], r[1]) for r in results if r[0] and r[0][0].finished]
    out, to_abort = finished[0]
    assert out.text == "hello " and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == "wörld" and to_abort == ["r1"]
    for a, b in zip(texts, texts[1:]):  # streamed text only ever grows: nothing is retracted
        assert b.startswith(a)
    assert all("w" not in t for t in texts)  # a possible stop prefix is held back
    assert not proc.has_unfinished()


def test_core_finish_reason_and_logprobs_pass_through(byte_tok):
    proc = _processor(byte_tok, SamplingParams(logprobs=1, max_tokens=2))
    lp = TokenLogprob(5, -0.5, [(5, -0.5)])
    outs, to_abort = proc.process([CoreOutput("r1", 0, [byte_tok.encode("a", add_special_tokens=False)[0]],
                                              new_logprobs=[lp], finish_reason="length", num_cached_tokens=3)])
    out = outs[0]
    assert out.finished and out.finish_reason == "length" and out.text == "a" and to_abort == []
    assert out.outputs[0].logprobs == [lp] and out.metrics.num_cached_tokens == 3
    assert out.metrics.first_token_time is not None and out.metrics.finished_time is not None


def test_n_choices_finish_independently(byte_tok):
    proc = _processor(byte_tok, SamplingParams(n=2, stop=["x"], max_tokens=5))
    a, x = byte_tok.encode("ax", add_special_tokens=False)
    outs, to_abort = proc.process([CoreOutput("r1", 0, [a]), CoreOutput("r1", 1, [x])])
    assert [o.finish_reason for o in outs[0].outputs] == [None, "stop"] and not outs[0].finished
    assert to_abort == []
    outs, to_abort = proc.process([CoreOutput("r1", 0, [a], finish_reason="length"), CoreOutput("r1", 1, [a])])
    assert outs[0].finished and [o.text for o in outs[0].outputs] == ["aa", ""]
    assert to_abort == ["r1"]  # choice 1 is still running in the core


def test_error_output_finishes_the_request(byte_tok):
    proc = _processor(byte_tok, SamplingParams(n=2))
    outs, _ = proc.process([CoreOutput("r1", 0, [], finish_reason="abort", error="RuntimeError: boom")])
    assert outs[0].finished and outs[0].error == "RuntimeError: boom"
    assert [o.finish_reason for o in outs[0].outputs] == ["abort", "abort"]


@pytest.mark.parametrize("text", [TEXT, "ok日"[:3]])
def test_offline_outputs_decode_once_at_the_end_to_the_streamed_text(byte_tok, text):
    from graphserve.engine.processor import OutputProcessor

    params = SamplingParams(max_tokens=100)
    ids = byte_tok.encode(text, add_special_tokens=False)
    if text != TEXT:
        ids = ids[:-1]  # ends inside a multi-byte character: the flush shows it as U+FFFD
    finals = {}
    for stream in (True, False):
        proc = OutputProcessor(byte_tok, stream=stream)
        proc.add(EngineRequest("r", [0], params, arrival_time=0.0))
        per_step = [proc.process([CoreOutput("r", 0, [t], finish_reason="length" if i == len(ids) - 1 else None)])[0]
                    for i, t in enumerate(ids)]
        assert all(per_step[i] for i in range(len(ids))) if stream else not any(per_step[:-1])
        finals[stream] = per_step[-1][0]
    assert finals[False].text == finals[True].text == byte_tok.decode(ids)
    assert finals[False].outputs[0].token_ids == ids and finals[False].finished


def test_earliest_stop_takes_the_first_occurrence_from_start():
    assert earliest_stop("say END or STOP", ["STOP", "END"]) == (4, "END")  # earliest wins, not first listed
    assert earliest_stop("abcab", ["ab", "b"], start=1) == (1, "b")  # the "ab" at 0 lies before start
    assert earliest_stop("xx", ["x", "xx"]) == (0, "x")  # a tie goes to the one listed first
    assert earliest_stop("nothing here", ["END"]) is None
