"""Steady state of one concurrency level.

A level sends n requests with concurrency cap C and no arrival pacing, so in-flight requests ramp
up from 0 to C, stay at C while the queue lasts, and drain at the end. Only the middle says what
the server does at batch size C. The window is:

- start: when C requests are in flight, i.e. the C-th request start (ramp-up excluded);
- end: the first completion among the last C completions (sorted end n−C); after it no queued
  request replaces a finished one, so in-flight only falls (drain excluded).

Inside the window: achieved concurrency (time average of in-flight requests), and the steady TPOT,
the decode step time at that concurrency: the median, over requests whose decode phase (first
chunk to end) lies inside the window, of their TPOT. A request's TPOT averages its own gaps, so a
late wake-up followed by a short catch-up gap cancels out, and the median across requests drops
the odd request that straddled a stall. When fewer than 3 requests qualify (long outputs, small
n), the median of the per-token gaps of chunks inside the window is used instead
(``tpot_source`` says which). Those per-token gaps are reported as ``steady_itl_ms`` either way.
"""

from __future__ import annotations

import numpy as np

from graphserve.bench.metrics import RequestRecord, achieved_concurrency, describe


def as_record(d: dict | RequestRecord) -> RequestRecord:
    if isinstance(d, RequestRecord):
        return d
    fields = RequestRecord.__dataclass_fields__
    return RequestRecord(**{k: v for k, v in d.items() if k in fields})


def steady_window(records: list[RequestRecord], concurrency: int) -> tuple[float, float] | None:
    n = len(records)
    c = max(1, concurrency)
    if n < c or n == 0:
        return None
    starts = sorted(r.start for r in records)
    ends = sorted(r.end for r in records)
    t0, t1 = starts[c - 1], ends[n - c]
    return (t0, t1) if t1 > t0 else None


def steady_itl_ms(records: list[RequestRecord], t0: float, t1: float) -> tuple[list[float], float]:
    """Per-token gaps of chunks inside [t0, t1], and the tokens those chunks carried."""
    samples: list[float] = []
    tokens = 0.0
    for r in records:
        if not r.ok:
            continue
        times = r.chunk_times()
        counts = r.chunk_tokens or [1.0] * len(times)
        for k in range(1, len(times)):
            if times[k - 1] >= t0 and times[k] <= t1 and counts[k] > 0:
                samples.append(r.chunk_itl_ms[k - 1] / counts[k])
                tokens += counts[k]
    return samples, tokens


def steady_point(requests: list[dict | RequestRecord], concurrency: int) -> dict:
    """The level's steady-state numbers; the ``*_run`` keys cover the whole level for comparison."""
    recs = [as_record(r) for r in requests]
    ok = [r for r in recs if r.ok]
    point: dict = {"concurrency": concurrency, "num_requests": len(recs), "completed": len(ok),
                   "failed": len(recs) - len(ok)}
    if recs:
        t_first, t_last = min(r.start for r in recs), max(r.end for r in recs)
        point["achieved_concurrency_run"] = achieved_concurrency(recs, t_first, t_last)
    window = steady_window(recs, concurrency)
    if window is None:
        point.update({"window_s": None, "achieved_concurrency": None, "tpot_ms_median": None, "steady_itl_ms": None})
        return point
    t0, t1 = window
    samples, tokens = steady_itl_ms(recs, t0, t1)
    stats = describe(samples)
    inside = [r.tpot_ms for r in ok if r.tpot_ms is not None and r.ttft_ms is not None
              and r.start + r.ttft_ms / 1000.0 >= t0 and r.end <= t1]
    if len(inside) >= 3:
        tpot, source = float(np.median(inside)), "requests"
    else:
        tpot, source = (stats["median"] if stats else None), "chunks"
    point.update({
        "window_s": [round(t0, 4), round(t1, 4)],
        "achieved_concurrency": achieved_concurrency(recs, t0, t1),
        "tpot_ms_median": tpot,
        "tpot_source": source,
        "steady_requests": len(inside),
        "steady_itl_ms": stats,
        "output_throughput": tokens / (t1 - t0),
    })
    return point
