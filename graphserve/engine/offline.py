"""OfflineDriver: input processor + core + output processor, driven synchronously by the caller (``LLM``).

The core decides when each request finishes; the output processor (the server's too) turns its token rows into
text deltas, which ``_Collected`` folds into the cumulative ``RequestOutput`` that offline callers read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from graphserve.config import EngineConfig
from graphserve.engine.core import EngineCore
from graphserve.engine.input_processor import InputProcessor
from graphserve.engine.output_processor import OutputProcessor, RequestDelta
from graphserve.engine.request import EngineRequest
from graphserve.engine.step_outputs import StepOutputs
from graphserve.engine.telemetry import EngineStats
from graphserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from graphserve.sampling_params import SamplingParams


class _Collected:
    """One request's output so far, built from its deltas."""

    def __init__(self, req: EngineRequest):
        self.req = req
        p = req.params
        self.choices = [CompletionOutput(i, "", [], logprobs=[] if p.logprobs is not None else None)
                        for i in range(p.n)]
        self.metrics = RequestMetrics(arrival_time=req.arrival_time)
        self.finished = False
        self.error: str | None = None
        self.error_param: str | None = None

    def apply(self, d: RequestDelta) -> None:
        m = self.metrics
        if m.first_scheduled_time is None and d.first_scheduled_time is not None:
            # the first report is the first choice's: its siblings hit its prompt blocks, counted once
            m.first_scheduled_time = d.first_scheduled_time
            m.num_cached_tokens = d.num_cached_tokens or 0
        if d.num_tokens:
            if m.first_token_time is None:
                m.first_token_time = d.time
            m.last_token_time = d.time
        for i, cd in d.choices.items():
            c = self.choices[i]
            c.text += cd.text
            c.token_ids += cd.token_ids
            if c.logprobs is not None and cd.logprobs:
                c.logprobs += cd.logprobs
            if cd.finish_reason is not None:
                c.finish_reason, c.stop_reason = cd.finish_reason, cd.stop_reason
        if d.error is not None:
            self.error, self.error_param = d.error, d.error_param
            for c in self.choices:
                if c.finish_reason is None:
                    c.finish_reason = "abort"
        if d.finished:
            self.finished = True
            m.finished_time = d.time

    def output(self) -> RequestOutput:
        outs = [dataclasses.replace(c, token_ids=list(c.token_ids),
                                    logprobs=list(c.logprobs) if c.logprobs is not None else None)
                for c in self.choices]
        return RequestOutput(self.req.request_id, self.req.prompt_text, self.req.prompt_token_ids, outs,
                             self.finished, dataclasses.replace(self.metrics), self.error, self.error_param)


class OfflineDriver:
    """``stream_outputs=False``: ``step`` returns a request's output only once it has finished (and its text is
    decoded then, in one pass)."""

    def __init__(self, config: EngineConfig, stream_outputs: bool = True):
        self.config = config
        self.stream_outputs = stream_outputs
        self.core = EngineCore(config)
        self.input_processor = InputProcessor(self.core.tokenizer, self.core.info, config, self.core.kv_blocks)
        self.output_processor = OutputProcessor(self.core.tokenizer)
        self._collected: dict[str, _Collected] = {}
        self._reported: set[str] = set()  # requests whose first-seen facts reached the output processor

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def info(self):
        return self.core.info

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue; raises BadRequestError before anything is queued."""
        self.add_processed(self.input_processor.process(request_id, prompt, params, arrival_time))

    def add_processed(self, req: EngineRequest) -> None:
        """Queue a request that the input processor made."""
        self.core.add_request(req)
        self.output_processor.add(req.request_id, req.prompt_token_ids, req.params, stream=self.stream_outputs)
        self._collected[req.request_id] = _Collected(req)

    def abort_request(self, request_id: str) -> None:
        """The request's final output (finish_reason "abort") comes from the next step()."""
        self.core.abort_requests([request_id])

    def step(self) -> list[RequestOutput]:
        rows = StepOutputs()
        rows.add_core_outputs(self.core.step(), self._reported)
        results = []
        for d in self.output_processor.process(rows):
            got = self._collected.get(d.request_id)
            if got is None:
                continue
            got.apply(d)
            if got.finished:
                del self._collected[d.request_id]
            if self.stream_outputs or got.finished:
                results.append(got.output())
        return results

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.core.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
