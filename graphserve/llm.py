"""The offline Python API, in the shape vLLM users know: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from typing import Any

from tqdm.auto import tqdm

from graphserve.config import EngineConfig
from graphserve.engine.offline import OfflineDriver
from graphserve.outputs import RequestOutput
from graphserve.sampling_params import SamplingParams

Prompt = str | dict[str, Any] | list[int]


class LLM:
    def __init__(self, model: str = "builtin:tiny-llama", **engine_args: Any):
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = OfflineDriver(self.config, stream_outputs=False)  # generate returns finished requests only
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts: give one or one each")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        # Validate everything before queueing anything, so one bad prompt leaves the engine untouched.
        requests = [
            self.engine.input_processor.process(f"llm-{next(self._ids)}", p, sp) for p, sp in zip(prompts, params)
        ]
        order = {r.request_id: i for i, r in enumerate(requests)}
        added: list[str] = []
        try:
            for r in requests:
                self.engine.add_processed(r)
                added.append(r.request_id)
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            self._drain()
            raise
        return self._run(order, use_tqdm and len(prompts) > 1)

    def _run(self, order: dict[str, int], show: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="generate", unit="req", disable=not show)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            self._drain()
            raise
        finally:
            bar.close()
        return [r for r in results if r is not None]

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each becomes one prompt."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            text = self.engine.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            # The template already holds any BOS token: encode without adding special tokens again.
            ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
