"""EngineCore: the token loop. Schedules a step, runs it, decides which sequences finished.

It speaks token ids only (no text): detokenization and stop strings live in processor.py,
so the server can run them off this loop.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch

from graphserve.config import EngineConfig
from graphserve.engine.kv_cache import BlockManager
from graphserve.engine.processor import resolve_max_model_len
from graphserve.engine.request import CoreOutput, EngineRequest, Sequence
from graphserve.engine.runner import ModelRunner, cpu_kv_tokens
from graphserve.engine.scheduler import Scheduler, SchedulerOutput
from graphserve.engine.startup import start_gpu
from graphserve.engine.telemetry import StepRecord, Telemetry
from graphserve.errors import BadRequestError, ConfigError
from graphserve.layers.sampler import SEED_MASK, SamplerOutput
from graphserve.models.loader import load_model
from graphserve.outputs import TokenLogprob

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_usage: float
    prefix_cache_hit_rate: float
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class EngineCore:
    def __init__(self, config: EngineConfig):
        if config.tp != 1:
            # `graphserve plan --tp` models tensor parallelism; the engine itself runs one device.
            raise ConfigError(f"--tp={config.tp} is not supported by the engine: it runs on one device (use --tp 1)",
                              param="tp")
        self.config = config
        self.device = resolve_device(config.device)
        loaded = load_model(config, self.device)
        self.tokenizer = loaded.tokenizer
        self.info = loaded.info
        self.hf_config = loaded.hf_config
        self.chat_template = loaded.chat_template
        self.max_model_len = resolve_max_model_len(config, self.info)
        self._eos_ids = frozenset(self.info.eos_token_ids)
        self.memory_plan = None
        if self.device.type == "cuda":
            gpu = start_gpu(config, loaded, self.device, self.max_model_len)
            self.runner, self.memory_plan = gpu.runner, gpu.plan
            num_blocks, max_running = gpu.runner.num_blocks, gpu.max_running_requests
        else:
            num_blocks = cpu_kv_tokens(config, self.info) // config.block_size + 1  # + the dummy block
            max_running = None
            self.runner = ModelRunner(config, loaded, num_blocks, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, max_running)
        self.telemetry = Telemetry()
        self._rng = random.Random(config.seed)  # seeds of unseeded requests: varied, yet reproducible per run
        self._requests: dict[str, list[Sequence]] = {}
        self._pending: list[CoreOutput] = []  # abort notices, delivered by the next step()
        self._step_id = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        logger.info(
            "engine ready: model=%s device=%s dtype=%s kv pool=%d tokens (%d blocks of %d), max_model_len=%d",
            config.model, self.device, self.info.dtype, (num_blocks - 1) * config.block_size, num_blocks - 1,
            config.block_size, self.max_model_len,
        )

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        if req.request_id in self._requests:
            raise BadRequestError(f"request_id={req.request_id!r} is already running", param="request_id")
        p = req.params
        # InputProcessor refused requests that cannot fit the pool; one that got here anyway is a caller bug
        assert self.block_manager.blocks_needed(len(req.prompt_token_ids) + (p.max_tokens or 0)) \
            <= self.block_manager.num_usable_blocks, f"{req.request_id}: does not fit the KV pool"
        base = (p.seed if p.seed is not None else self._rng.getrandbits(63)) & SEED_MASK
        seqs: list[Sequence] = []
        for i in range(p.n):
            seed = base if i == 0 else hash((base, i)) & SEED_MASK  # siblings draw different streams
            seq = Sequence(req.request_id, i, req.prompt_token_ids, p, seed, req.arrival_time,
                           parent=seqs[0] if seqs else None)
            seqs.append(seq)
            self.scheduler.add(seq)
        self._requests[req.request_id] = seqs
        self.prompt_tokens_total += len(req.prompt_token_ids)

    def abort_requests(self, request_ids, error: str | None = None) -> None:
        for rid in request_ids:
            for seq in self.scheduler.abort(rid):
                seq.finish_reason = "abort"
                self._pending.append(self._output(seq, [], None, error=error))
            self._requests.pop(rid, None)

    @property
    def kv_blocks(self) -> tuple[int, int]:
        """(usable blocks, tokens per block) of the KV pool."""
        return self.block_manager.num_usable_blocks, self.block_manager.block_size

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_usage=bm.usage(),
            prefix_cache_hit_rate=bm.hit_rate(),
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        outputs, self._pending = self._pending, []
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        for seq in sched.failed:
            outputs.append(self._output(seq, [], None, error=seq.error))
            self._forget(seq)
        if sched.is_empty:
            return outputs
        context_tokens = sum([s.seq.num_computed_tokens for s in sched.scheduled]) + sched.num_tokens
        try:
            sampled = self.runner.execute(sched)
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving the others
            logger.exception("engine step failed; failing %d sequence(s)", len(sched.scheduled))
            ids = list(dict.fromkeys(s.seq.request_id for s in sched.scheduled))
            self.abort_requests(ids, error=f"{type(exc).__name__}: {exc}")
            outputs += self._pending
            self._pending = []
            return outputs
        outputs += self._advance(sched, sampled)
        self._record(sched, start, context_tokens)
        return outputs

    def _advance(self, sched: SchedulerOutput, sampled: SamplerOutput) -> list[CoreOutput]:
        appended = self.scheduler.update(sched, sampled.token_ids)
        self.generation_tokens_total += len(appended)
        # Rows are looked up only when the step computed logprobs.
        row_of = {s.seq.seq_id: i for i, s in enumerate(sched.scheduled)} if sampled.logprobs is not None else None
        outputs = []
        for seq, token in appended:
            logprobs = None
            if row_of is not None and seq.params.logprobs is not None:
                k = seq.params.logprobs
                row = row_of[seq.seq_id]
                top = list(zip(sampled.top_ids[row][:k], sampled.top_logprobs[row][:k]))
                logprobs = [TokenLogprob(token, sampled.logprobs[row], top)]
            reason, stop_reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason, stop_reason)
                self._forget(seq)
            outputs.append(self._output(seq, [token], logprobs))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        p = seq.params
        num_output = len(seq.output_token_ids)
        if num_output >= p.min_tokens:
            if not p.ignore_eos and token in self._eos_ids:
                return "stop", None
            if p.stop_token_ids and token in p.stop_token_ids:
                return "stop", token
        if p.max_tokens is not None and num_output >= p.max_tokens:
            return "length", None
        if len(seq.prompt_token_ids) + num_output >= self.max_model_len:
            return "length", None
        return None, None

    def _forget(self, seq: Sequence) -> None:
        seqs = self._requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self._requests[seq.request_id]

    def _output(self, seq: Sequence, tokens: list[int], logprobs, error: str | None = None) -> CoreOutput:
        return CoreOutput(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
            first_scheduled_time=seq.first_scheduled_time,
        )

    def _record(self, sched: SchedulerOutput, start: float, context_tokens: int) -> None:
        self._step_id += 1
        n = len(sched.scheduled)
        shape = self.runner.last_shape
        self.telemetry.record(
            StepRecord(
                step=self._step_id,
                time=time.time(),
                kind=sched.kind,
                batch_size=n,
                padded_size=shape.padded_size,
                graph=shape.graph,
                mode=shape.mode,
                num_tokens=sched.num_tokens,
                prefill_tokens=sched.num_prefill_tokens,
                decode_tokens=sched.num_decode_tokens,
                step_ms=(time.perf_counter() - start) * 1000.0,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                kv_usage=self.block_manager.usage(),
                context_tokens=context_tokens,
                preempted=len(sched.preempted),
            )
        )
