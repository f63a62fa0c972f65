"""EngineCore: the token loop. Schedules a step, runs it, decides which sequences finished.

It speaks token ids, but for the stop strings (stop_strings.py): a request finishes here, in the step that
made its last token, whatever ended it. Streaming text is the output processor's work, off this loop.

With the overlap schedule (on CUDA by default) a call to ``step`` schedules and launches step N+1
before it waits for step N's ids, so the host's work for N+1 runs while the device computes N.
Step N+1 is built before N's tokens are known: each sequence's next input is held as a stand-in that
the runner resolves on the device, and a sequence that N finishes (a stop token) runs one step more,
whose token is dropped. Steps whose sampling needs the tokens on the host (penalties count them) wait
for the step in flight first. Structured output needs step N's tokens only for its masks, which are
applied after the forward: step N+1's forward is queued first, then the host waits for N's ids,
advances the grammars and fills N+1's masks while the device computes (structured/manager.py).
"""

from __future__ import annotations

import logging
import random
import time
import weakref

import torch

from graphserve.config import EngineConfig
from graphserve.engine.gc_clock import gc_clock
from graphserve.engine.gpu_share import apply_memory_share
from graphserve.engine.inflight import InFlightStep
from graphserve.engine.input_processor import resolve_max_model_len
from graphserve.engine.kv_cache import BlockManager
from graphserve.engine.parallel_driver import start_ranks, stop_ranks
from graphserve.engine.rank_worker import start_runner
from graphserve.engine.request import CoreOutput, EngineRequest, Sequence, SequenceStatus
from graphserve.engine.scheduler import Scheduler, SchedulerOutput
from graphserve.engine.step_sync import StepSender
from graphserve.engine.stop_strings import StopChecker
from graphserve.engine.telemetry import EngineStats, Telemetry
from graphserve.errors import BadRequestError
from graphserve.layers.sampler import SEED_MASK, SamplerOutput
from graphserve.models.host_memory import check_host_memory
from graphserve.models.loader import load_model
from graphserve.outputs import TokenLogprob
from graphserve.structured.manager import StructuredOutputManager

# how long a failed tp/ep step waits for the rank watchers to name a dead peer (a step fails rarely; a peer's
# death reaches the collective and its watcher within milliseconds of each other)
RANK_SETTLE_S = 0.5

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        apply_memory_share(self.device)
        check_host_memory(config, self.device)  # refused here, not by the kernel's OOM killer mid-load
        # --tp/--ep: this process is rank 0 (the driver); the other ranks run engine/rank_worker.py
        self.ranks = start_ranks(config, self.device)
        try:
            loaded = load_model(config, self.device)
            self.max_model_len = resolve_max_model_len(config, loaded.info)
            start = start_runner(config, loaded, self.device, self.max_model_len)
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = loaded.tokenizer
        self.info = loaded.info
        self.hf_config = loaded.hf_config
        self.chat_template = loaded.chat_template
        self._eos_ids = frozenset(self.info.eos_token_ids)
        self.runner, self.memory_plan = start.runner, start.plan
        num_blocks, max_running = self.runner.num_blocks, start.max_running_requests
        if self.ranks is not None:
            self.runner.peers = StepSender()
            self._finalizer = weakref.finalize(self, stop_ranks, self.ranks, self.runner)
        # a model whose every layer is windowed gives back the blocks outside its running sequences' windows
        # (DeepSeek-V4: latent pages of their own, which the windows of running sequences hold)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          window=self.info.kv.release_window, latent_pages=self.runner.latent_pages,
                                          latent_window=self.info.kv.latent_window)  # fmt: skip
        self.runner.page_source = self.block_manager.pages
        if self.block_manager.pages is not None:
            kv = self.info.kv
            logger.info("latent pages: %d of %d tokens (%.2f GiB) for the windows of %d tokens of running requests "
                        "and cached prefixes, beside %d blocks", self.runner.latent_pages - 1, config.block_size,
                        self.runner.latent_pages * config.block_size * kv.latent_bytes_per_token / (1 << 30),
                        kv.latent_window, num_blocks - 1)  # fmt: skip
        self.scheduler = Scheduler(config, self.block_manager, max_running)
        self.telemetry = Telemetry()
        self._rng = random.Random(config.seed)  # seeds of unseeded requests: varied, yet reproducible per run
        self._requests: dict[str, list[Sequence]] = {}
        self._pending: list[CoreOutput] = []  # abort notices, delivered by the next step()
        self._step_id = 0
        self.overlap = config.overlap_schedule == "on" or (config.overlap_schedule == "auto" and self.device.type == "cuda")
        self._inflight: InFlightStep | None = None
        self._last_resolved = 0.0  # perf_counter when the previous step's ids were read
        self._gc_clock = gc_clock()
        self._gc_ms_seen = self._gc_clock.total_ms  # the collector's running total at the last record
        self._penalized = 0  # live requests whose sampling counts their own output tokens
        self.stop_checker = StopChecker(self.tokenizer)
        self.structured = StructuredOutputManager(self.tokenizer, self.info.vocab_size, list(self.info.eos_token_ids))
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        logger.info(
            "engine ready: model=%s device=%s dtype=%s kv pool=%d tokens (%d blocks of %d), max_model_len=%d, "
            "overlap schedule=%s, tp=%d ep=%d",
            config.model, self.device, self.info.dtype, (num_blocks - 1) * config.block_size, num_blocks - 1,
            config.block_size, self.max_model_len, "on" if self.overlap else "off", config.tp, config.ep,
        )

    def shutdown(self) -> None:
        """Stop the other ranks (tp/ep > 1); the engine cannot step afterwards. Idempotent."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        elif self.ranks is not None:
            stop_ranks(self.ranks, None)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        if req.request_id in self._requests:
            raise BadRequestError(f"request_id={req.request_id!r} is already running", param="request_id")
        p = req.params
        # InputProcessor refused requests that cannot fit the pool; one that got here anyway is a caller bug
        held = self.info.kv.held_tokens(len(req.prompt_token_ids) + (p.max_tokens or 0), self.config.block_size,
                                        self.config.chunked_prefill_size)  # fmt: skip
        assert self.block_manager.blocks_needed(held) <= self.block_manager.num_usable_blocks, \
            f"{req.request_id}: does not fit the KV pool"
        base = (p.seed if p.seed is not None else self._rng.getrandbits(63)) & SEED_MASK
        seqs: list[Sequence] = []
        for i in range(p.n):
            seed = base if i == 0 else hash((base, i)) & SEED_MASK  # siblings draw different streams
            seq = Sequence(req.request_id, i, req.prompt_token_ids, p, seed, req.arrival_time,
                           parent=seqs[0] if seqs else None)
            seq.max_total = min(seq.max_total, self.max_model_len)
            if p.stop:
                seq.stop_watch = self.stop_checker.watch(req.prompt_token_ids, p.stop, p.skip_special_tokens)
            seqs.append(seq)
            if p.structured is None:
                self.scheduler.add(seq)
        if p.structured is not None:
            self.structured.add(req.request_id, seqs)  # scheduled once its grammar is compiled
        self._requests[req.request_id] = seqs
        self._penalized += p.has_penalties
        self.prompt_tokens_total += len(req.prompt_token_ids)

    def abort_requests(self, request_ids, error: str | None = None) -> None:
        for rid in request_ids:
            self._pending += self._abort(rid, self.scheduler.abort(rid) + self.structured.abort(rid), error)

    @property
    def kv_blocks(self) -> tuple[int, int]:
        """(usable blocks, tokens per block) of the KV pool."""
        return self.block_manager.num_usable_blocks, self.block_manager.block_size

    @property
    def has_step_in_flight(self) -> bool:
        """A step launched whose ids are not read yet (the step profiler skips its record)."""
        return self._inflight is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending) or self._inflight is not None

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self.structured.compiling),
            kv_usage=bm.usage(),
            prefix_cache_hit_rate=bm.hit_rate(),
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            **self._page_stats(),
        )

    def _page_stats(self) -> dict[str, int]:
        bm = self.block_manager
        if bm.pages is None:
            return {}
        used, idle, total = bm.page_counts()
        return dict(latent_pages_used=used, latent_pages_idle=idle, latent_pages_total=total,
                    num_preemptions_for_pages=self.scheduler.num_preemptions_for_pages)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """Schedule and launch the next step; return the outputs of the step whose ids arrived
        (this one, or with the overlap schedule the one launched by the previous call)."""
        if self.ranks is not None:
            self.ranks.check()  # a dead rank: fail now rather than wait on a collective it never joins
        outputs, self._pending = self._pending, []
        if self.structured.compiling:
            outputs += self._admit_compiled()
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.preempted_for_pages:
            self._log_page_preemption(sched.preempted_for_pages)
        for seq in sched.failed:
            outputs.append(CoreOutput.of(seq, [], error=seq.error))
            self._forget(seq)
        launched = None
        if not sched.is_empty:
            if self._inflight is not None and self._penalized:
                outputs += self._resolve()  # penalties count the output tokens: they must be on the host
                self.scheduler.drop_finished(sched)  # some may have met a stop token just now
            launched = self._launch(sched, start) if not sched.is_empty else None
            outputs += self._pending  # requests failed by a launch that raised
            self._pending = []
        if self._inflight is not None:
            outputs += self._resolve()
        if launched is not None:
            self._inflight = launched
            if not self.overlap:
                outputs += self._resolve()
        elif self._inflight is None and not outputs:
            self.structured.wait()  # only requests waiting for their grammar: sleep on the compile, not spin
        return outputs

    def _log_page_preemption(self, n: int) -> None:
        """Which resource ran out, for `graphserve doctor` (analysis/doctor.py reads this line): latent pages, with
        KV blocks to spare."""
        bm = self.block_manager
        used, idle, total = bm.page_counts()
        logger.warning("preempted %d request(s) for want of latent pages, not KV blocks: %d of %d latent pages held by "
                       "running windows, %d idle with cached prefixes; %d of %d KV blocks free", n, used, total, idle,
                       bm.num_free_blocks, bm.num_usable_blocks)  # fmt: skip

    def _admit_compiled(self) -> list[CoreOutput]:
        """Schedule the requests whose grammar is compiled; fail those whose compile failed or timed out."""
        ready, failed = self.structured.admit_ready()
        for seq in ready:
            self.scheduler.add(seq)
        outputs = []
        for rid, seqs, why in failed:
            field = seqs[0].params.structured.field
            outputs += self._abort(rid, seqs, f"{field} is invalid: {why}", error_param=field)
        return outputs

    def _abort(self, rid: str, seqs: list[Sequence], error: str | None, error_param: str | None = None
               ) -> list[CoreOutput]:
        """End ``seqs``, the sequences of request ``rid`` still unfinished, as aborted; the request leaves."""
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        outputs = [CoreOutput.of(seq, [], error=error, error_param=error_param) for seq in seqs]
        left = self._requests.pop(rid, None)
        if left:
            self._drop_request(left[0])
        return outputs

    def _resolve_in_flight(self) -> None:
        """Structured output's masks of the step being launched need the ids of the one in flight: read
        them now, inside that launch, once its forward is queued (this step() call returns their outputs)."""
        if self._inflight is not None:
            self._pending += self._resolve()

    def _launch(self, sched: SchedulerOutput, start: float) -> InFlightStep | None:
        mask_fn = self.structured.step_masks(sched, self._resolve_in_flight)
        launch_start = time.perf_counter()
        try:
            pending = self.runner.launch(sched, mask_fn)
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving the others
            self._fail_step(sched, exc)
            return None
        launched = time.perf_counter()
        completed = self.scheduler.advance(sched)
        return InFlightStep(sched, pending, completed, self.runner.last_shape, start, self.runner.last_context_tokens,
                            self.runner.last_expert_load, self.runner.last_comm,
                            host_ms=(1000.0 * (launch_start - start), 1000.0 * (launched - launch_start)))

    def _resolve(self) -> list[CoreOutput]:
        """Wait for the step in flight, put its tokens in place and decide who finished."""
        step, self._inflight = self._inflight, None
        try:
            sampled = step.pending.result()
        except Exception as exc:  # noqa: BLE001
            self._fail_step(step.sched, exc)
            outputs, self._pending = self._pending, []
            return outputs
        outputs = self._emit(step, sampled)
        self.scheduler.commit_full_blocks(step.sched)
        self._record(step)
        return outputs

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> None:
        if self.ranks is not None:
            self.ranks.settle(RANK_SETTLE_S)  # a dead rank ends the engine here, naming the rank
        logger.error("engine step failed (%s: %s); failing %d sequence(s)", type(exc).__name__, exc,
                     len(sched.scheduled), exc_info=exc)
        ids = list(dict.fromkeys(s.seq.request_id for s in sched.scheduled))
        self.abort_requests(ids, error=f"{type(exc).__name__}: {exc}")

    def _emit(self, step: InFlightStep, sampled: SamplerOutput) -> list[CoreOutput]:
        tokens = sampled.token_ids
        finished = SequenceStatus.FINISHED
        outputs: list[CoreOutput] = []
        watched: list[tuple[Sequence, int, CoreOutput]] = []  # running on; their stop strings decide below
        for row, seq, index in step.completed:
            if seq.status is finished:
                continue  # aborted (or finished by an earlier token) while the step ran
            token = tokens[row]
            seq.output_token_ids[index] = token
            self.generation_tokens_total += 1
            logprobs = None
            if sampled.logprobs is not None and seq.params.logprobs is not None:
                k = seq.params.logprobs
                top = list(zip(sampled.top_ids[row][:k], sampled.top_logprobs[row][:k]))
                logprobs = [TokenLogprob(token, sampled.logprobs[row], top)]
            reason, stop_reason = self._finish_reason(seq, token, index + 1)
            error = None
            ended = self.structured.accept(seq, token) if seq.grammar is not None else None
            if ended is not None:  # the grammar is complete, or the token breaks it
                reason, error = ended
                stop_reason = None
            if reason is not None:
                self._finish(seq, index, reason, stop_reason)
            out = CoreOutput.of(seq, [token], logprobs, error=error)
            outputs.append(out)
            if reason is None and seq.stop_watch is not None:
                watched.append((seq, index, out))
        if watched:
            stops = self.stop_checker.check([(seq.stop_watch, seq.output_token_ids[index])
                                             for seq, index, _ in watched])  # fmt: skip
            for (seq, index, out), stop in zip(watched, stops):
                if stop is not None:
                    self._finish(seq, index, "stop", stop)
                    out.finish_reason, out.stop_reason = "stop", stop
        return outputs

    def _finish(self, seq: Sequence, index: int, reason: str, stop_reason: str | int | None) -> None:
        """End ``seq`` at its ``index``-th output token."""
        del seq.output_token_ids[index + 1 :]  # a token of a step launched meanwhile
        self.scheduler.finish(seq, reason, stop_reason)
        self._forget(seq)

    def _finish_reason(self, seq: Sequence, token: int, num_output: int) -> tuple[str | None, int | None]:
        """Why the sequence ends with ``token``, its ``num_output``-th output token (None: it goes on)."""
        p = seq.params
        if num_output >= p.min_tokens:
            if not p.ignore_eos and token in self._eos_ids:
                return "stop", None
            if p.stop_token_ids and token in p.stop_token_ids:
                return "stop", token
        if len(seq.prompt_token_ids) + num_output >= seq.max_total:  # max_tokens, capped at max_model_len
            return "length", None
        return None, None

    def _forget(self, seq: Sequence) -> None:
        seqs = self._requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self._requests[seq.request_id]
            self._drop_request(seq)

    def _drop_request(self, seq: Sequence) -> None:
        """Bookkeeping of a request that left (``seq``: any of its sequences)."""
        self._penalized -= seq.params.has_penalties
        if seq.params.structured is not None:
            self.structured.finished()

    def _record(self, step: InFlightStep) -> None:
        """One telemetry record per step. Its time runs from when the step began to be scheduled,
        or from when the previous step's ids arrived if later: with the overlap schedule, the rate
        at which steps complete, host work hidden under the device's included only where it is not."""
        now = time.perf_counter()
        start = max(step.start, self._last_resolved)
        self._last_resolved = now
        self._step_id += 1
        gc_total = self._gc_clock.total_ms  # read once: a collection between two reads would be lost
        gc_ms, self._gc_ms_seen = gc_total - self._gc_ms_seen, gc_total
        bm = self.block_manager
        self.telemetry.record(step.record(self._step_id, (now - start) * 1000.0, len(self.scheduler.running),
                                          len(self.scheduler.waiting), bm.usage(), gc_ms, bm.page_counts()))
