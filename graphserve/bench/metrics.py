"""Per-request records and the statistics computed from them.

Everything here is a pure function of timestamps and token counts, so the arithmetic is tested on
hand-built timelines. Times inside a record are seconds relative to the run start; latencies are ms.

Definitions (the ones serving engineers compare across SGLang and vLLM):
- TTFT: request start to the first chunk that carries output. A non-streamed request has no TTFT.
- TPOT: (E2E - TTFT) / (output tokens - 1), with output tokens as the server reports them (usage /
  meta_info), never the requested length: an early-stopped request must not look fast. A request
  with fewer than 2 output tokens, or not streamed, has no TPOT.
- ITL: gaps between consecutive output chunks, kept twice: per chunk (``chunk_itl_ms``) and per
  token (each gap divided evenly over the tokens the chunk carried, ``itl_ms``).
- Achieved concurrency: time average of requests in flight over a window.
"""

from __future__ import annotations

import collections
import math
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    start: float  # seconds since run start
    end: float
    ok: bool
    stream: bool = True
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float = 0.0
    itl_ms: list[float] = field(default_factory=list)
    chunk_itl_ms: list[float] = field(default_factory=list)
    chunk_tokens: list[float] = field(default_factory=list)  # tokens per chunk (even split when unreported)
    output_tokens: int | None = None
    input_tokens: int | None = None
    output_tokens_source: str = "server"  # "server" | "tokenizer" | "chunks"
    requested_tokens: int | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["itl_ms"] = [round(x, 4) for x in self.itl_ms]
        d["chunk_itl_ms"] = [round(x, 4) for x in self.chunk_itl_ms]
        return d

    def chunk_times(self) -> list[float]:
        """Arrival times (s since run start) of the output chunks, rebuilt from TTFT and chunk gaps."""
        if self.ttft_ms is None:
            return []
        t = self.start + self.ttft_ms / 1000.0
        times = [t]
        for gap in self.chunk_itl_ms:
            t += gap / 1000.0
            times.append(t)
        return times


def build_record(
    start: float,
    end: float,
    chunk_times: list[float],
    chunk_tokens: list[int | None],
    output_tokens: int | None,
    *,
    stream: bool,
    input_tokens: int | None = None,
    output_tokens_source: str = "server",
    requested_tokens: int | None = None,
) -> RequestRecord:
    """Turn one successful request's raw timeline into a record.

    ``chunk_times`` are arrival times of chunks that carried output; ``chunk_tokens`` the tokens each
    carried when the server said so (None when unknown). Unknown counts are filled by spreading the
    reported total evenly over the chunks after the first, so the mean per-token ITL equals TPOT.
    """
    e2e_ms = (end - start) * 1000.0
    rec = RequestRecord(start=start, end=end, ok=True, stream=stream, e2e_ms=e2e_ms,
                        output_tokens=output_tokens, input_tokens=input_tokens,
                        output_tokens_source=output_tokens_source, requested_tokens=requested_tokens)
    if not stream or not chunk_times:
        return rec
    rec.ttft_ms = (chunk_times[0] - start) * 1000.0
    if output_tokens is not None and output_tokens >= 2:
        rec.tpot_ms = (e2e_ms - rec.ttft_ms) / (output_tokens - 1)
    counts = _fill_counts(chunk_tokens, output_tokens, len(chunk_times))
    rec.chunk_tokens = [round(c, 4) for c in counts]
    for k in range(1, len(chunk_times)):
        gap_ms = (chunk_times[k] - chunk_times[k - 1]) * 1000.0
        rec.chunk_itl_ms.append(gap_ms)
        n = counts[k]
        if n <= 0:
            continue
        # One sample per token when the count is whole; one averaged sample per chunk otherwise.
        reps = int(n) if float(n).is_integer() else 1
        rec.itl_ms.extend([gap_ms / n] * reps)
    return rec


def _fill_counts(chunk_tokens: list[int | None], total: int | None, n_chunks: int) -> list[float]:
    if chunk_tokens and all(c is not None for c in chunk_tokens) and len(chunk_tokens) == n_chunks:
        return [float(c) for c in chunk_tokens]
    if total is None or n_chunks < 2:
        return [1.0] * n_chunks
    rest = max(total - 1, n_chunks - 1) / (n_chunks - 1)
    # A whole number means every later chunk carried exactly that many; keep per-token samples then.
    return [1.0] + [rest] * (n_chunks - 1)


def failed_record(start: float, end: float, error: str, stream: bool) -> RequestRecord:
    return RequestRecord(start=start, end=end, ok=False, stream=stream, e2e_ms=(end - start) * 1000.0, error=error)


def describe(values: list[float]) -> dict | None:
    """mean, median, std, p90, p95, p99, min, max, n of a sample; None for an empty one."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return None
    a = np.asarray(vals, dtype=float)
    p90, p95, p99 = np.percentile(a, [90, 95, 99])
    return {
        "mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
        "p90": float(p90), "p95": float(p95), "p99": float(p99),
        "min": float(a.min()), "max": float(a.max()), "n": int(a.size),
    }


def achieved_concurrency(records: list[RequestRecord], t0: float, t1: float) -> float:
    """Time average of requests in flight over [t0, t1] (failed requests count while they were open)."""
    if t1 <= t0:
        return 0.0
    busy = sum(max(0.0, min(r.end, t1) - max(r.start, t0)) for r in records)
    return busy / (t1 - t0)


def summarize(records: list[RequestRecord], duration_s: float | None = None) -> dict:
    """The run summary: counts, throughputs, latency statistics and achieved concurrency."""
    ok = [r for r in records if r.ok]
    bad = [r for r in records if not r.ok]
    if duration_s is None:
        duration_s = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    t0 = min((r.start for r in records), default=0.0)
    out_tok = sum(r.output_tokens or 0 for r in ok)
    in_tok = sum(r.input_tokens or 0 for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    reasons = collections.Counter((r.error or "unknown").split(":")[0] for r in bad)
    return {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(bad),
        "failure_reasons": dict(reasons),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(in_tok),
        "output_throughput": per_s(out_tok),
        "total_token_throughput": per_s(in_tok + out_tok),
        "achieved_concurrency": achieved_concurrency(records, t0, t0 + duration_s),
        # Requests that ended before their requested length (EOS or a stop string): their TPOT is
        # computed on what was produced, and this count tells the reader how many there were.
        "early_stopped": sum(
            1 for r in ok if r.output_tokens is not None and r.requested_tokens and r.output_tokens < r.requested_tokens
        ),
        "ttft_ms": describe([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": describe([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "itl_ms": describe([x for r in ok for x in r.itl_ms]),
        "chunk_itl_ms": describe([x for r in ok for x in r.chunk_itl_ms]),
        "e2e_ms": describe([r.e2e_ms for r in ok]),
    }
