"""LLMEngine: input processor + core + output processor, driven synchronously by the caller."""

from __future__ import annotations

from typing import Any

from graphserve.config import EngineConfig
from graphserve.engine.core import EngineCore
from graphserve.engine.processor import InputProcessor, OutputProcessor
from graphserve.engine.telemetry import EngineStats
from graphserve.outputs import RequestOutput
from graphserve.sampling_params import SamplingParams


class LLMEngine:
    """``stream_outputs=False``: ``step`` returns a request's output only once it has finished."""

    def __init__(self, config: EngineConfig, stream_outputs: bool = True):
        self.config = config
        self.core = EngineCore(config)
        self.input_processor = InputProcessor(self.core.tokenizer, self.core.info, config, self.core.kv_blocks)
        self.output_processor = OutputProcessor(self.core.tokenizer, stream=stream_outputs)

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def info(self):
        return self.core.info

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue; raises BadRequestError before anything is queued."""
        req = self.input_processor.process(request_id, prompt, params, arrival_time)
        self.core.add_request(req)
        self.output_processor.add(req)

    def abort_request(self, request_id: str) -> None:
        """The request's final output (finish_reason "abort") comes from the next step()."""
        self.core.abort_requests([request_id])

    def step(self) -> list[RequestOutput]:
        outputs, to_abort = self.output_processor.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.core.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
