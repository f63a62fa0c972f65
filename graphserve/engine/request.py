"""Requests and sequences: what the scheduler, block manager and runner pass around.

A request asks for ``n`` choices; each choice is one ``Sequence`` with its own output tokens,
KV blocks and random stream. Siblings share the request id and the prompt.
"""

from __future__ import annotations

import enum
import itertools
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from graphserve.engine.stop_strings import StopWatch
    from graphserve.structured.compiler import GrammarState

_seq_counter = itertools.count()


def future_token(row: int) -> int:
    """The stand-in for the token that row ``row`` of the step in flight will sample (ids are >= 0)."""
    return -1 - row


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class EngineRequest:
    """A validated, tokenized request, ready for the core (max_tokens already resolved)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prompt_text: str | None = None


class Sequence:
    """One output choice of a request: the unit the scheduler runs and the KV pool stores."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        arrival_time: float,
        parent: Sequence | None = None,
    ):
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed  # effective seed of this sequence's random stream
        self.arrival_time = arrival_time
        # n > 1: the first sibling; the others wait until its prompt KV is in the prefix cache
        self.parent = parent
        # prompt + output length at which the sequence stops ("length"); the engine caps it further
        # at max_model_len. The scheduler stops scheduling a sequence there even before its last
        # token has reached the host.
        self.max_total = len(self.prompt_token_ids) + params.max_tokens if params.max_tokens is not None else sys.maxsize
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of the full, computed blocks in block_table
        # leading blocks given back from outside the attention window (their block_table entries: the dummy block),
        # or, with latent pages (engine/latent_pages.py), leading blocks whose latent pages it let go of
        self.num_released_blocks = 0
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at (first) admission
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        # structured output: the matcher following this sequence's output (set once its grammar is compiled)
        self.grammar: GrammarState | None = None
        # stop strings: the tail of the output text the engine searches (set by the engine when it has some)
        self.stop_watch: StopWatch | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV still has to be computed (1 for a decoding sequence)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[float, int]:
        """Arrival order; siblings by seq id. The scheduler preempts the largest key first."""
        return (self.arrival_time, self.seq_id)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}#{self.index}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )


@dataclass
class CoreOutput:
    """What the core reports per sequence per step: new tokens and, at the end, why it finished."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list | None = None  # list[TokenLogprob] when logprobs were asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_param: str | None = None  # set when the error is the request's fault: the field to blame (a 400)
    first_scheduled_time: float | None = None

    @classmethod
    def of(cls, seq: Sequence, tokens: list[int], logprobs: list | None = None, error: str | None = None,
           error_param: str | None = None) -> CoreOutput:
        """``seq``'s new ``tokens`` (none when it was aborted) and its state after them."""
        return cls(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
            error_param=error_param,
            first_scheduled_time=seq.first_scheduled_time,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
