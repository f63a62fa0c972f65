"""From request bytes to prompts the engine takes, without holding the event loop on a large input.

The body is parsed here rather than by FastAPI so validation gets the served model's limits (a token-id
list longer than the context is refused before its elements are walked) and so a lone UTF-16 surrogate,
which Python's JSON parser keeps, reaches the validator that names its field. A text prompt that cannot fit
the context is refused from its length alone; a long one is tokenized on a worker thread (the tokenizer
releases the GIL), so /health and every stream keep their pace while it runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from graphserve.errors import BadRequestError
from graphserve.server.protocol import ValidationLimits
from graphserve.server.state import ServerState
from graphserve.server.tokens import TokenTable

M = TypeVar("M", bound=BaseModel)
logger = logging.getLogger("graphserve.server")
# Below this many characters tokenizing takes microseconds: a thread hop would cost more than it saves.
INLINE_TOKENIZE_CHARS = 4096
_tables: dict[int, TokenTable] = {}


def token_table(state: ServerState) -> TokenTable:
    """The TokenTable of the served tokenizer, built on first use (the tokenizer exists once the engine is up)."""
    tokenizer = state.engine.tokenizer
    table = _tables.get(id(tokenizer))
    if table is None or table.tokenizer is not tokenizer:
        table = _tables[id(tokenizer)] = TokenTable(tokenizer)
    return table


def limits(state: ServerState) -> ValidationLimits | None:
    processor = state.engine.input_processor
    return None if processor is None else ValidationLimits(max_model_len=processor.max_model_len)


_warned_unknown: set[str] = set()  # unknown field names already warned about (one line per name per process)
IGNORED_FIELDS_HEADER = "X-Graphserve-Ignored-Fields"


class UnsupportedMediaTypeError(BadRequestError):
    http_status = 415


def check_json_body(request: Request) -> None:
    ctype = request.headers.get("content-type")
    media = (ctype or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        said = f"Content-Type {ctype!r}" if ctype else "no Content-Type"
        raise UnsupportedMediaTypeError(f"request body must be JSON sent as Content-Type: application/json, got "
                                        f"{said}", param="body")


def check_unknown_fields(request: Request, model: type[BaseModel], data: Any, strict_api: bool) -> None:
    """Top-level fields the route does not know: refused under --strict-api; else ignored, warned about once
    per name per process, and listed in the response's IGNORED_FIELDS_HEADER (request.state.ignored_fields)."""
    if not isinstance(data, dict):
        return
    unknown = [k for k in data if k not in model.model_fields]
    if not unknown:
        return
    if strict_api:
        name = unknown[0]
        raise BadRequestError(f"{name} is not a field of {request.url.path} (this server runs with --strict-api; "
                              f"{len(unknown)} unknown field(s))", param=name[:64])
    for name in unknown:
        if name not in _warned_unknown and len(_warned_unknown) < 1000:
            _warned_unknown.add(name)
            logger.warning("ignoring the unknown field %r of %s (warned once per field name)", name[:64],
                           request.url.path)
    request.state.ignored_fields = unknown


async def parse_body(request: Request, model: type[M], state: ServerState, openai_route: bool = False) -> M:
    body = await request.body()  # read even when refused below: an unread body would leave the connection unusable
    check_json_body(request)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}", param="body") from None
    except RecursionError:  # "[[[[...": Python's parser gives up past ~1000 levels; no request nests so deep
        raise BadRequestError("request body is not valid JSON: it nests too deeply", param="body") from None
    try:
        parsed = model.model_validate(data, context={"limits": limits(state)})
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
    if openai_route:
        check_unknown_fields(request, model, data, state.strict_api)
    return parsed


async def loaded_token_table(state: ServerState) -> TokenTable:
    """token_table(state), built on a worker thread the first time: reading a 150k-entry vocabulary and the
    tokenizer's JSON takes long enough to be felt by every stream on the loop."""
    tokenizer = state.engine.tokenizer
    table = _tables.get(id(tokenizer))
    if table is not None and table.tokenizer is tokenizer:
        return table
    return await asyncio.to_thread(token_table, state)


async def check_length(state: ServerState, field: str, num_chars: int) -> None:
    """Refuse text that no tokenization could fit into max_model_len, before tokenizing it."""
    per_token = (await loaded_token_table(state)).max_chars_per_token
    limit = state.engine.input_processor.max_model_len
    if per_token is not None and num_chars > per_token * limit:
        raise BadRequestError(
            f"{field} is {num_chars} characters: at most {per_token} characters per token of this tokenizer, that "
            f"is at least {-(-num_chars // per_token)} tokens, more than max_model_len={limit} "
            "(raise it with --max-model-len)", param=field)


async def engine_prompts(state: ServerState, field: str, prompts: list[str | list[int]]) -> list[Any]:
    """Prompts in the form the engine takes: text tokenized here ({"prompt_token_ids", "prompt"}), ids as they are.
    Token-id lists were already bounded by validation; the engine checks each id against the vocabulary."""
    out: list[Any] = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            out.append(prompt)
            continue
        name = field if len(prompts) == 1 else f"{field}[{i}]"
        await check_length(state, name, len(prompt))
        tokenize = state.engine.input_processor.tokenize
        if len(prompt) <= INLINE_TOKENIZE_CHARS:
            ids, _ = tokenize(prompt)
        else:
            ids, _ = await asyncio.to_thread(tokenize, prompt)
        limit = state.engine.input_processor.max_model_len
        if len(ids) > limit:  # refused here: the engine would first walk every id on the loop
            raise BadRequestError(f"{name} is {len(ids)} tokens long, more than max_model_len={limit} "
                                  "(raise it with --max-model-len)", param=name)
        out.append({"prompt_token_ids": ids, "prompt": prompt})
    return out


async def chat_engine_prompt(state: ServerState, messages: list[dict[str, Any]], add_generation_prompt: bool,
                             tools: list[dict[str, Any]] | None = None) -> Any:
    await check_length(state, "messages", sum(len(m["content"]) for m in messages))
    if sum(len(m["content"]) for m in messages) <= INLINE_TOKENIZE_CHARS:
        text = state.chat_prompt(messages, add_generation_prompt, tools)
    else:
        text = await asyncio.to_thread(state.chat_prompt, messages, add_generation_prompt, tools)
    return (await engine_prompts(state, "messages", [text]))[0]
