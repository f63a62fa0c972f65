"""benchmarks/http_overhead's step timeline: the engine's steps inside a run's wall window, how busy it was,
its mean batch, when the batch first reached the concurrency (None when it never did), and its decode-only steps
apart from the others."""

from __future__ import annotations

import pytest

from benchmarks.http_overhead import step_timeline


def _step(t: float, batch: int, ms: float, kind: str = "decode") -> dict:
    return {"time": t, "batch_size": batch, "step_ms": ms, "kind": kind}


def test_only_steps_inside_the_window_count():
    records = [_step(9.9, 4, 50.0), _step(10.1, 2, 40.0), _step(10.3, 4, 60.0), _step(11.0, 4, 100.0),
               _step(11.2, 4, 10.0)]
    out = step_timeline(records, 10.0, 11.0, concurrency=4)
    assert out["steps"] == 3
    assert out["busy"] == pytest.approx(0.2)  # 200 ms of steps in a 1 s window
    assert out["mean_batch"] == pytest.approx(10 / 3)
    assert out["mean_step_ms"] == pytest.approx(200 / 3)
    assert out["full_after_s"] == pytest.approx(0.3)


def test_a_batch_that_never_fills_and_an_empty_window():
    assert step_timeline([_step(1.5, 3, 10.0)], 1.0, 2.0, concurrency=4)["full_after_s"] is None
    empty = step_timeline([], 1.0, 2.0, concurrency=4)
    assert empty == {"steps": 0, "busy": 0.0, "mean_batch": 0.0, "mean_step_ms": 0.0, "full_after_s": None,
                     "decode_steps": 0, "decode_step_ms": 0.0, "decode_batch": 0.0, "other_s": 0.0,
                     "other_steps": 0, "other_step_ms": 0.0, "other_prefill_tokens": 0.0, "other_schedule_ms": 0.0,
                     "other_launch_ms": 0.0, "other_gc_ms": 0.0}


def test_decode_steps_apart_from_prefill_and_mixed_ones():
    records = [_step(10.1, 2, 40.0, "prefill"), _step(10.2, 4, 3.0), _step(10.3, 4, 25.0, "mixed"),
               _step(10.4, 3, 5.0), _step(11.5, 4, 2.0)]
    out = step_timeline(records, 10.0, 11.0, concurrency=4)
    assert out["steps"] == 4 and out["decode_steps"] == 2
    assert out["decode_step_ms"] == pytest.approx(4.0)
    assert out["decode_batch"] == pytest.approx(3.5)
    assert out["other_s"] == pytest.approx(0.065)
    assert out["mean_step_ms"] == pytest.approx(73 / 4)


def test_prefill_and_mixed_steps_give_their_host_share_and_prefill_tokens():
    def other(t: float, ms: float, tokens: int, schedule: float, launch: float, kind: str) -> dict:
        return {**_step(t, 4, ms, kind), "prefill_tokens": tokens, "schedule_ms": schedule, "launch_ms": launch,
                "gc_ms": 0.5}

    records = [other(10.1, 30.0, 2048, 1.0, 27.0, "prefill"), {**_step(10.2, 4, 3.0), "launch_ms": 0.2},
               other(10.3, 20.0, 256, 0.5, 18.5, "mixed")]
    out = step_timeline(records, 10.0, 11.0, concurrency=4)
    assert out["other_steps"] == 2 and out["other_step_ms"] == pytest.approx(25.0)
    assert out["other_prefill_tokens"] == pytest.approx(1152.0)
    assert out["other_schedule_ms"] == pytest.approx(0.75)
    assert out["other_launch_ms"] == pytest.approx(22.75)  # the decode step's launch is not among them
    assert out["other_gc_ms"] == pytest.approx(0.5)
