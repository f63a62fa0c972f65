"""engine/gc_clock.py: the collector's time lands in the step records (beside the host's scheduling and
launch time); freezing the heap."""

from __future__ import annotations

import gc

from graphserve.config import EngineConfig
from graphserve.engine import warmup
from graphserve.engine.core import EngineCore
from graphserve.engine.gc_clock import freeze_heap, gc_clock
from graphserve.engine.request import EngineRequest
from graphserve.sampling_params import SamplingParams


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_the_clock_adds_up_collections_and_leaves_out_the_freeze():
    clock = gc_clock()
    assert gc_clock() is clock  # one per process
    before = clock.total_ms
    for _ in range(5):
        junk = [_Node() for _ in range(20_000)]
        del junk
        gc.collect()
    assert clock.total_ms > before
    gc.unfreeze()
    keep = [_Node() for _ in range(10_000)]
    try:
        grown = clock.total_ms
        freeze_heap()
        assert clock.total_ms == grown  # its full collection is charged to no step
        assert gc.get_freeze_count() >= len(keep) and not clock.paused
    finally:
        gc.unfreeze()  # leave the test process as it was
    del keep


def test_steps_carry_the_collector_time():
    core = EngineCore(EngineConfig(model="builtin:tiny-llama", max_model_len=256, num_kv_tokens=4096))
    warmup.warm_up(core)
    warmed = core.telemetry.last_step()
    core.add_request(EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), 0.0))
    junk = [_Node() for _ in range(50_000)]  # enough allocations to trigger collections during the steps
    while core.has_unfinished_requests():
        gc.collect()  # a collection in every step's interval
        core.step()
    del junk
    records = [r for r in core.telemetry.records() if r.step > warmed]
    assert records and all(r.gc_ms > 0.0 for r in records)
    # the host's share of each step: its scheduling and its launch lie inside the step's time
    assert all(r.launch_ms > 0.0 and 0.0 <= r.schedule_ms and r.schedule_ms + r.launch_ms <= r.step_ms
               for r in records)
