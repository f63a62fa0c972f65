"""Per-request sampling parameters, in vLLM's shape, validated at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field

from graphserve.errors import bad_field
from graphserve.structured.constraint import StructuredOutput

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the room left in the context
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per token (0..20); None: off
    skip_special_tokens: bool = True
    # constrain the output to a JSON schema / regex / choice / grammar (graphserve.structured builds it)
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Check every field against its limit; raises BadRequestError naming the field."""
        if not isinstance(self.n, int) or self.n < 1:
            raise bad_field("n", self.n, "must be an integer >= 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad_field("max_tokens", self.max_tokens, "must be an integer >= 1")
        if self.min_tokens < 0:
            raise bad_field("min_tokens", self.min_tokens, "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad_field("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            raise bad_field("temperature", self.temperature, "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad_field("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad_field("top_k", self.top_k, "must be -1 (off), 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad_field("min_p", self.min_p, "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad_field("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad_field("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad_field("repetition_penalty", self.repetition_penalty, "must be > 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_field("logprobs", self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad_field("stop", s, "each stop string must be a non-empty string")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise bad_field("structured", type(self.structured).__name__,
                            "must be a StructuredOutput (graphserve.structured.json_schema, regex, choice, grammar)")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise bad_field("stop_token_ids", t, "each id must be an integer >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling depends on the tokens generated so far (presence/frequency/repetition)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
