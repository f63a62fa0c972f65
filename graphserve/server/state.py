"""What every endpoint needs: the engine, the metrics, the served model names and the tokenizer helpers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphserve.errors import BadRequestError, NotFoundError, ServiceUnavailableError
from graphserve.server.frontend import Frontend
from graphserve.server.grammar_work import GrammarWork
from graphserve.server.metrics import ServerMetrics
from graphserve.server.replicas import ReplicaSet


@dataclass
class ServerState:
    engine: Frontend | ReplicaSet  # one engine, or --dp replicas behind one face
    metrics: ServerMetrics
    model_name: str  # the name responses carry (first of --served-model-name)
    accepted_names: set[str] = field(default_factory=set)  # names a request may ask for
    draining: bool = False
    profile_endpoint: bool = False  # POST /v1/profile exists (--enable-profile-endpoint)
    drain_retry_after: float = 5.0
    strict_api: bool = False  # unknown fields on the OpenAI routes are a 400 (--strict-api)
    grammar: GrammarWork = field(default_factory=GrammarWork)  # request grammars, off the loop
    _token_text: dict[int, str] = field(default_factory=dict)

    def check_ready(self) -> None:
        if self.draining:
            raise ServiceUnavailableError("the server is shutting down", retry_after=self.drain_retry_after)
        self.engine.check_serving()

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names:
            raise NotFoundError(
                f"model={name!r} is not served here: this server serves {sorted(self.accepted_names)}",
                param="model", code="model_not_found",
            )

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> str:
        template = self.engine.core.chat_template
        if template is None:
            raise BadRequestError(f"model {self.model_name!r} has no chat template: use /v1/completions",
                                  param="messages")
        try:
            return self.engine.tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False,
                tools=tools,
            )
        except Exception as exc:  # noqa: BLE001 - a template that rejects the messages is the caller's input
            raise BadRequestError(f"messages cannot be rendered by the model's chat template: {exc}",
                                  param="messages") from exc

    def token_text(self, token_id: int) -> str:
        """The text of one token, for logprobs (cached: the same ids recur across requests)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id])
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text

    def served_models(self) -> list[dict[str, Any]]:
        return [{"id": self.model_name, "object": "model", "owned_by": "graphserve",
                 "root": self.engine.config.model}]
