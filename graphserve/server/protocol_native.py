"""SGLang's native /generate request: ``text`` or ``input_ids`` plus ``sampling_params``.

A field SGLang has and this server does not implement (``lora_path``, ``image_data``, ``json_schema``...)
is refused with a 400 naming it whenever it asks for something (any value but null, false or empty):
SGLang's own clients send ``lora_path: null``, and that asks for nothing.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Discriminator, Field, Tag

from graphserve.errors import bad_field
from graphserve.sampling_params import MAX_LOGPROBS, SamplingParams
from graphserve.server.protocol import (
    SEED_MAX,
    Text,
    TextOrTexts,
    TokenIds,
    _Knobs,
    _Strict,
    build_params,
    prompt_list,
    stop_list,
)
from graphserve.structured.requests import native_constraint

# Fields that change nothing in the output: accepted whatever their value.
NO_EFFECT_FIELDS = frozenset({"log_metrics", "no_logs"})


def _ids_shape(value: Any) -> str | None:
    if not isinstance(value, list):
        return None
    return "token_id_lists" if value and isinstance(value[0], list) else "token_ids"


InputIdsField = Annotated[
    Annotated[TokenIds, Tag("token_ids")] | Annotated[list[TokenIds], Tag("token_id_lists")],
    Discriminator(_ids_shape, custom_error_type="input_ids_shape",
                  custom_error_message="must be a list of token ids or a list of token-id lists"),
]


def _refuse_extra(prefix: str, extra: dict[str, Any] | None) -> None:
    for name, value in (extra or {}).items():
        if name in NO_EFFECT_FIELDS or value is None or value is False or value in ("", [], {}):
            continue
        shown = value if len(repr(value)) <= 60 else f"<{type(value).__name__}>"  # never echo a large payload
        raise bad_field(prefix + name, shown, "is not supported by this server (omit it or send null)")


class NativeSamplingParams(_Knobs):
    """SGLang's ``sampling_params`` object."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    # 0: prefill only (SGLang's meaning): the prompt is computed and cached, no token is returned.
    max_new_tokens: int | None = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    sampling_seed: int | None = Field(None, ge=-SEED_MAX, le=SEED_MAX)
    # structured output (graphserve/structured/requests.py)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class GenerateRequest(_Strict):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    text: TextOrTexts | None = None
    input_ids: InputIdsField | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: Text | None = None
    return_logprob: bool = False
    # -1: logprobs of output tokens only; a start inside the prompt asks for prompt-token logprobs.
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)
    return_text_in_logprobs: bool = False

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """(prompts, batched): exactly one of text / input_ids, single or a list."""
        if (self.text is None) == (self.input_ids is None):
            raise bad_field("text", "both" if self.text is not None else None,
                            "exactly one of text or input_ids is required")
        if self.text is not None:
            return prompt_list("text", self.text), not isinstance(self.text, str)
        prompts = prompt_list("input_ids", self.input_ids)
        return prompts, isinstance(self.input_ids[0], list)

    @staticmethod
    def field_names() -> dict[str, str]:
        """Engine field -> the name SGLang's request gives it, for errors found after validation."""
        return {**{k: f"sampling_params.{k}" for k in _Knobs.model_fields},
                "max_tokens": "sampling_params.max_new_tokens", "min_tokens": "sampling_params.min_new_tokens",
                "seed": "sampling_params.sampling_seed"}

    @property
    def prefill_only(self) -> bool:
        return self.sampling_params.max_new_tokens == 0

    def check_logprob_start(self, prompt_lens: list[int]) -> None:
        """Prompt-token logprobs are not computed by the engine: a start inside any prompt is refused."""
        start = self.logprob_start_len
        if not self.return_logprob or start < 0:
            return
        shortest = min(prompt_lens)
        if start < shortest:
            raise bad_field("logprob_start_len", start,
                            f"must be -1 or >= the prompt length ({shortest} tokens): prompt-token logprobs "
                            "are not supported, only output-token ones")

    def to_sampling_params(self) -> SamplingParams:
        _refuse_extra("", self.model_extra)
        sp = self.sampling_params
        _refuse_extra("sampling_params.", sp.model_extra)
        if self.top_logprobs_num and not self.return_logprob:
            raise bad_field("top_logprobs_num", self.top_logprobs_num, "requires return_logprob to be true")
        if self.prefill_only and sp.min_new_tokens:
            raise bad_field("sampling_params.min_new_tokens", sp.min_new_tokens, "must be 0 when max_new_tokens is 0")
        stop = stop_list("sampling_params.stop", sp.stop)
        # Prefill only runs one step that samples a token nobody sees: the engine always ends a prefill
        # with a sample, and the response drops it.
        max_tokens = 1 if self.prefill_only else sp.max_new_tokens
        return build_params(
            n=sp.n, max_tokens=max_tokens, min_tokens=sp.min_new_tokens, temperature=sp.temperature,
            top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty,
            seed=sp.sampling_seed, stop=stop, stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
            skip_special_tokens=sp.skip_special_tokens, structured=native_constraint(sp.json_schema, sp.regex, sp.ebnf),
            logprobs=self.top_logprobs_num if self.return_logprob else None,
        )
