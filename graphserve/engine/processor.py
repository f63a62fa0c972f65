"""The engine's edges: prompts in (validate, tokenize), tokens out (detokenize, stop strings).

Both run outside the core's step loop, so the server can do this work off the hot path.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphserve.engine.detokenizer import IncrementalDetokenizer, earliest_stop
from graphserve.engine.request import CoreOutput, EngineRequest
from graphserve.errors import BadRequestError, bad_field
from graphserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from graphserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from graphserve.config import EngineConfig
    from graphserve.models.loader import ModelInfo


def resolve_max_model_len(config: EngineConfig, info: ModelInfo) -> int:
    return config.max_model_len or info.max_position_embeddings


class InputProcessor:
    def __init__(self, tokenizer: Any, info: ModelInfo, config: EngineConfig, kv_blocks: tuple[int, int]):
        """``kv_blocks``: (usable blocks, tokens per block) of the engine's KV pool."""
        self.tokenizer = tokenizer
        self.info = info
        self.max_model_len = resolve_max_model_len(config, info)
        self.kv_blocks = kv_blocks
        self.chunk = config.chunked_prefill_size

    def tokenize(self, prompt: Any) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_field("prompt", prompt, "must not be empty")
            return list(self.tokenizer.encode(prompt)), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise BadRequestError("prompt: a dict prompt needs the key 'prompt_token_ids'", param="prompt")
            return self._check_ids(prompt["prompt_token_ids"]), prompt.get("prompt")
        if isinstance(prompt, (list, tuple)):
            return self._check_ids(prompt), None
        raise bad_field("prompt", type(prompt).__name__, "must be a string, a list of token ids or {'prompt_token_ids': [...]}")

    def _check_ids(self, ids: Any) -> list[int]:
        ids = list(ids)
        vocab = self.info.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise bad_field("prompt_token_ids", t, f"each token id must be an integer in [0, {vocab})")
        return ids

    def _check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """A request must fit the whole KV pool alone, or it could never run (checked before a 200 goes out). Where
        every layer is windowed, it holds its window's blocks at most (layers/kv_layout.KVLayout.held_tokens)."""
        usable, block_size = self.kv_blocks
        total = num_prompt + max_tokens
        held = self.info.kv.held_tokens(total, block_size, self.chunk)
        if -(-held // block_size) > usable:
            window = f", of which it holds at most {held} at once" if held < total else ""
            raise BadRequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} tokens{window} does not fit the "
                f"KV pool of {usable * block_size} tokens (raise it with --num-kv-tokens or --kv-cache-gb)",
                param="max_tokens",
            )

    def process(self, request_id: str, prompt: Any, params: SamplingParams | None, arrival_time: float | None = None
                ) -> EngineRequest:
        params = params if params is not None else SamplingParams()
        params.validate()  # fields may have changed since construction
        ids, text = self.tokenize(prompt)
        if not ids:
            raise bad_field("prompt", prompt, "must contain at least one token")
        limit = self.max_model_len
        if len(ids) > limit:
            raise BadRequestError(
                f"prompt is {len(ids)} tokens long, more than max_model_len={limit} (raise it with --max-model-len)",
                param="prompt",
            )
        room = limit - len(ids)
        if params.max_tokens is None or params.max_tokens > room:
            if params.max_tokens is not None or room < 1:
                raise BadRequestError(
                    f"max_tokens={params.max_tokens} is invalid: the prompt is {len(ids)} tokens and "
                    f"max_model_len={limit}, leaving room for {room} (raise it with --max-model-len)",
                    param="max_tokens",
                )
            params = dataclasses.replace(params, max_tokens=room)
        if params.min_tokens > params.max_tokens:
            raise bad_field("min_tokens", params.min_tokens, f"must be <= max_tokens ({params.max_tokens})")
        self._check_fits(len(ids), params.max_tokens)
        return EngineRequest(request_id, ids, params, time.monotonic() if arrival_time is None else arrival_time, text)


@dataclass
class _Choice:
    detok: IncrementalDetokenizer
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    core_done: bool = False  # the core has finished (or been told to drop) this sequence


class _RequestState:
    def __init__(self, req: EngineRequest, tokenizer: Any, stream: bool):
        self.req = req
        p = req.params
        # Text is built token by token when it is streamed or searched for stop strings; otherwise
        # once, at the end (the same text: the window decodes every output id in one call).
        self.incremental = stream or bool(p.stop)
        self.choices = [
            _Choice(IncrementalDetokenizer(tokenizer, req.prompt_token_ids, p.skip_special_tokens), [],
                    [] if p.logprobs is not None else None)
            for _ in range(p.n)
        ]
        self.metrics = RequestMetrics(arrival_time=req.arrival_time)
        self.max_stop_len = max((len(s) for s in p.stop), default=0)
        self.error: str | None = None
        self.error_param: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def visible_text(self, c: _Choice) -> str:
        # Hold back a possible stop-string prefix while running, so streamed text is never retracted.
        if c.finish_reason is None and self.max_stop_len > 1:
            return c.text[: max(0, len(c.text) - self.max_stop_len + 1)]
        return c.text

    def output(self) -> RequestOutput:
        outs = [
            CompletionOutput(i, self.visible_text(c), list(c.token_ids), c.finish_reason, c.stop_reason,
                             list(c.logprobs) if c.logprobs is not None else None)
            for i, c in enumerate(self.choices)
        ]
        return RequestOutput(self.req.request_id, self.req.prompt_text, self.req.prompt_token_ids, outs,
                             self.finished, dataclasses.replace(self.metrics), self.error, self.error_param)


class OutputProcessor:
    """``stream=False`` (offline generation, which returns only finished requests): an output is
    built only when its request finishes, and its text is decoded then, in one pass."""

    def __init__(self, tokenizer: Any, stream: bool = True):
        self.tokenizer = tokenizer
        self.stream = stream
        self.states: dict[str, _RequestState] = {}

    def add(self, req: EngineRequest) -> None:
        self.states[req.request_id] = _RequestState(req, self.tokenizer, self.stream)

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def process(self, core_outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's core outputs; return request outputs and the ids the core must abort."""
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}
        for co in core_outputs:
            state = self.states.get(co.request_id)
            if state is None:
                continue  # already finished here (stop string) and then aborted in the core
            touched[co.request_id] = state
            self._apply(state, co, now)
        results, to_abort = [], []
        for rid, state in touched.items():
            if self.stream or state.finished:
                results.append(state.output())
            if state.finished:
                state.metrics.finished_time = now
                results[-1].metrics.finished_time = now
                del self.states[rid]
                if not all(c.core_done for c in state.choices):
                    to_abort.append(rid)
        return results, to_abort

    def _apply(self, state: _RequestState, co: CoreOutput, now: float) -> None:
        m = state.metrics
        if co.index == 0:  # later choices hit the first one's prompt blocks; count the prompt once
            m.num_cached_tokens = co.num_cached_tokens
        if co.first_scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = co.first_scheduled_time
        c = state.choices[co.index]
        if co.finish_reason is not None:
            c.core_done = True
        if co.error is not None:
            state.error = co.error
            state.error_param = co.error_param
            for other in state.choices:
                if other.finish_reason is None:
                    other.finish_reason = "abort"
            return
        if c.finish_reason is not None:
            return  # stopped here by a stop string; the core is dropping it
        if co.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            c.token_ids.extend(co.new_token_ids)
            if c.logprobs is not None and co.new_logprobs:
                c.logprobs.extend(co.new_logprobs)
            if state.incremental:
                old_len = len(c.text)
                c.text += c.detok.add(co.new_token_ids)
                if state.req.params.stop and self._check_stop(state, c, old_len):
                    return
        if co.finish_reason is not None:
            if not state.incremental:
                c.text += c.detok.add(c.token_ids)
            c.text += c.detok.flush()
            c.finish_reason, c.stop_reason = co.finish_reason, co.stop_reason

    @staticmethod
    def _check_stop(state: _RequestState, c: _Choice, old_len: int) -> bool:
        """Cut the text at the earliest stop string that the new text completed."""
        best = earliest_stop(c.text, state.req.params.stop, max(0, old_len - state.max_stop_len + 1))
        if best is None:
            return False
        c.text = c.text[: best[0]]
        c.finish_reason, c.stop_reason = "stop", best[1]
        return True
