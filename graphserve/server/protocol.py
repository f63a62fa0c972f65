"""Request models for the OpenAI endpoints and SGLang's native /generate, and their SamplingParams.

Bounds declared here appear in /openapi.json (so generated clients and fuzzers see them) and give pydantic
errors that name the field; SamplingParams re-checks every limit, so the two cannot drift apart silently.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from graphserve.errors import BadRequestError, bad_field
from graphserve.sampling_params import MAX_LOGPROBS, SamplingParams
from graphserve.structured.constraint import StructuredOutput
from graphserve.structured.requests import native_constraint, openai_constraint
from graphserve.structured.tool_calls import ToolChoice, tool_choice

MAX_N = 128  # choices per request; each one holds its own KV blocks
MAX_STOP = 16  # stop strings per request
SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit value
TOKEN_ID_MAX = 2**31 - 1  # larger ids cannot be any vocabulary's; the processor checks the real vocab size

TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
TokenIds = list[TokenId]
StopField = str | list[str] | None


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send user, metadata, store...); NaN and inf are rejected.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Knobs(_Strict):
    """Sampling fields both APIs spell the same way."""

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=TOKEN_ID_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    stop: StopField = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP)
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class _SamplingFields(_Knobs):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    seed: int | None = Field(None, ge=-SEED_MAX, le=SEED_MAX)
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    logit_bias: dict[str, float] | None = None
    # structured output, vLLM's spelling (graphserve/structured/requests.py)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> StructuredOutput | None:
        return openai_constraint(self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar)

    def check_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise bad_field("best_of", self.best_of, f"must equal n ({self.n}): best-of reranking is not supported")
        if self.logit_bias:
            raise bad_field("logit_bias", "{...}", "is not supported; send an empty object or omit it")
        if self.stream_options is not None and not self.stream:
            raise bad_field("stream_options", self.stream_options.model_dump(), "is only allowed when stream is true")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self.check_unsupported()
        stop = stop_list("stop", self.stop)
        return build_params(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty, seed=self.seed,
            stop=stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, structured=self.constraint(),
        )


def stop_list(field: str, stop: str | list[str] | None) -> list[str]:
    """``stop`` as a list, bounded by MAX_STOP."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise bad_field(field, f"{len(stops)} strings", f"at most {MAX_STOP} stop strings")
    return stops


def build_params(max_tokens: int | None, **kw: Any) -> SamplingParams:
    """SamplingParams from request fields, leaving unset (None) ones at their defaults; max_tokens=None
    stays None (up to the room left in the context), as OpenAI's chat endpoint does."""
    return SamplingParams(max_tokens=max_tokens, **{k: v for k, v in kw.items() if v is not None})


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_field("prompt", p, "must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # one tokenized prompt
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise bad_field("echo", True, "is not supported")
        if self.suffix:
            raise bad_field("suffix", self.suffix, "is not supported")
        return self.sampling_params(self.max_tokens, self.logprobs)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls is not None:
                msg["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out

    def tool_choice_mode(self) -> ToolChoice | None:
        return tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)[0]

    def constraint(self) -> StructuredOutput | None:
        tools = tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)[1]
        return openai_constraint(self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar,
                                 self.response_format, tools)

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_field("top_logprobs", self.top_logprobs, "requires logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


class NativeSamplingParams(_Knobs):
    """SGLang's ``sampling_params`` object."""

    max_new_tokens: int | None = Field(128, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    sampling_seed: int | None = Field(None, ge=-SEED_MAX, le=SEED_MAX)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class GenerateRequest(_Strict):
    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | None = None

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """(prompts, batched): exactly one of text / input_ids, single or a list."""
        if (self.text is None) == (self.input_ids is None):
            raise BadRequestError("exactly one of text or input_ids is required", param="text")
        if self.text is not None:
            return ([self.text], False) if isinstance(self.text, str) else (list(self.text), True)
        ids = self.input_ids
        if not ids:
            raise bad_field("input_ids", ids, "must not be empty")
        if all(isinstance(x, int) for x in ids):
            return [list(ids)], False
        return list(ids), True

    def to_sampling_params(self) -> SamplingParams:
        sp = self.sampling_params
        stop = stop_list("sampling_params.stop", sp.stop)
        return build_params(
            n=sp.n, max_tokens=sp.max_new_tokens, min_tokens=sp.min_new_tokens, temperature=sp.temperature,
            top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty,
            seed=sp.sampling_seed, stop=stop, stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
            skip_special_tokens=sp.skip_special_tokens, structured=native_constraint(sp.json_schema, sp.regex, sp.ebnf),
        )
