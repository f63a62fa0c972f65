"""The synthetic tokenizer of ``dummy:`` presets round-trips the ids text benchmark clients draw: decoded and encoded
again, a prompt of N ids is N ids (the issue measured 256 ids arriving as ~1,800 tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_utils import byte_alphabet

from graphserve.models.loader import load_tokenizer
from graphserve.models.synthetic_tokenizer import REPLACEMENT, REPLACEMENT_PAIR, build_synthetic_tokenizer

PRESETS = ["llama3-8b", "qwen3-0.6b", "mistral-7b"]  # specials at the top, at the top of 152k, at 0-2 of 32k
PROMPTS, LENGTH = 24, 256


@pytest.fixture(scope="module", params=PRESETS)
def tok(request):
    return load_tokenizer(f"dummy:{request.param}")


def lone_high_bytes(tok) -> set[int]:
    """Ids of the byte tokens 0x80-0xFF and of U+FFFD's first two bytes: parts of multi-byte characters, the one
    documented exception."""
    return {tok.convert_tokens_to_ids(s) for b, s in enumerate(byte_alphabet()) if b >= 0x80} | \
        {tok.convert_tokens_to_ids(REPLACEMENT_PAIR)}


def check_round_trip(tok, prompts: list[list[int]], high: set[int]) -> int:
    """Every prompt keeps its length, and every id but a lone 0x80-0xFF byte comes back itself; returns how many
    ids were such bytes (U+FFFD's one token in their place)."""
    replaced = 0
    for ids in prompts:
        back = tok.encode(tok.decode(ids), add_special_tokens=False)
        assert len(back) == len(ids)
        for a, b in zip(ids, back):
            if a != b:
                assert a in high and tok.convert_ids_to_tokens(b) == REPLACEMENT, (a, b)
                replaced += 1
    return replaced


def test_vllm_random_dataset_ids_round_trip(tok):
    """vLLM's random dataset: ids uniform over range(vocab_size) minus the special ids."""
    rng = np.random.default_rng(0)
    special = set(tok.all_special_ids)
    allowed = np.array([i for i in range(tok.vocab_size) if i not in special])
    prompts = [allowed[rng.integers(0, len(allowed), LENGTH)].tolist() for _ in range(PROMPTS)]
    high = lone_high_bytes(tok)
    replaced = check_round_trip(tok, prompts, high)
    assert replaced <= sum(i in high for p in prompts for i in p)


def test_sglang_random_ids_round_trip(tok):
    """SGLang's random-ids: runs of consecutive ids from a random offset, mod vocab_size, specials included; the
    runs through the byte block and through the specials are taken on purpose."""
    rng = np.random.default_rng(1)
    specials = sorted(tok.all_special_ids)
    offsets = [*rng.integers(0, tok.vocab_size, PROMPTS).tolist(), 0, 200, specials[0] - 5, tok.vocab_size - 100]
    prompts = [[(o + j) % tok.vocab_size for j in range(LENGTH)] for o in offsets]
    check_round_trip(tok, prompts, lone_high_bytes(tok))


def test_any_text_still_decodes_back_exactly(tok):
    text = "héllo wörld: 日本語 🙂 ok w12 w000123, \ufffd and <|im_end|> as plain text"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_word_followed_by_digit_bytes_stays_two_tokens():
    tok = build_synthetic_tokenizer(1000, {0: "<s>", 1: "</s>"}, "<s>", "</s>")
    word = 700
    digit = tok.convert_tokens_to_ids("7")
    text = tok.decode([word, digit, digit])
    assert text == " w70077"
    assert tok.encode(text, add_special_tokens=False) == [word, digit, digit]
    with pytest.raises(ValueError, match="vocab_size=259 is too small"):
        build_synthetic_tokenizer(259, {0: "<s>", 1: "</s>"}, "<s>", "</s>")


def test_graphserve_bench_random_ids_as_text_arrive_at_their_length():
    """``graphserve bench --dataset-name random-ids --random-ids-as text`` against a dummy: server."""
    from types import SimpleNamespace

    from graphserve.bench.datasets import build_requests

    tok = load_tokenizer("dummy:llama3-8b")
    args = SimpleNamespace(dataset_name="random-ids", random_input_len=256, random_output_len=8,
                           random_range_ratio=0.5, length_rule="sglang", random_ids_as="text")
    reqs = build_requests(args, 16, np.random.default_rng(2), tok)
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.input_len
