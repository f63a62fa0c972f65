"""Streaming a chat choice whose output may hold tool calls: text deltas in, the message pieces of OpenAI's chat
deltas out (``{"content": ...}``, ``{"tool_calls": [...]}``). The output processor keeps one per choice of a request
streamed with tools (engine/output_processor.py); the server puts each piece in a chunk (server/serving_openai.py).

OpenAI streams a call as a first delta carrying ``index``, ``id``, ``type`` and the function's name
(arguments ``""``), then deltas appending to ``function.arguments``. Here:
- a named ``tool_choice`` knows its function up front: the name goes out first, then every text
  delta as an arguments delta (the constrained output *is* the arguments object);
- ``"required"`` and a call found by ``"auto"`` go out once their JSON is complete: one delta per call
  with its whole arguments string;
- with ``"auto"``, text before a tool-call marker streams as content; text that may start a marker
  (a prefix of ``<tool_call>``, or an output that opens with ``{`` / ``<|python_tag|>``) is held back
  until it is known to be one or not.
"""

from __future__ import annotations

from typing import Any

from graphserve.structured.tool_calls import (
    HERMES_OPEN,
    PYTHON_TAG,
    ToolChoice,
    call_id,
    finish_reason,
    parse_tool_calls,
)


def _held_suffix(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a tool-call marker."""
    for n in range(min(len(text), len(HERMES_OPEN) - 1), 0, -1):
        if HERMES_OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.text = ""
        self.sent = 0  # characters of ``text`` already sent as content
        self.calls_started = False  # "named": the name delta went out

    def feed(self, delta: str, finished: bool, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The chat deltas for ``delta`` (empty list: nothing to send yet) and, once ``finished``,
        the finish_reason to report."""
        self.text += delta
        mode = self.choice.mode
        if mode == "named":
            out = []
            if not self.calls_started:
                self.calls_started = True
                out.append({"tool_calls": [{"index": 0, "id": call_id(), "type": "function",
                                            "function": {"name": self.choice.named, "arguments": ""}}]})
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out, (finish_reason(reason, self.choice, [{}]) if finished else None)
        if finished:
            return self._finish(reason)
        if mode != "auto":  # "required": the calls go out whole, at the end
            return [], None
        pending = self.text[self.sent:]
        lead = self.text.lstrip()
        if HERMES_OPEN in self.text or (self.sent == 0 and (lead.startswith("{") or PYTHON_TAG.startswith(lead[:14])
                                                            or lead.startswith(PYTHON_TAG))):
            cut = self.text.find(HERMES_OPEN)
            if cut > self.sent:  # content before the first call still goes out
                piece, self.sent = self.text[self.sent:cut], cut
                return [{"content": piece}], None
            return [], None
        keep = _held_suffix(pending)
        piece = pending[: len(pending) - keep]
        if not piece:
            return [], None
        self.sent += len(piece)
        return [{"content": piece}], None

    def _finish(self, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        content, calls = parse_tool_calls(self.text, self.choice)
        out: list[dict[str, Any]] = []
        if calls:
            cut = self.text.find(HERMES_OPEN)
            rest = self.text[self.sent:cut] if cut > self.sent else ""  # content before the first call
            if rest.strip():
                out.append({"content": rest})
            for i, call in enumerate(calls):
                out.append({"tool_calls": [{"index": i, **call}]})
        elif len(self.text) > self.sent:
            out.append({"content": self.text[self.sent:]})
        self.sent = len(self.text)
        return out, finish_reason(reason, self.choice, calls)
