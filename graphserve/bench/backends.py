"""Request bodies and response parsing for the three wire formats the load generator speaks.

- ``openai``: POST /v1/completions, streamed deltas, usage in the final chunk (include_usage).
- ``openai-chat``: POST /v1/chat/completions, the same with ``delta.content``.
- ``native``: POST /generate (SGLang's shape); each streamed chunk carries the cumulative text and
  ``meta_info`` {prompt_tokens, completion_tokens, finish_reason}, so token counts are exact per chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from graphserve.bench.datasets import BenchRequest
from graphserve.errors import bad_field

BACKENDS = ("openai", "openai-chat", "native")
# How the client reads a streamed response:
# - "lines": pooled keep-alive connections, aiohttp's line reader;
# - "every-event": a connection per request (as SGLang's bench_serving opens a session per request), the body
#   read in raw chunks as they arrive and every event split off and JSON-parsed at once. A server that only
#   keeps up because its clients read slowly (so it can merge tokens into fewer events) shows it here.
CLIENTS = ("lines", "every-event")
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions", "native": "/generate"}


@dataclass
class ChunkInfo:
    """What one parsed chunk (or a whole non-streamed body) says."""

    new_text: str = ""
    completion_tokens: int | None = None  # cumulative, when the server reports it in this chunk
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    usage_only: bool = False  # OpenAI's final include_usage chunk: counts, but no output of its own


def build_payload(backend: str, req: BenchRequest, *, model: str | None, stream: bool,
                  ignore_eos: bool, temperature: float = 0.0, tokenizer: Any = None) -> dict:
    if backend == "native":
        body: dict[str, Any] = {"input_ids": req.prompt} if isinstance(req.prompt, list) else {"text": req.prompt}
        body["sampling_params"] = {"max_new_tokens": req.output_len, "temperature": temperature,
                                   "ignore_eos": ignore_eos}
        body["stream"] = stream
        return body
    if backend == "openai":
        body = {"prompt": req.prompt}  # a list of ints is a valid OpenAI prompt
    elif backend == "openai-chat":
        prompt = req.prompt
        if isinstance(prompt, list):
            if tokenizer is None:
                raise bad_field("dataset_name", "random-ids", "needs --tokenizer with --backend openai-chat")
            prompt = tokenizer.decode(prompt)
        body = {"messages": [{"role": "user", "content": prompt}]}
    else:
        raise bad_field("backend", backend, f"choose one of {', '.join(BACKENDS)}")
    if model:
        body["model"] = model
    body.update({"max_tokens": req.output_len, "temperature": temperature, "stream": stream})
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM / SGLang / graphserve extension
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _usage(info: ChunkInfo, usage: dict | None) -> None:
    if usage:
        info.completion_tokens = usage.get("completion_tokens", info.completion_tokens)
        info.prompt_tokens = usage.get("prompt_tokens", info.prompt_tokens)


class ChunkParser:
    """Turns parsed JSON chunks into ChunkInfo; keeps the state the native format needs."""

    def __init__(self, backend: str):
        self.backend = backend
        self._text_len = 0  # native chunks are cumulative

    def parse(self, obj: dict) -> ChunkInfo:
        info = ChunkInfo()
        if self.backend == "native":
            text = obj.get("text", "")
            info.new_text = text[self._text_len:]
            self._text_len = len(text)
            meta = obj.get("meta_info") or {}
            info.completion_tokens = meta.get("completion_tokens")
            info.prompt_tokens = meta.get("prompt_tokens")
            fr = meta.get("finish_reason")
            info.finish_reason = fr.get("type") if isinstance(fr, dict) else fr
            return info
        _usage(info, obj.get("usage"))
        choices = obj.get("choices") or []
        info.usage_only = not choices
        if choices:
            ch = choices[0]
            if self.backend == "openai-chat":
                part = ch.get("delta") or ch.get("message") or {}
                info.new_text = part.get("content") or ""
            else:
                info.new_text = ch.get("text") or ""
            info.finish_reason = ch.get("finish_reason")
        return info


async def iter_sse_data(content: Any) -> AsyncIterator[bytes]:
    """The ``data:`` payload of every SSE event, as soon as its blank line arrives (``content``: an aiohttp
    StreamReader). Raw chunks are split here, so an event is handed over the moment its bytes are in."""
    buf = b""
    async for chunk in content.iter_any():
        buf += chunk
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            for line in buf[start:end].split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip()
            start = end + 2
        buf = buf[start:]
    if buf.strip().startswith(b"data:"):
        yield buf.strip()[5:].strip()
