"""Request models for the OpenAI endpoints, and their SamplingParams (SGLang's /generate: protocol_native.py).

Bounds declared here appear in /openapi.json (so generated clients and fuzzers see them) and give pydantic
errors that name the field; SamplingParams re-checks every limit, so the two cannot drift apart silently.
Models are validated with a context (``ValidationLimits``) so that a token-id list longer than the context
window is refused before pydantic walks its elements: 26 M ids once held the loop for 21 s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    Tag,
    ValidationInfo,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError

from graphserve.errors import bad_field
from graphserve.sampling_params import MAX_LOGPROBS, SamplingParams
from graphserve.structured.constraint import StructuredOutput
from graphserve.structured.requests import openai_constraint
from graphserve.structured.tool_calls import ToolChoice, tool_choice

MAX_N = 128  # choices per request; each one holds its own KV blocks
MAX_STOP = 16  # stop strings per request
SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit value
TOKEN_ID_MAX = 2**31 - 1  # larger ids cannot be any vocabulary's; the processor checks the real vocab size
IMAGE_PART_TYPES = ("image_url", "input_image", "image")


@dataclass(frozen=True)
class ValidationLimits:
    """What request validation needs to know about the served model (the pydantic context)."""

    max_model_len: int


def valid_unicode(s: str) -> str:
    # JSON may carry "\ud800" alone; Python keeps it, and it breaks the tokenizer and every UTF-8 encode
    # after it (a 500, or a stream cut mid-body). Refuse it where it enters, naming the field.
    if s.isascii():
        return s
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "lone_surrogate", "contains a lone UTF-16 surrogate U+{cp} at index {pos}: send valid Unicode",
            {"cp": f"{ord(s[exc.start]):04X}", "pos": exc.start},
        ) from None
    return s


def _bounded_ids(value: Any, info: ValidationInfo) -> Any:
    limits = info.context.get("limits") if isinstance(info.context, dict) else None
    if limits is not None and isinstance(value, list) and len(value) > limits.max_model_len:
        raise PydanticCustomError(
            "too_long", "holds {n} token ids, more than max_model_len={limit} (raise it with --max-model-len)",
            {"n": len(value), "limit": limits.max_model_len},
        )
    return value


Text = Annotated[str, AfterValidator(valid_unicode)]
# Strict: JSON true/false are not token ids (lax mode reads them as 1 and 0).
TokenId = Annotated[int, Strict(), Field(ge=0, le=TOKEN_ID_MAX)]
TokenIds = Annotated[list[TokenId], BeforeValidator(_bounded_ids)]

def _text_or_texts(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "texts" if isinstance(value, list) else None


TextOrTexts = Annotated[
    Annotated[Text, Tag("text")] | Annotated[list[Text], Tag("texts")],
    Discriminator(_text_or_texts, custom_error_type="text_shape",
                  custom_error_message="must be a string or a list of strings"),
]
StopField = TextOrTexts | None


def _prompt_shape(value: Any) -> str | None:
    """Which branch of a prompt union a value is, from its shape alone (O(1)), so an error in a token-id list
    is reported against the token-id branch, not against whichever branch pydantic happened to try first."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    if isinstance(first, str):
        return "texts"
    if isinstance(first, list):
        return "token_id_lists"
    return "token_ids"


_SHAPE_ERROR = "must be a string, a list of strings, a list of token ids or a list of token-id lists"
PromptField = Annotated[
    Annotated[Text, Tag("text")] | Annotated[list[Text], Tag("texts")] | Annotated[TokenIds, Tag("token_ids")]
    | Annotated[list[TokenIds], Tag("token_id_lists")],
    Discriminator(_prompt_shape, custom_error_type="prompt_shape", custom_error_message=_SHAPE_ERROR),
]


def prompt_list(field: str, value: str | list[Any]) -> list[str | list[int]]:
    """A validated PromptField as a list of prompts (text or token ids)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_field(field, value, "must not be empty")
    if isinstance(value[0], int):
        return [list(value)]  # one tokenized prompt
    return list(value)


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send user, metadata, store...: prompts.parse_body warns and lists
    # them); NaN and inf are rejected. strict: a number is a number (JSON true and "5" are not 1 and 5).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


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

    model: Text | None = None
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
    prompt: PromptField
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        return prompt_list("prompt", self.prompt)

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise bad_field("echo", True, "is not supported")
        if self.suffix:
            raise bad_field("suffix", self.suffix, "is not supported")
        return self.sampling_params(self.max_tokens, self.logprobs)


def _join_parts(content: Any) -> Any:
    """OpenAI's list-of-parts content: text parts joined; any other part refused with what it was."""
    if not isinstance(content, list):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in IMAGE_PART_TYPES:
            raise PydanticCustomError(
                "image_unsupported", "part {i} is an image ({kind}): images are not supported, this server "
                "serves text-only models", {"i": i, "kind": kind})
        else:
            raise PydanticCustomError(
                "part_unsupported", "part {i} must be {{'type': 'text', 'text': str}}, got type {kind}: only "
                "text parts are supported", {"i": i, "kind": repr(kind)})
    return "".join(texts)


_CONTENT_SCHEMA = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"const": "text"}, "text": {"type": "string"}}}},
    {"type": "null"},
]}


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string or a list of text parts (the schema says so); _join_parts makes the list one string first, so
    # an error (a lone surrogate, an image part) is reported against messages[i].content itself.
    content: Annotated[Text | None, BeforeValidator(_join_parts), WithJsonSchema(_CONTENT_SCHEMA)] = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        return self.content or ""


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

    def field_names(self) -> dict[str, str]:
        """Engine field -> the name this request gave it, for errors found after validation."""
        return {"max_tokens": "max_completion_tokens"} if self.max_completion_tokens is not None else {}

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_field("top_logprobs", self.top_logprobs, "requires logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)
