"""The token ids a worker would see for a request body, so the router can look its prefix up.

The router tokenizes as the worker does: the same tokenizer (loaded from the worker's model source), the same
parsing of the chat messages (server/protocol.py) and the same chat template. A body this cannot read is no
error here: the worker judges the request, and the router routes it by load alone.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("graphserve.router")

COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/generate"


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


class PromptTokens:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        template = tokenizer.chat_template
        if isinstance(template, dict):  # as models/loader.py picks it for the engine
            template = template.get("default") or next(iter(template.values()), None)
        self.chat_template = template

    def _one(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, str) and prompt:
            return list(self.tokenizer.encode(prompt))
        if _is_ids(prompt):
            return list(prompt)
        return None

    def _many(self, value: Any) -> list[list[int]]:
        if isinstance(value, list) and value and not _is_ids(value):
            ids = [self._one(p) for p in value]
        else:
            ids = [self._one(value)]
        return [p for p in ids if p]

    def _chat(self, body: dict[str, Any]) -> list[list[int]]:
        from graphserve.server.protocol import ChatCompletionRequest

        req = ChatCompletionRequest.model_validate(body)
        text = self.tokenizer.apply_chat_template(
            req.template_messages(), chat_template=self.chat_template,
            add_generation_prompt=req.add_generation_prompt, tokenize=False, tools=req.tools)
        return [list(self.tokenizer.encode(text))]

    def prompts(self, path: str, body: Any) -> list[list[int]]:
        """Each prompt of the request as token ids; [] when the body does not say (the worker will refuse it)."""
        if not isinstance(body, dict):
            return []
        try:
            if path == COMPLETIONS:
                return self._many(body.get("prompt"))
            if path == CHAT:
                return self._chat(body)
            if path == GENERATE:
                return self._many(body["text"] if body.get("text") is not None else body.get("input_ids"))
        except Exception as exc:  # noqa: BLE001 - the worker judges the body; the router only loses the prefix
            logger.debug("%s: no prompt tokens for routing (%s: %s)", path, type(exc).__name__, exc)
        return []
