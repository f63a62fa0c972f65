"""Benchmark prompts: random text, random token ids, and a local ShareGPT file.

Length rule for ``--random-range-ratio`` r (lengths drawn uniformly, both ends included):
- ``sglang`` (default, what SGLang's bench_serving does): [int(len·r), len], so r=1 fixes the length.
- ``vllm`` (vLLM's rule): [floor(len·(1−r)), ceil(len·(1+r))] with 0 ≤ r < 1, so r=0 fixes it.
Lower bounds are clamped to 1 token: a zero-length prompt or output is not a request.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from graphserve.errors import bad_field

# Words used when no tokenizer is given: common English words are one token in every BPE
# vocabulary we serve, so N words is close to N prompt tokens (the server's count is recorded).
_WORDS = ("the of and to in is for on with as by at from this that are was be it or an have not "
          "they which one you had but all were we when there can more if no out so said what up its "
          "about into than them only other new some could time these two may then first any like").split()
# Token ids below 256 exist in every vocabulary we serve; used for random-ids without a tokenizer.
_SAFE_ID_RANGE = (10, 256)


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids for random-ids
    input_len: int  # prompt tokens as built (the server's own count replaces it when reported)
    output_len: int  # requested max new tokens


def length_bounds(length: int, ratio: float, rule: str = "sglang", field: str = "random_input_len") -> tuple[int, int]:
    if length < 1:
        raise bad_field(field, length, "must be >= 1")
    if rule == "sglang":
        if not 0.0 <= ratio <= 1.0:
            raise bad_field("random_range_ratio", ratio, "must be in [0, 1] with --length-rule sglang")
        return max(1, int(length * ratio)), length
    if rule == "vllm":
        if not 0.0 <= ratio < 1.0:
            raise bad_field("random_range_ratio", ratio, "must be in [0, 1) with --length-rule vllm")
        return max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio))
    raise bad_field("length_rule", rule, "choose sglang or vllm")


def sample_lengths(rng: np.random.Generator, n: int, length: int, ratio: float, rule: str = "sglang",
                   field: str = "random_input_len") -> list[int]:
    lo, hi = length_bounds(length, ratio, rule, field)
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def load_tokenizer(source: str | None) -> Any:
    """The tokenizer for ``--tokenizer`` (HF folder, ``builtin:NAME`` or ``dummy:PRESET``); None stays None."""
    if not source:
        return None
    from graphserve.models.loader import load_tokenizer as load_source_tokenizer

    return load_source_tokenizer(source)


def _usable_ids(tokenizer: Any) -> np.ndarray:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))
    return np.array([i for i in range(vocab) if i not in special], dtype=np.int64)


def _text_ids(tokenizer: Any) -> np.ndarray:
    """The usable ids that decode alone to printable text: a lone byte-fallback token decodes to U+FFFD, which
    re-encodes as three tokens, so a prompt built from one could not keep its length."""
    ids = _usable_ids(tokenizer)
    pieces = tokenizer.batch_decode([[int(i)] for i in ids])
    keep = [i for i, p in zip(ids, pieces) if p and "\ufffd" not in p and p.isprintable()]
    return np.array(keep, dtype=np.int64) if keep else ids


def _filler_id(tokenizer: Any) -> int | None:
    """A token that re-encodes as itself when repeated after any text (a space-led common word), or None."""
    for word in (" the", " a", " x"):
        ids = tokenizer.encode(word, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.encode(word * 4, add_special_tokens=False) == ids * 4:
            return ids[0]
    return None


def _exact_text(tokenizer: Any, ids: list[int], target: int, rng: np.random.Generator, pool: np.ndarray,
                filler: int | None) -> tuple[str, int]:
    """Decode ids to text whose re-encoding is ``target`` tokens. Decode/encode can merge or split tokens, so trim
    or top up and re-measure: random tokens first, then ``filler`` (``_filler_id``), a word that does not merge with
    its neighbours. Returns the text and its measured length (the target unless the tokenizer allows no such text)."""
    text = tokenizer.decode(ids)
    for attempt in range(16):
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc) == target:
            return text, target
        if len(enc) > target:
            enc = enc[:target]
        elif attempt < 8 or filler is None:
            enc = enc + [int(x) for x in rng.choice(pool, size=target - len(enc))]
        else:
            enc = enc + [filler] * (target - len(enc))
        text = tokenizer.decode(enc)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def random_requests(
    n: int, input_len: int, output_len: int, ratio: float, rule: str, rng: np.random.Generator, tokenizer: Any = None
) -> list[BenchRequest]:
    in_lens = sample_lengths(rng, n, input_len, ratio, rule)
    out_lens = sample_lengths(rng, n, output_len, ratio, rule, "random_output_len")
    reqs = []
    pool = _text_ids(tokenizer) if tokenizer is not None else None
    filler = _filler_id(tokenizer) if tokenizer is not None else None
    for i, (li, lo) in enumerate(zip(in_lens, out_lens)):
        if tokenizer is None:
            # A leading index keeps prompts distinct, so no prefix cache turns the run into a cache test.
            words = [str(i)] + [_WORDS[int(k)] for k in rng.integers(0, len(_WORDS), size=li - 1)]
            reqs.append(BenchRequest(" ".join(words), li, lo))
        else:
            ids = [int(x) for x in rng.choice(pool, size=li)]
            text, measured = _exact_text(tokenizer, ids, li, rng, pool, filler)
            reqs.append(BenchRequest(text, measured, lo))
    return reqs


def random_id_requests(
    n: int, input_len: int, output_len: int, ratio: float, rule: str, rng: np.random.Generator, tokenizer: Any = None
) -> list[BenchRequest]:
    """Prompts as token ids: exactly the sampled length, no decode/encode round trip."""
    in_lens = sample_lengths(rng, n, input_len, ratio, rule)
    out_lens = sample_lengths(rng, n, output_len, ratio, rule, "random_output_len")
    pool = _usable_ids(tokenizer) if tokenizer is not None else np.arange(*_SAFE_ID_RANGE)
    return [BenchRequest([int(x) for x in rng.choice(pool, size=li)], li, lo) for li, lo in zip(in_lens, out_lens)]


def _count(tokenizer: Any, text: str) -> int:
    if tokenizer is None:
        return len(text.split())
    return len(tokenizer.encode(text, add_special_tokens=False))


def sharegpt_requests(
    path: str, n: int, rng: np.random.Generator, tokenizer: Any = None, output_len: int | None = None,
    max_prompt_len: int = 1024, max_total_len: int = 2048,
) -> list[BenchRequest]:
    """First human turn as prompt, the reply's length as the output length (or ``output_len``).
    Pairs shorter than 4 tokens either side, or longer than the limits, are skipped."""
    if not path or not os.path.isfile(path):
        raise bad_field("dataset_path", path, "must be a local ShareGPT JSON file (nothing is downloaded)")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    order = rng.permutation(len(data))
    reqs: list[BenchRequest] = []
    for idx in order:
        turns = data[int(idx)].get("conversations") or data[int(idx)].get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        p_len = _count(tokenizer, prompt)
        o_len = output_len or _count(tokenizer, reply)
        if p_len < 4 or o_len < 4 or p_len > max_prompt_len or p_len + o_len > max_total_len:
            continue
        reqs.append(BenchRequest(prompt, p_len, o_len))
        if len(reqs) == n:
            break
    if not reqs:
        raise bad_field("dataset_path", path, "holds no usable conversation (need a human turn and a reply of >= 4 tokens)")
    found = len(reqs)
    while len(reqs) < n:  # a small file is reused in order rather than shrinking the run
        reqs.append(reqs[len(reqs) % found])
    return reqs


def build_requests(args: Any, n: int, rng: np.random.Generator, tokenizer: Any = None) -> list[BenchRequest]:
    name = args.dataset_name
    if name == "random":
        return random_requests(n, args.random_input_len, args.random_output_len, args.random_range_ratio,
                               args.length_rule, rng, tokenizer)
    if name == "random-ids":
        reqs = random_id_requests(n, args.random_input_len, args.random_output_len, args.random_range_ratio,
                                  args.length_rule, rng, tokenizer)
        if args.random_ids_as == "text":  # as SGLang's bench_serving sends them: the server re-tokenizes
            reqs = [replace(r, prompt=tokenizer.decode(r.prompt)) for r in reqs]
        return reqs
    if name == "sharegpt":
        return sharegpt_requests(args.dataset_path, n, rng, tokenizer, args.sharegpt_output_len)
    raise bad_field("dataset_name", name, "choose random, random-ids or sharegpt")
