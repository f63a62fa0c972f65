"""Continuous batching: which sequences run this step, and how many new tokens each.

Order of business every step: running decodes first (one token each), then prefill chunks
(running sequences part-way through their prompt, then waiting ones, oldest first) under the
per-step prefill budget ``chunked_prefill_size``. When the KV pool runs out, the most recently
arrived running sequence is preempted by recompute: its blocks are freed and it goes back to
the front of the waiting queue with its output tokens, to re-prefill later. The oldest running
sequence therefore always progresses; one that cannot fit even alone is failed, not retried.

Where every layer of the model is windowed, each running sequence first gives back the blocks wholly before the
window of its next token (engine/kv_cache.release_outside_window), before any block is asked for: a long
sequence holds its window's blocks, not its length's. Where only the latents are windowed (DeepSeek-V4), it gives back
those blocks' latent pages instead and keeps the blocks.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from graphserve.engine.request import Sequence, SequenceStatus, future_token

if TYPE_CHECKING:
    from graphserve.config import EngineConfig
    from graphserve.engine.kv_cache import BlockManager

CPU_MAX_RUNNING_REQUESTS = 256


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    is_prefill: bool  # fixed at scheduling time (counts change once the step has run)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    preempted_for_pages: int = 0  # of ``preempted``, those that went for want of latent pages, not blocks
    failed: list[Sequence] = field(default_factory=list)  # cannot fit in the KV pool even alone
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def kind(self) -> str:
        if self.num_prefill_tokens and self.num_decode_tokens:
            return "mixed"
        return "prefill" if self.num_prefill_tokens else "decode"

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_running_requests: int | None = None):
        self.config = config
        self.block_manager = block_manager
        self.max_running = max_running_requests or config.max_running_requests or CPU_MAX_RUNNING_REQUESTS
        self.prefill_budget = config.chunked_prefill_size
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # kept in arrival order
        self.num_preemptions = 0
        self.num_preemptions_for_pages = 0  # of num_preemptions, those for want of latent pages (DeepSeek-V4)

    # ---- queue ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Remove every sequence of the request, freeing its blocks; returns them (unfinished)."""
        found = [s for s in self.running if s.request_id == request_id]
        found += [s for s in self.waiting if s.request_id == request_id]
        for seq in found:
            self._remove(seq)
        return found

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        # A sequence that ends in the step that completed its prompt (max_tokens=1, SGLang's prefill-only
        # max_new_tokens=0) is never RUNNING when commit_full_blocks runs: its prompt blocks go into the prefix
        # cache here, before they are freed. Every token it has computed is known by now.
        bm = self.block_manager
        if bm.enable_prefix_caching and seq.num_computed_tokens // bm.block_size > len(seq.block_hashes):
            bm.commit(seq)
        self._remove(seq)
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def _remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled_ids: dict[int, ScheduledSeq] = {}

        def preempt_for(seq: Sequence) -> bool:
            """Free blocks by preempting the newest running sequence; False if ``seq`` itself went."""
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                out.failed.append(seq)
                return False
            self._preempt(victim, out)
            if self.block_manager.short_of == "latent pages":
                out.preempted_for_pages += 1
                self.num_preemptions_for_pages += 1
            sched = scheduled_ids.pop(victim.seq_id, None)
            if sched is not None:
                out.scheduled.remove(sched)
                if sched.is_prefill:
                    out.num_prefill_tokens -= sched.num_new_tokens
                else:
                    out.num_decode_tokens -= sched.num_new_tokens
            return victim is not seq

        def run(seq: Sequence, n: int) -> None:
            sched = ScheduledSeq(seq, n, is_prefill=not (n == 1 and seq.num_pending_tokens == 1))
            scheduled_ids[seq.seq_id] = sched
            out.scheduled.append(sched)
            if sched.is_prefill:
                out.num_prefill_tokens += n
            else:
                out.num_decode_tokens += n

        # 1. decodes, oldest first (the bulk of a step: kept to plain attribute reads, and a new
        # block is asked for only when the next token crosses into one)
        bm = self.block_manager
        block_size = bm.block_size
        running_status = SequenceStatus.RUNNING
        partial: list[Sequence] = []  # running prompts part-way through their prefill
        windowed = bm.slides
        for seq in list(self.running):
            if seq.status is not running_status:
                continue  # preempted earlier in this pass
            if windowed:
                bm.release_outside_window(seq)
            computed = seq.num_computed_tokens
            total = len(seq.prompt_token_ids) + len(seq.output_token_ids)
            if total >= seq.max_total:
                continue  # its last token is still in flight; it finishes when that token arrives
            if total - computed != 1:
                partial.append(seq)
                continue
            if computed >= len(seq.block_table) * block_size:
                while not bm.allocate_slots(seq, 1):
                    if not preempt_for(seq):
                        break
                else:
                    run(seq, 1)
                continue
            sched = ScheduledSeq(seq, 1, is_prefill=False)
            scheduled_ids[seq.seq_id] = sched
            out.scheduled.append(sched)
            out.num_decode_tokens += 1

        # 2. running prompts part-way through their prefill, under the prefill budget
        budget = self.prefill_budget
        for seq in partial:
            if seq.status is not running_status:
                continue
            n = min(seq.num_pending_tokens, budget)
            if n <= 0:
                continue
            while not bm.allocate_slots(seq, n):
                if not preempt_for(seq):
                    break
            else:
                run(seq, n)
                budget -= n

        # 3. admit waiting sequences (not in a step that had to preempt: the pool is short)
        if out.preempted or out.failed:
            self._fail(out)
            return out
        skipped: list[Sequence] = []
        admitted = False
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if self._waits_for_sibling(seq):
                skipped.append(self.waiting.popleft())
                continue
            self.block_manager.match_prefix(seq)
            if windowed:  # a long cached prefix: its blocks before the window go straight back
                bm.release_outside_window(seq)
            if seq.num_preemptions == 0 and seq.first_scheduled_time is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            n = min(seq.num_pending_tokens, budget)
            if not self.block_manager.allocate_slots(seq, n):
                self.block_manager.free(seq)
                if not self.running:
                    self.waiting.popleft()
                    out.failed.append(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            admitted = True
            run(seq, n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        if admitted:  # removals keep the order; only an admitted (maybe preempted, older) one breaks it
            self.running.sort(key=lambda s: s.sort_key)
        self._fail(out)
        return out

    def _waits_for_sibling(self, seq: Sequence) -> bool:
        """n > 1: later siblings start once the first one's full prompt blocks are in the prefix cache
        (committed once the step that computed them has been read back)."""
        parent = seq.parent
        bm = self.block_manager
        if parent is None or not bm.enable_prefix_caching or parent.is_finished:
            return False
        return len(parent.block_hashes) < parent.num_prompt_tokens // bm.block_size

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _fail(self, out: SchedulerOutput) -> None:
        for seq in out.failed:
            if seq.status != SequenceStatus.FINISHED:
                self._remove(seq)
            seq.finish_reason = "abort"
            blocks = self.block_manager.blocks_needed(seq.num_tokens)
            seq.error = (
                f"the sequence needs {seq.num_tokens} tokens ({blocks} KV blocks) but the KV pool holds "
                f"{self.block_manager.num_usable_blocks * self.block_manager.block_size} tokens "
                f"({self.block_manager.num_usable_blocks} blocks); raise --num-kv-tokens or --kv-cache-gb"
            )

    def drop_finished(self, out: SchedulerOutput) -> None:
        """Take sequences that finished after ``out`` was scheduled (their blocks are freed) out of it."""
        finished = SequenceStatus.FINISHED
        gone = [s for s in out.scheduled if s.seq.status is finished]
        for sched in gone:
            out.scheduled.remove(sched)
            if sched.is_prefill:
                out.num_prefill_tokens -= sched.num_new_tokens
            else:
                out.num_decode_tokens -= sched.num_new_tokens

    def advance(self, out: SchedulerOutput) -> list[tuple[int, Sequence, int]]:
        """Count the step's tokens as computed; give each sequence that completes its prompt or a
        decode its next output token, held as ``future_token(row)`` until the step's ids arrive.

        Returns ``(row, sequence, index in output_token_ids)`` for every token so held."""
        completed = []
        running_status = SequenceStatus.RUNNING
        for row, sched in enumerate(out.scheduled):
            seq = sched.seq
            if seq.status is not running_status:
                continue  # aborted or failed while the step was prepared
            computed = seq.num_computed_tokens + sched.num_new_tokens
            seq.num_computed_tokens = computed
            outputs = seq.output_token_ids
            if computed == len(seq.prompt_token_ids) + len(outputs):
                completed.append((row, seq, len(outputs)))
                outputs.append(future_token(row))
        return completed

    def commit_full_blocks(self, out: SchedulerOutput) -> None:
        """Put the blocks the step filled into the prefix cache. Call it once the tokens the step
        computed are all known (a block's hash covers its token ids)."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return
        block_size = bm.block_size
        running_status = SequenceStatus.RUNNING
        for sched in out.scheduled:
            seq = sched.seq
            if seq.status is running_status and seq.num_computed_tokens // block_size > len(seq.block_hashes):
                bm.commit(seq)
