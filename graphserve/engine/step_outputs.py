"""What the engine process hands the server per iteration: flat columns of new tokens, never copies.

One row per (request, choice, step) that produced something: its new token id, and sparse maps for the
rare extras (a finish, logprobs, an error, the request's first scheduling). Flat lists of ints and strings
pickle an order of magnitude faster than a list of dataclasses, and two batches merge by appending, so the
engine coalesces steps whenever the server has not taken the previous batch yet: the step loop never waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NO_TOKEN = -1  # a row that carries no token (an abort notice or a failure)


@dataclass
class StepOutputs:
    request_ids: list[str] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)  # the choice (0..n-1) of each row
    token_ids: list[int] = field(default_factory=list)
    finishes: dict[int, tuple[str, Any]] = field(default_factory=dict)  # row -> (finish_reason, stop_reason)
    logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)  # row -> (lp, top)
    errors: dict[int, str] = field(default_factory=dict)
    error_params: dict[int, str] = field(default_factory=dict)  # row -> the request field its error blames
    # request id -> (first scheduled time, cached prompt tokens): sent once, with the request's first row
    first_seen: dict[str, tuple[float | None, int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.request_ids)

    def add_core_outputs(self, outputs: list[Any], reported: set[str]) -> None:
        """Append CoreOutputs; ``reported`` holds the ids whose first-seen facts already went out."""
        for co in outputs:
            rid = co.request_id
            if rid not in reported:
                reported.add(rid)
                self.first_seen[rid] = (co.first_scheduled_time, co.num_cached_tokens)
            tokens = co.new_token_ids or [NO_TOKEN]
            for k, tok in enumerate(tokens):
                row = len(self.request_ids)
                self.request_ids.append(rid)
                self.indices.append(co.index)
                self.token_ids.append(tok)
                if co.new_logprobs and k < len(co.new_logprobs):
                    lp = co.new_logprobs[k]
                    self.logprobs[row] = (lp.logprob, lp.top)
            last = len(self.request_ids) - 1
            if co.error is not None:
                self.errors[last] = co.error
                if co.error_param is not None:
                    self.error_params[last] = co.error_param
            if co.finish_reason is not None:
                self.finishes[last] = (co.finish_reason, co.stop_reason)
                reported.discard(rid)

    def add_error(self, request_id: str, message: str, param: str | None = None) -> None:
        """A row that ends a request the engine refused: ``param`` names the request field at fault (a 400)."""
        row = len(self.request_ids)
        self.request_ids.append(request_id)
        self.indices.append(0)
        self.token_ids.append(NO_TOKEN)
        self.errors[row] = message
        if param is not None:
            self.error_params[row] = param
        self.finishes[row] = ("abort", None)

    def extend(self, other: StepOutputs) -> None:
        base = len(self.request_ids)
        self.request_ids += other.request_ids
        self.indices += other.indices
        self.token_ids += other.token_ids
        self.finishes.update({base + r: v for r, v in other.finishes.items()})
        self.logprobs.update({base + r: v for r, v in other.logprobs.items()})
        self.errors.update({base + r: v for r, v in other.errors.items()})
        self.error_params.update({base + r: v for r, v in other.error_params.items()})
        for rid, v in other.first_seen.items():
            self.first_seen.setdefault(rid, v)
