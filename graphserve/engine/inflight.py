"""A launched step whose sampled ids have not reached the host yet, and the telemetry record it becomes
once they have (engine/core.py keeps at most one in flight: the overlap schedule)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphserve.engine.expert_load import ExpertLoadProbe
from graphserve.engine.telemetry import StepRecord

if TYPE_CHECKING:
    import torch

    from graphserve.engine.request import Sequence
    from graphserve.engine.runner import StepShape
    from graphserve.engine.scheduler import SchedulerOutput
    from graphserve.layers.sampler import PendingSample


@dataclass
class InFlightStep:
    sched: SchedulerOutput
    pending: PendingSample
    completed: list[tuple[int, Sequence, int]]  # (row, sequence, output index) awaiting a token
    shape: StepShape
    start: float  # perf_counter when its scheduling began
    context_tokens: int
    expert_load: torch.Tensor | None = None  # per-layer, per-expert counts on their way to the host (MoE)
    comm: tuple[int, int] = (0, 0)  # collectives and their bytes (tp/ep > 1)
    host_ms: tuple[float, float] = (0.0, 0.0)  # host time scheduling it, then enqueueing its forward and sampling

    def record(self, step_id: int, step_ms: float, running: int, waiting: int, kv_usage: float,
               gc_ms: float, pages: tuple[int, int, int] = (0, 0, 0)) -> StepRecord:
        """The step's record; ``running``, ``waiting``, ``kv_usage``, ``pages`` (latent pages used, idle, usable):
        the engine's state once its ids are in; ``gc_ms``: the collector's time in the step's interval."""
        sched, shape = self.sched, self.shape
        load = ExpertLoadProbe.read(self.expert_load)
        moe = {} if load is None else vars(load)  # its fields are the record's names
        return StepRecord(
            step=step_id,
            time=time.time(),
            kind=sched.kind,
            batch_size=len(sched.scheduled),
            padded_size=shape.padded_size,
            graph=shape.graph,
            mode=shape.mode,
            num_tokens=sched.num_tokens,
            prefill_tokens=sched.num_prefill_tokens,
            decode_tokens=sched.num_decode_tokens,
            step_ms=step_ms,
            running=running,
            waiting=waiting,
            kv_usage=kv_usage,
            context_tokens=self.context_tokens,
            preempted=len(sched.preempted),
            comm_ops=self.comm[0],
            comm_bytes=self.comm[1],
            gc_ms=gc_ms,
            schedule_ms=self.host_ms[0],
            launch_ms=self.host_ms[1],
            latent_pages_used=pages[0],
            latent_pages_idle=pages[1],
            latent_pages_total=pages[2],
            preempted_for_pages=sched.preempted_for_pages,
            **moe,
        )
