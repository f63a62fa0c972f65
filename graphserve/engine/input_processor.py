"""Prompts in: validate and tokenize a request before the core sees it (tokens out: output_processor.py).

It runs outside the core's step loop, so the server does this work off the hot path.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from graphserve.engine.request import EngineRequest
from graphserve.errors import BadRequestError, bad_field
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
