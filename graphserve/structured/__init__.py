"""Structured output: constrain a request's tokens to a JSON schema, a regex, a choice or a grammar
(xgrammar), and OpenAI tool calls built on it."""

from __future__ import annotations

from graphserve.structured.constraint import (
    StructuredOutput,
    choice,
    grammar,
    json_object,
    json_schema,
    regex,
)

__all__ = ["StructuredOutput", "choice", "grammar", "json_object", "json_schema", "regex"]
