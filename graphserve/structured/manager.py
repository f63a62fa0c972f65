"""The engine core's side of structured output: requests waiting for their grammar, each sequence's
matcher, and the step's bitmask.

Timeline of a constrained request: ``add`` queues its grammar's compile and holds its sequences here
(not in the scheduler); ``admit_ready``, called at every step, hands them to the scheduler once the
grammar is compiled (or fails them when the compile erred or ran past its bound). Each step that
samples a token for a constrained sequence gets a mask row; ``accept`` advances the matcher with every
token the sequence emits, which is what the next mask is computed from. With the overlap schedule the
core fills step N+1's masks after step N's ids arrive but while N+1's forward runs (``step_masks``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from graphserve.structured.compiler import GrammarCompiler
from graphserve.structured.masks import TokenMaskBuilder

if TYPE_CHECKING:
    from graphserve.engine.request import Sequence
    from graphserve.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# How long an engine with nothing else to run sleeps waiting for a compile before it looks again.
IDLE_WAIT_S = 0.01


@dataclass
class Compiling:
    future: concurrent.futures.Future
    seqs: list[Sequence]
    deadline: float  # time.monotonic() after which the request fails


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.masks = TokenMaskBuilder(vocab_size)
        self.compiling: dict[str, Compiling] = {}
        self.num_live = 0  # requests with a constraint that have not finished

    def add(self, request_id: str, seqs: list[Sequence]) -> None:
        c = seqs[0].params.structured
        self.compiling[request_id] = Compiling(self.compiler.submit(c), seqs,
                                               time.monotonic() + self.compiler.timeout_s)
        self.num_live += 1

    def abort(self, request_id: str) -> list[Sequence]:
        """The sequences of a request still waiting for its grammar (removed from here)."""
        entry = self.compiling.pop(request_id, None)
        return entry.seqs if entry is not None else []

    def admit_ready(self) -> tuple[list[Sequence], list[tuple[str, list[Sequence], str]]]:
        """(sequences whose grammar is ready, each with its matcher; (request id, sequences, why) of
        requests whose compile failed or timed out)."""
        ready: list[Sequence] = []
        failed: list[tuple[str, list[Sequence], str]] = []
        now = time.monotonic()
        for rid, entry in list(self.compiling.items()):
            fut = entry.future
            if fut.done():
                del self.compiling[rid]
                exc = fut.exception()
                if exc is not None:
                    failed.append((rid, entry.seqs, f"its grammar failed to compile: {exc}"))
                    continue
                for seq in entry.seqs:
                    seq.grammar = self.compiler.matcher(fut.result())
                ready += entry.seqs
            elif now > entry.deadline:
                del self.compiling[rid]
                failed.append((rid, entry.seqs, f"its grammar did not compile within {self.compiler.timeout_s:g} s"))
        return ready, failed

    def wait(self) -> None:
        """Block briefly until a compile finishes (the engine has nothing else to run)."""
        if self.compiling:
            concurrent.futures.wait([e.future for e in self.compiling.values()], timeout=IDLE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def step_masks(self, sched: SchedulerOutput, resolve_in_flight: Callable[[], None]
                   ) -> Callable[[], tuple[np.ndarray, np.ndarray] | None] | None:
        """The runner's ``token_mask`` for ``sched``; None when no constrained sequence samples in it.
        It runs once the step's forward is queued and calls ``resolve_in_flight`` first: the grammars
        must have seen the tokens of the step in flight before they say what comes next."""
        if not self.num_live:
            return None
        rows = self.sampling_rows(sched)
        if not rows:
            return None

        def token_mask() -> tuple[np.ndarray, np.ndarray] | None:
            resolve_in_flight()
            return self.fill(rows)

        return token_mask

    @staticmethod
    def sampling_rows(sched: SchedulerOutput) -> list[tuple[int, Sequence]]:
        """(batch row, sequence) of the constrained sequences whose next token this step samples
        (a prefill chunk that does not end the prompt samples nothing that is kept)."""
        out = []
        for row, s in enumerate(sched.scheduled):
            seq = s.seq
            if seq.grammar is not None and seq.num_computed_tokens + s.num_new_tokens == seq.num_tokens:
                out.append((row, seq))
        return out

    def fill(self, rows: list[tuple[int, Sequence]]) -> tuple[np.ndarray, np.ndarray] | None:
        """The step's (rows, bitmasks) for the sequences still running; call it once every token they
        emitted before this step has been accepted."""
        live = [(row, seq) for row, seq in rows if not seq.is_finished]
        if not live:
            return None
        mask = self.masks.fill([seq.grammar for _, seq in live])
        return np.array([row for row, _ in live], dtype=np.int64), mask

    @staticmethod
    def accept(seq: Sequence, token: int) -> tuple[str, str | None] | None:
        """Advance ``seq``'s matcher by its new token. (finish reason, error) when the output ends here:
        ("stop", None) when the grammar is complete (it took its stop token), ("abort", why) when the
        token breaks it (never, once the mask has been applied); None when the output goes on."""
        state = seq.grammar
        if not state.accept(token):
            error = f"token {token} does not follow the request's grammar"
            logger.error("%s: %s", seq, error)
            return "abort", error
        return ("stop", None) if state.is_terminated else None

    def finished(self) -> None:
        self.num_live -= 1
