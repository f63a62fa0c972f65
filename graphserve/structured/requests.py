"""The constraint a request asks for, from the fields each API spells it with.

OpenAI: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}``; vLLM's extra fields ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``; SGLang's ``sampling_params`` ``json_schema`` / ``regex`` /
``ebnf``. At most one per request: two constraints at once have no defined meaning, so that is a 400.
"""

from __future__ import annotations

from typing import Any

from graphserve.errors import BadRequestError
from graphserve.structured.constraint import StructuredOutput, choice, grammar, json_object, json_schema, regex


def _one(given: dict[str, Any], built: StructuredOutput | None = None) -> StructuredOutput | None:
    """The only constraint among ``given`` (field -> value, None when absent); ``built``: one made already."""
    present = [k for k, v in given.items() if v is not None]
    if built is not None:
        present.insert(0, built.field)
    if len(present) > 1:
        raise BadRequestError(f"{' and '.join(present)} each constrain the output: send at most one of them",
                              param=present[1])
    if built is not None or not present:
        return built
    field = present[0]
    value = given[field]
    kind = field.rsplit(".", 1)[-1]
    if kind in ("guided_json", "json_schema"):
        return json_schema(value, field)
    if kind in ("guided_regex", "regex"):
        return regex(value, field)
    if kind == "guided_choice":
        return choice(value, field)
    return grammar(value, field)  # guided_grammar, ebnf


def response_format_constraint(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object("response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BadRequestError("response_format.json_schema must be an object with a 'schema' (and 'name')",
                                  param="response_format.json_schema")
        return json_schema(spec["schema"], "response_format.json_schema.schema")
    raise BadRequestError(f"response_format.type={kind!r} is invalid: use 'text', 'json_object' or 'json_schema'",
                          param="response_format.type")


def openai_constraint(guided_json: Any = None, guided_regex: Any = None, guided_choice: Any = None,
                      guided_grammar: Any = None, response_format: dict[str, Any] | None = None,
                      tools_constraint: StructuredOutput | None = None) -> StructuredOutput | None:
    built = response_format_constraint(response_format)
    if built is not None and tools_constraint is not None:
        raise BadRequestError("response_format and tool_choice both constrain the output: send one",
                              param="response_format")
    return _one({"guided_json": guided_json, "guided_regex": guided_regex, "guided_choice": guided_choice,
                 "guided_grammar": guided_grammar}, built or tools_constraint)


def native_constraint(json_schema_text: Any = None, regex_text: Any = None, ebnf: Any = None
                      ) -> StructuredOutput | None:
    return _one({"sampling_params.json_schema": json_schema_text, "sampling_params.regex": regex_text,
                 "sampling_params.ebnf": ebnf})
