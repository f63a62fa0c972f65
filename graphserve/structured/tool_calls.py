"""OpenAI ``tools``: the request side (which calls a ``tool_choice`` allows, as a constraint) and the
response side (the model's text -> ``tool_calls``).

``tool_choice``:
- ``"none"``: tools are shown to the template but the output is plain text;
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects, one
  per call, each matching its tool's parameter schema;
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's arguments object;
- ``"auto"`` (the default with tools): unconstrained; the model's own tool-call format is parsed:
  Hermes/Qwen ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks, or a Llama 3.1 JSON
  call ``{"name": ..., "parameters": ...}`` (after an optional ``<|python_tag|>``, several joined by ";").
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from graphserve.errors import BadRequestError
from graphserve.structured.constraint import StructuredOutput, json_schema

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.S)


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    names: tuple[str, ...]  # the request's tool names
    named: str | None = None  # mode "named": the function to call


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_choice(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool = True
                ) -> tuple[ToolChoice | None, StructuredOutput | None]:
    """Check ``tools`` / ``tool_choice`` and return what the response side needs and the constraint, if any.
    ``parallel``: OpenAI's ``parallel_tool_calls``; False allows one call."""
    if not tools:
        if choice not in (None, "none"):
            raise BadRequestError(f"tool_choice={choice!r} needs tools", param="tool_choice")
        return None, None
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise BadRequestError(f"tools[{i}]={tool!r} is invalid: each tool must be "
                                  "{'type': 'function', 'function': {'name': ..., 'parameters': ...}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise BadRequestError(f"tools[{i}].function.name={name!r} is invalid: 1-64 letters, digits, _ . -",
                                  param=f"tools[{i}].function.name")
        if name in functions:
            raise BadRequestError(f"tools[{i}].function.name={name!r} is invalid: names must be unique",
                                  param=f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        json_schema(params, f"tools[{i}].function.parameters")  # a 400 for an invalid or unsupported schema
        functions[name] = params
    names = tuple(functions)
    if choice is None or choice == "auto":
        return ToolChoice("auto", names), None
    if choice == "none":
        return ToolChoice("none", names), None
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                  "required": ["name", "parameters"]} for n, p in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolChoice("required", names), json_schema(schema, "tool_choice")
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise BadRequestError(f"tool_choice={choice!r} is invalid: use 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name not in functions:
        raise BadRequestError(f"tool_choice names function {name!r}, which is not among tools {list(names)}",
                              param="tool_choice")
    return ToolChoice("named", names, name), json_schema(functions[name], "tool_choice")


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _json_calls(text: str, names: tuple[str, ...]) -> list[dict[str, Any]] | None:
    """Llama 3.1 JSON calls (``{"name", "parameters"}``, or ``"arguments"``), ";"-separated; None if not all parse."""
    calls = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        try:
            obj = json.loads(part)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        args = obj.get("parameters", obj.get("arguments", {}))
        if not isinstance(args, (dict, str)):
            return None
        calls.append(_call(obj["name"], args))
    return calls or None


_NAME_THEN_ARGS = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"?\s*(?:,\s*"parameters"\s*:\s*(.*))?', re.S)


def _cut_calls(text: str) -> list[dict[str, Any]]:
    """The calls of a "required" output (a JSON array of {"name", "parameters"}, in that order: the grammar
    writes properties as the schema lists them) that max_tokens cut short: the complete ones, then the one
    it stopped inside, with its name so far and its arguments text so far, as OpenAI reports a call cut by
    its length limit (never the raw array as content)."""
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    calls: list[dict[str, Any]] = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return calls
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        calls.append(_call(item["name"], item["parameters"]))
    partial = _NAME_THEN_ARGS.match(text, pos)
    if partial is not None:
        name, args = partial.group(1), partial.group(2) or ""
        calls.append({"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}})
    return calls


def parse_tool_calls(text: str, choice: ToolChoice) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output; content None when the output is only calls."""
    if choice.mode == "named":
        return None, [_call(choice.named, text)]
    if choice.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None, _cut_calls(text)  # cut short by max_tokens (finish_reason "length")
        return None, [_call(it["name"], it["parameters"]) for it in items]
    if choice.mode != "auto":
        return text, []
    if HERMES_OPEN in text:
        head = text[: text.index(HERMES_OPEN)]
        calls = []
        for block in _HERMES_BLOCK.findall(text):
            try:
                obj = json.loads(block)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(obj, dict) or obj.get("name") not in choice.names:
                return text, []
            calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
        return (head.strip() or None), calls
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    if body.startswith("{"):
        calls = _json_calls(body, choice.names)
        if calls:
            return None, calls
    return text, []


def finish_reason(reason: str | None, choice: ToolChoice | None, calls: list[dict[str, Any]]) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named call ends with "stop"."""
    if calls and reason == "stop" and choice is not None and choice.mode in ("auto", "required"):
        return "tool_calls"
    return reason


def chat_message(text: str, reason: str | None, choice: ToolChoice | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished chat choice and its finish_reason."""
    if choice is None or choice.mode == "none":
        return {"role": "assistant", "content": text}, reason
    content, calls = parse_tool_calls(text, choice)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, finish_reason(reason, choice, calls)
