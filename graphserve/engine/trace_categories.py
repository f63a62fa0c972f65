"""What a profiled step's work is called (its categories) and how its wall time is shared among them.

Kept apart from the trace reading (engine/step_trace.py) and free of torch, so that the step profiler, the
trace reader and `graphserve profile`'s report (analysis/profile.py) all import the same names from below.

Wall-time attribution: a step's timeline runs from ``lo`` to ``hi``; every instant of it goes to the
categories whose work runs then, or to ``gaps_host`` when nothing runs. Kernels overlap on the GPU (under
programmatic dependent launch a kernel starts during its predecessor's tail; work on another stream runs
beside the main one), and summing their durations counted that time twice: `graphserve profile` reported
categories adding up to 128% of a replayed MoE step. Here the shares add up to ``hi - lo`` by construction,
and each category's summed work (``busy``) is kept beside its share.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

CATEGORIES = ("dense_gemm", "moe", "attention", "indexer", "topk", "norm_elementwise", "communication", "sampling",
              "other", "gaps_host")
GAPS = "gaps_host"
WORK_CATEGORIES = tuple(c for c in CATEGORIES if c != GAPS)
LABELS = {
    "dense_gemm": "dense GEMMs",
    "moe": "MoE (router, sort, grouped GEMMs)",
    "attention": "attention (incl. KV write, sparse MLA)",
    "indexer": "sparse-attention indexer (scores, key write)",
    "topk": "sparse-attention top-k",
    "norm_elementwise": "norms and elementwise",
    "communication": "communication",
    "sampling": "sampling",
    "other": "other (copies, embedding, indexing)",
    "gaps_host": "gaps between kernels / host",
}
NAME_RULES = (
    ("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "gloo",
                       "c10d::")),
    # DeepSeek sparse attention's kernels (kernels/dsa.py), before the MoE rule, whose "topk" would take them
    ("indexer", ("indexer_scores", "write_index")),
    ("topk", ("radix_topk", "dsa_topk")),
    # fused_moe*, moe_align*, moe_route*, moe_gemv* and torch's own router pieces
    ("moe", ("moe", "router", "topk", "top_k", "align", "grouped")),
    ("attention", ("attention", "attn", "flash", "sparse_mla", "_decode_split", "_decode_merge", "_extend_kernel", "kv_write",
                   "qk_norm_rope", "paged")),
    ("dense_gemm", ("gemm", "gemv", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                    "cutlass", "cublas", "xmma", "nvjet", "splitk", "sm90_", "sm80_", "ampere_", "hopper_")),
    ("norm_elementwise", ("norm", "rms", "silu", "gelu", "rotary", "rope", "elementwise", "vectorized",
                          "reduce_kernel", "aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt",
                          "aten::sub", "aten::div", "aten::neg", "aten::exp", "aten::sigmoid", "aten::cos",
                          "aten::sin", "aten::cat", "aten::to", "aten::_to_copy", "aten::copy_", "aten::where")),
)
SCOPES = {"graphserve.sampling": "sampling", "graphserve.attention": "attention", "graphserve.moe": "moe",
          "graphserve.indexer": "indexer", "graphserve.topk": "topk"}
ITERATION, LAUNCH = "graphserve.iteration", "graphserve.launch"


def classify(name: str, scope: str | None = None) -> str:
    if scope:
        return scope
    low = name.lower()
    for cat, keys in NAME_RULES:
        if any(k in low for k in keys):
            return cat
    return "other"


@dataclass
class WallShares:
    """One step's timeline ``[lo, hi]`` shared out: ``wall`` per category (``gaps_host`` included) sums to
    ``hi - lo``; ``busy`` is each work category's summed work inside ``[lo, hi]``, overlaps counted once per
    interval; ``overlapped`` is the time during which two or more intervals ran at once."""

    wall: dict[str, float]
    busy: dict[str, float]
    overlapped: float


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: time covered by at least one of them."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def wall_shares(intervals: Iterable[tuple[float, float, str]], lo: float, hi: float) -> WallShares:
    """Share the wall time of ``[lo, hi]`` among the categories of ``(start, end, category)`` intervals (clipped
    to it), the time no interval covers going to ``gaps_host``.

    Time during which several categories run at once is split evenly among them (not by how many intervals of
    each run, and not to the later- or earlier-starting one). Under programmatic dependent launch the later
    kernel starts early and mostly waits for its predecessor's tail, so giving it the overlap would move its
    predecessor's time onto it; giving the overlap to the earlier one instead would hand all of a short kernel
    to a long kernel running beside it on another stream. Neither order says who did the work; an even split
    needs no guess, depends only on the set of intervals (not on their order in the trace), and keeps every
    category between its own union divided by the number of categories present and that union. Overlap within
    one category is that category's time either way."""
    wall = dict.fromkeys(CATEGORIES, 0.0)
    busy = dict.fromkeys(WORK_CATEGORIES, 0.0)
    edges: list[tuple[float, int, str]] = []
    for start, end, cat in intervals:
        if cat not in busy:
            raise ValueError(f"category={cat!r} is not one of {WORK_CATEGORIES}")
        start, end = max(start, lo), min(end, hi)
        if end <= start:
            continue
        busy[cat] += end - start
        edges += [(start, 1, cat), (end, -1, cat)]
    edges.sort()
    running: dict[str, int] = {}
    overlapped, t, i = 0.0, lo, 0
    while i < len(edges):
        now = edges[i][0]
        _credit(wall, running, now - t)
        if sum(running.values()) >= 2:
            overlapped += now - t
        # every start and end at this instant is applied before the next segment is shared out
        while i < len(edges) and edges[i][0] == now:
            _, step, cat = edges[i]
            running[cat] = running.get(cat, 0) + step
            if running[cat] == 0:
                del running[cat]
            i += 1
        t = now
    _credit(wall, running, hi - t)
    return WallShares(wall, busy, overlapped)


def _credit(wall: dict[str, float], running: dict[str, int], span: float) -> None:
    if span <= 0.0:
        return
    if not running:
        wall[GAPS] += span
        return
    for cat in running:
        wall[cat] += span / len(running)
