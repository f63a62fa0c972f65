"""benchmarks/serve_waves' per-step summary: the steps with prefill tokens apart from the decode steps, each such step
measured against the record before it (CPU, run delay), a step after a gap in the ids left out of the per-step
sums, and the writes left to a sender thread counted over the run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.serve_waves import summary


def _rec(step: int, prefill: int, ms: float, thread_cpu: float, cpu: float, delay: float, tails: int = 0,
         batch: int = 4) -> SimpleNamespace:
    return SimpleNamespace(step=step, batch_size=batch, prefill_tokens=prefill, step_ms=ms, thread_cpu_s=thread_cpu,
                           cpu_s=cpu, run_delay_s=delay, gc_ms=0.25, sender_tails=tails)


def test_prefill_steps_against_the_record_before_them():
    records = [_rec(1, 0, 2.0, 1.000, 1.000, 0.000),
               _rec(2, 512, 20.0, 1.012, 1.013, 0.006),  # 12 ms on the step thread, 1 ms on others, 6 ms waiting
               _rec(3, 0, 3.0, 1.014, 1.015, 0.006, tails=1),
               _rec(5, 256, 30.0, 1.030, 1.030, 0.010, tails=2),  # step 4 is missing: no record to diff against
               _rec(6, 256, 10.0, 1.038, 1.038, 0.011, tails=2),
               _rec(7, 0, 1.0, 1.039, 1.039, 0.011, batch=0)]  # an empty step: not one of the run's
    out = summary(records, wall_s=1.5)
    assert out["steps"] == 5 and out["other_steps"] == 2 and out["decode_steps"] == 2
    assert out["other_s"] == pytest.approx(0.030)
    assert out["other_step_ms"] == pytest.approx(15.0)
    assert out["prefill_tok_per_step"] == pytest.approx(384.0)
    assert out["other_thread_cpu_ms"] == pytest.approx(10.0)
    assert out["other_off_cpu_ms"] == pytest.approx(5.0)
    assert out["other_run_delay_ms"] == pytest.approx(3.5)
    assert out["other_threads_cpu_ms"] == pytest.approx(0.5)
    assert out["other_gc_ms"] == pytest.approx(0.25)
    assert out["sender_tails"] == 2
    assert out["decode_step_ms"] == pytest.approx(2.5)
    assert out["wall_s"] == 1.5
