"""Stop strings, checked by the engine in the step that makes the token completing one.

A sequence with stop strings keeps an incremental detokenizer (the window decode the output processor streams
with, so both see the same text) and only the last ``longest - 1`` characters of its text: a stop string that
the newest text completes starts there or later. A token of whole characters that follows whole characters
reads as its entry in a table of every token's text (decoded once, in context, at warm-up), so most tokens
cost a list append and a set test; only a token that holds part of a character, or none, decodes a window,
and those of every sequence in a step decode in one batch call. A sequence without stop strings has no
watch and costs nothing.

The engine reports the stop as ``finish_reason="stop"`` with the stop string as ``stop_reason`` on the token
that completed it; the front-end cuts its text at that string and never has to abort anything.
"""

from __future__ import annotations

from typing import Any

from graphserve.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, decode_windows, earliest_stop

# Tokens after which text that still ends in part of a character is taken as it reads: a model writing invalid
# bytes would otherwise grow the decoded window, and this step's cost, without bound.
_SETTLE_AFTER = 8


class StopWatch:
    """One sequence's stop strings and the tail of its output text."""

    __slots__ = ("stops", "ends", "keep", "detok", "tail")

    def __init__(self, detok: IncrementalDetokenizer, stops: list[str]):
        self.stops = stops
        self.ends = frozenset(s[-1] for s in stops)
        self.keep = max(len(s) for s in stops) - 1  # characters before the new text a stop string may start in
        self.detok = detok
        self.tail = ""

    def found(self, new_text: str) -> str | None:
        """The stop string that ``new_text`` completes (earliest start; a tie goes to the first listed)."""
        if not new_text:
            return None  # an incomplete character: the token that completes it decides
        text = self.tail + new_text
        best = earliest_stop(text, self.stops, max(0, len(self.tail) - self.keep))
        self.tail = text[-self.keep :] if self.keep else ""
        return None if best is None else best[1]


class StopChecker:
    """The engine's stop-string check: a watch per sequence with stop strings, one batch decode per step."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[bool, list[str]] = {}  # skip_special_tokens -> each token id's text
        # A token's text is its table text wherever it stands, unless the decoder rewrites spaces around
        # punctuation (clean-up) or is not the Rust one (whose batch call builds the table): then always decode.
        rust = getattr(tokenizer, "_tokenizer", None)
        self._plain = (rust is not None and hasattr(rust, "decode_batch")
                       and not getattr(tokenizer, "clean_up_tokenization_spaces", False))

    def prepare(self, skip_modes: tuple[bool, ...] = (True, False)) -> None:
        """Build the token tables now (0.2 s for a 49k vocabulary on one core): a server does it while it warms
        up, rather than in the step of its first request with stop strings."""
        for skip in skip_modes:
            if skip not in self._texts:
                self._texts[skip] = self._token_texts(skip)

    def watch(self, prompt_token_ids: list[int], stops: list[str], skip_special_tokens: bool) -> StopWatch:
        self.prepare((skip_special_tokens,))
        return StopWatch(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens), list(stops))

    def _token_texts(self, skip: bool) -> list[str]:
        """Every token's text as it reads after a letter (decoded alone, a SentencePiece token would lose its
        leading space), in one batch decode, once per engine."""
        context = self.tokenizer.encode("a", add_special_tokens=False)[-1:]
        lead = self.tokenizer.decode(context, skip_special_tokens=skip)
        decoded = decode_windows(self.tokenizer, [context + [t] for t in range(len(self.tokenizer))], skip)
        return [d[len(lead) :] if d.startswith(lead) else d for d in decoded]

    def check(self, watched: list[tuple[StopWatch, int]]) -> list[str | None]:
        """For each (watch, its sequence's new token): the stop string that token completes, or None."""
        found: list[str | None] = [None] * len(watched)
        groups: dict[bool, list[tuple[int, list[int], list[int]]]] = {}
        texts, plain = self._texts, self._plain
        for k, (watch, token) in enumerate(watched):
            detok = watch.detok
            ids = detok.ids
            settled = detok.read_offset == len(ids)  # no part of a character waits for this token
            ids.append(token)
            table = texts[detok.skip_special_tokens]
            text = table[token] if token < len(table) else ""
            if plain and settled and text and REPLACEMENT_CHAR not in text:
                # whole characters after whole characters: the token reads as its table text, no decode
                detok.prefix_offset, detok.read_offset = detok.read_offset, len(ids)
                if watch.ends.isdisjoint(text):
                    if watch.keep:
                        watch.tail = (watch.tail + text)[-watch.keep :]
                else:
                    found[k] = watch.found(text)
                continue
            prefix, full = detok.extend([])
            groups.setdefault(detok.skip_special_tokens, []).append((k, prefix, full))
        for skip, items in groups.items():
            decoded = decode_windows(self.tokenizer, [w for _, prefix, full in items for w in (prefix, full)], skip)
            for j, (k, _, _) in enumerate(items):
                watch = watched[k][0]
                found[k] = watch.found(watch.detok.accept(decoded[2 * j], decoded[2 * j + 1], _SETTLE_AFTER))
        return found
