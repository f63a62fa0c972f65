"""Token rows in, per-request deltas out: the one output path of ``LLM`` and the server.

Detokenization, the text cut at a stop string, logprobs, the n choices of a request and, for a chat stream
with tools, the tool-call deltas its text makes (structured/tool_stream.py). The engine decides
when a request finishes (stop strings included, engine/stop_strings.py); this only formats: it keeps per
choice the incremental detokenizer and, while a stop string may still complete, the text held back so that
streamed text is never retracted, and emits what is new (text, token ids, logprobs). Nothing cumulative is
copied per step: memory per request is linear in its output, and a consumer that falls behind merges its
pending deltas into one. A request added with ``stream=False`` (offline generation) is decoded once, when
it finishes: the same text, in one pass.

In the server it runs on the output thread (server/output_pump.py), off the HTTP event loop, which registers
requests (``add``) and forgets them (``discard``): both single dict operations, atomic under the GIL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from graphserve.engine.detokenizer import IncrementalDetokenizer, decode_windows
from graphserve.engine.step_outputs import NO_TOKEN, StepOutputs
from graphserve.outputs import TokenLogprob
from graphserve.sampling_params import SamplingParams
from graphserve.structured.tool_calls import ToolChoice
from graphserve.structured.tool_stream import ToolCallStream


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # A request added with tools: the message pieces ({"content": ...} / {"tool_calls": [...]}) this delta's text
    # makes, in order (none while text that may open a call is held back), and once finished the finish_reason
    # with tools ("tool_calls" where the model called). None without tools.
    tool_deltas: list[dict[str, Any]] | None = None
    tool_finish_reason: str | None = None

    def merge(self, later: ChoiceDelta) -> None:
        self.text += later.text
        self.token_ids += later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.tool_deltas is not None:
            self.tool_deltas = (self.tool_deltas or []) + later.tool_deltas
        if later.finish_reason is not None:
            self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
            self.tool_finish_reason = later.tool_finish_reason


@dataclass
class RequestDelta:
    """What is new for one request since its previous delta."""

    request_id: str  # the engine's id
    choices: dict[int, ChoiceDelta] = field(default_factory=dict)
    finished: bool = False
    error: str | None = None
    error_param: str | None = None  # the request field the error blames: the request's fault, a 400
    first_scheduled_time: float | None = None
    num_cached_tokens: int | None = None
    time: float = 0.0  # time.monotonic() when produced

    @property
    def num_tokens(self) -> int:
        """New tokens of the choice that advanced most (choices advance together)."""
        return max((len(c.token_ids) for c in self.choices.values()), default=0)

    def merge(self, later: RequestDelta) -> None:
        for i, c in later.choices.items():
            mine = self.choices.get(i)
            if mine is None:
                self.choices[i] = c
            else:
                mine.merge(c)
        self.finished = self.finished or later.finished
        if self.error is None:
            self.error, self.error_param = later.error, later.error_param
        if self.first_scheduled_time is None:
            self.first_scheduled_time = later.first_scheduled_time
        if self.num_cached_tokens is None:
            self.num_cached_tokens = later.num_cached_tokens
        self.time = later.time


class _Choice:
    __slots__ = ("detok", "held", "finish_reason", "unread", "tools")

    def __init__(self, detok: IncrementalDetokenizer, stream: bool, tools: ToolChoice | None):
        self.detok = detok
        self.held = ""  # decoded text not sent yet: it may be the start of a stop string
        self.finish_reason: str | None = None
        self.unread: list[int] | None = None if stream else []  # not streamed: the ids decoded at the finish
        self.tools = ToolCallStream(tools) if tools is not None and tools.mode != "none" else None


class _Request:
    __slots__ = ("params", "choices", "hold", "want_logprobs")

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams, stream: bool,
                 tools: ToolChoice | None):
        self.params = params
        self.choices = [_Choice(IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens),
                                stream, tools) for _ in range(params.n)]
        # Characters held back while running: one less than the longest stop string, so streamed text is
        # never retracted when the engine reports that a stop string completed.
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.want_logprobs = params.logprobs is not None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream: bool = True,
            tools: ToolChoice | None = None) -> None:
        """``tools``: a chat request streamed with tools, whose deltas then carry ``tool_deltas`` (a whole
        response parses its finished text instead: structured/tool_calls.chat_message)."""
        self._requests[request_id] = _Request(self.tokenizer, prompt_token_ids, params, stream, tools)

    def discard(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, outs: StepOutputs) -> list[RequestDelta]:
        """Deltas of the requests these rows touch; a request whose delta is ``finished`` is forgotten."""
        now = time.monotonic()
        # Group each choice's new tokens first, so a batch that merged several steps detokenizes once per choice.
        grouped: dict[tuple[str, int], list[int]] = {}
        for row, (rid, idx) in enumerate(zip(outs.request_ids, outs.indices)):
            rows = grouped.get((rid, idx))
            if rows is None:
                grouped[(rid, idx)] = [row]
            else:
                rows.append(row)
        deltas: dict[str, RequestDelta] = {}
        reqs: dict[str, _Request] = {}  # looked up once: the loop thread may discard a request meanwhile
        work: list[tuple[_Request, int, list[int], RequestDelta]] = []
        for (rid, idx), rows in grouped.items():
            req = reqs.get(rid) or self._requests.get(rid)
            if req is None:
                continue  # aborted by its consumer: the engine's late rows are dropped
            reqs[rid] = req
            d = deltas.get(rid)
            if d is None:
                d = deltas[rid] = RequestDelta(rid, time=now)
                seen = outs.first_seen.get(rid)
                if seen is not None:
                    d.first_scheduled_time, d.num_cached_tokens = seen
            work.append((req, idx, rows, d))
        texts = self._detokenize(work, outs)
        for (req, idx, rows, d), text in zip(work, texts):
            self._apply(req, idx, rows, outs, d, text)
        for rid, d in deltas.items():
            if reqs[rid].finished or d.error is not None:
                d.finished = True
                self._requests.pop(rid, None)
        return list(deltas.values())

    def _detokenize(self, work: list[tuple[_Request, int, list[int], RequestDelta]], outs: StepOutputs
                    ) -> list[str]:
        """The new text of every streamed choice in ``work``, all windows decoded in one batch call per skip
        mode."""
        pending: dict[bool, list[tuple[int, list[int], list[int]]]] = {}
        texts = [""] * len(work)
        for k, (req, idx, rows, _) in enumerate(work):
            c = req.choices[idx]
            if c.finish_reason is not None or c.unread is not None or any(r in outs.errors for r in rows):
                continue
            tokens = [outs.token_ids[r] for r in rows if outs.token_ids[r] != NO_TOKEN]
            if tokens:
                prefix, full = c.detok.extend(tokens)
                pending.setdefault(req.params.skip_special_tokens, []).append((k, prefix, full))
        for skip, items in pending.items():
            windows = [w for _, prefix, full in items for w in (prefix, full)]
            decoded = decode_windows(self.tokenizer, windows, skip)
            for j, (k, _, _) in enumerate(items):
                texts[k] = work[k][0].choices[work[k][1]].detok.accept(decoded[2 * j], decoded[2 * j + 1])
        return texts

    def _apply(self, req: _Request, idx: int, rows: list[int], outs: StepOutputs, d: RequestDelta,
               text: str) -> None:
        c = req.choices[idx]
        error_row = next((r for r in rows if r in outs.errors), None)
        if error_row is not None:
            d.error, d.error_param = outs.errors[error_row], outs.error_params.get(error_row)
            for other in req.choices:
                if other.finish_reason is None:
                    other.finish_reason = "abort"
            return
        if c.finish_reason is not None:
            return  # a late row of a choice that ended (a sibling's error)
        finish = next((outs.finishes[r] for r in rows if r in outs.finishes), None)
        cd = ChoiceDelta(idx)
        tokens = [outs.token_ids[r] for r in rows if outs.token_ids[r] != NO_TOKEN]
        if tokens:
            cd.token_ids = tokens
            if req.want_logprobs:
                cd.logprobs = [TokenLogprob(outs.token_ids[r], *outs.logprobs[r]) for r in rows if r in outs.logprobs]
            if c.unread is not None:
                c.unread += tokens
            c.held += text
        if finish is not None:
            if c.unread:
                c.held += c.detok.add(c.unread)
            c.held += c.detok.flush()
            reason, stop_reason = finish
            if isinstance(stop_reason, str):
                # The engine stopped at the token completing this stop string; nothing of it was sent, as the
                # held text keeps every place it may start. Its first occurrence there is where it stopped.
                at = c.held.find(stop_reason)
                if at >= 0:
                    c.held = c.held[:at]
            cd.text, c.held = c.held, ""
            c.finish_reason = reason
            cd.finish_reason, cd.stop_reason = reason, stop_reason
        elif c.held:
            keep = req.hold
            cut = len(c.held) - keep if keep else len(c.held)
            if cut > 0:
                cd.text, c.held = c.held[:cut], c.held[cut:]
        if cd.token_ids or cd.text or cd.finish_reason is not None:
            if c.tools is not None:
                cd.tool_deltas, cd.tool_finish_reason = c.tools.feed(cd.text, cd.finish_reason is not None,
                                                                     cd.finish_reason)
            d.choices[idx] = cd
