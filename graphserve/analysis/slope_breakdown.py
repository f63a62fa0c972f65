"""`sweep --breakdown`: how much of the fitted b (what each running request adds to every decode step) is
attention, MoE, GEMMs... At each level the sweep holds C requests in decode after the level's load and traces a
few of their steps (analysis/profile.profile_level, the server's POST /v1/profile); each category's wall ms per
step is fitted against the batch size the same way as the total (analysis/scaling.fit_step_time: Huber line,
t-intervals), so that b = Σ b_category.

Each traced step's categories add up to its span on the timeline (engine/trace_categories.py), so a plain
least-squares fit would split the span's slope exactly among them. The robust fit weights each category's steps
on its own, and the sweep's b comes from the median TPOT under each level's own load rather than from the traced
steps: the sum is compared with both, and the report says when it falls outside their intervals and why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from graphserve.analysis.scaling import fit_step_time
from graphserve.engine.trace_categories import CATEGORIES
from graphserve.errors import BadRequestError

# Decode steps traced per level. At a fixed batch, consecutive decode steps run the same kernels on the same
# shapes (the context grows by one token a step), so a category's ms varies little from step to step, while the
# levels of a sweep differ in batch size by 4x and more: the slope is set by the spread between levels. A level's
# mean over 8 steps has a standard error of σ/√8, about a third of the step-to-step spread; more steps would
# lengthen every level's trace export and, on a GPU, the eager phase that runs as long again.
BREAKDOWN_STEPS = 8

SHORT = {"dense_gemm": "dense GEMMs", "moe": "MoE", "attention": "attention", "indexer": "the sparse-attention indexer",
         "topk": "sparse top-k", "norm_elementwise": "norms and elementwise", "communication": "communication",
         "sampling": "sampling", "other": "other work", "gaps_host": "gaps and host time"}
SPARSE_PARTS = ("attention", "indexer", "topk")
SENTENCE_CATEGORIES = 5  # named in the lead sentence, attention first; the rest are summed as "the rest"

WHY_NOT_SWEEP = ("the sweep's b comes from the median TPOT under each level's own load, with arriving requests' "
                 "prefills between decode steps and contexts growing to the full output, while the categories come "
                 "from C requests held in decode after the level and traced by the profiler, which adds host time to "
                 "every op (on a CPU, much of it)")
WHY_NOT_SPAN = ("the robust fit weights each category's steps on its own, so a step that stands out in one category "
                "(a stall counted as gaps and host time) is down-weighted there and counted in the others")


def _phase(profile: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The phase that ran as served: graph replay when the engine captured graphs, else eager."""
    phases = {p.get("mode"): p for p in (profile or {}).get("phases", []) if "error" not in p}
    return phases.get("graph") or phases.get("eager")


def samples(points: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """(batch size, ms per category, span) samples from each level's profile: one per traced step when every
    profile keeps its steps' own categories, else one per level (each profile's means)."""
    phases = [(p["concurrency"], ph) for p in points if (ph := _phase(p.get("profile")))]
    missing = [p["concurrency"] for p in points if not _phase(p.get("profile"))]
    # A graph phase whose kernels the profiler could not see borrows the eager phase's means: no per-step split.
    per_step = bool(phases) and all(ph.get("attribution") == "measured" and ph.get("per_step")
                                    and all("categories_ms" in s for s in ph["per_step"]) for _, ph in phases)
    rows: list[tuple[float, Mapping[str, float], float]] = []
    for _, ph in phases:
        if per_step:
            rows += [(float(s["batch_size"]), s["categories_ms"], float(s["span_ms"])) for s in ph["per_step"]]
        else:
            span = float(ph.get("span_ms") or sum(ph["categories_ms"].values()))
            rows.append((float(ph["batch_size"]), ph["categories_ms"], span))
    return {"n": [r[0] for r in rows], "span": [r[2] for r in rows],
            "categories": {c: [float(r[1].get(c, 0.0)) for r in rows] for c in CATEGORIES},
            "per": "step" if per_step else "level", "levels": [c for c, _ in phases], "missing": missing,
            "modes": sorted({ph["mode"] for _, ph in phases}), "steps": sorted({ph["steps"] for _, ph in phases}),
            "cards": sorted({c for p in points if (c := (p.get("profile") or {}).get("card"))})}


def _slim(fit: Any) -> dict[str, Any]:
    return {"a_ms": fit.a_ms, "b_ms": fit.b_ms, "a_ci": list(fit.a_ci), "b_ci": list(fit.b_ci), "r2": fit.r2}


def _within(x: float, ci: Sequence[float]) -> bool:
    return ci[0] <= x <= ci[1]


def fit_breakdown(points: Sequence[Mapping[str, Any]], total_fit: Mapping[str, Any] | None) -> dict[str, Any]:
    """Each category's line against the batch size, their slopes' sum, and how it compares with ``total_fit``
    (the sweep's fit; without one, the traced steps' own span). ``{"error": why}`` when nothing can be fitted."""
    s = samples(points)
    try:
        span = fit_step_time(s["n"], s["span"])
        cats = {c: fit_step_time(s["n"], ys) for c, ys in s["categories"].items() if any(ys)}
    except BadRequestError as e:
        return {"error": f"no breakdown of b: {e.message} among the profiled levels {s['levels']}"
                         + (f" (no profile at C={s['missing']})" if s["missing"] else "")}
    sum_b = sum(f.b_ms for f in cats.values())
    total = ({"source": "sweep fit (median TPOT against concurrency)", "b_ms": total_fit["b_ms"],
              "b_ci": list(total_fit["b_ci"])} if total_fit else
             {"source": "traced steps' span", "b_ms": span.b_ms, "b_ci": list(span.b_ci)})
    out: dict[str, Any] = {
        "cards": s["cards"], "steps_per_level": s["steps"], "samples_per": s["per"], "n_samples": len(s["n"]),
        "levels": s["levels"], "levels_without_profile": s["missing"], "phases": s["modes"],
        "categories": {c: _slim(f) for c, f in cats.items()}, "span_fit": _slim(span), "sum_b_ms": sum_b,
        "total": total, "adds_up": _within(sum_b, total["b_ci"]),
    }
    out["mismatch"] = None if out["adds_up"] else mismatch_text(out)
    out["sentence"] = sentence(out)
    return out


def mismatch_text(bd: Mapping[str, Any]) -> str:
    lo, hi = bd["total"]["b_ci"]
    span = bd["span_fit"]
    line = (f"the categories' slopes add up to {_ms(bd['sum_b_ms'])} ms, outside b's 95% interval "
            f"[{_ms(lo)}, {_ms(hi)}] ms: ")
    reasons = []
    if bd["total"]["source"].startswith("sweep"):
        reasons.append(f"the traced steps' own span grows by {_ms(span['b_ms'])} ms per request "
                       f"[{_ms(span['b_ci'][0])}, {_ms(span['b_ci'][1])}]; {WHY_NOT_SWEEP}")
    if not _within(bd["sum_b_ms"], span["b_ci"]):
        reasons.append(WHY_NOT_SPAN)
    return line + "; and ".join(reasons)


def _ms(x: float) -> str:
    return f"{x:.2f}" if abs(x) >= 0.1 else f"{x:.3g}"


def _range(lo: float, hi: float) -> str:
    return f"{_ms(lo)}–{_ms(hi)}" if lo >= 0 else f"{_ms(lo)} to {_ms(hi)}"  # "-10.32–-10.19" misreads


def _part(label: str, b_ms: float, total_b: float, lead: bool = False) -> str:
    share = f" ({100 * b_ms / total_b:.0f}%)" if total_b > 0 else ""
    return f"{label} takes {_ms(b_ms)} ms of it{share}" if lead else f"{label} {_ms(b_ms)} ms{share}"


def sentence(bd: Mapping[str, Any]) -> str:
    """``b = 0.41 ms per request (0.37–0.45); attention takes 0.22 ms of it (54%), MoE 0.12 ms (29%), ...``"""
    b, (lo, hi) = bd["total"]["b_ms"], bd["total"]["b_ci"]
    slopes = {c: f["b_ms"] for c, f in bd["categories"].items()}
    parts = [_part("attention", slopes.get("attention", 0.0), b, lead=True)]
    rest = sorted((c for c in slopes if c != "attention"), key=lambda c: -abs(slopes[c]))
    named, others = rest[:SENTENCE_CATEGORIES - 1], rest[SENTENCE_CATEGORIES - 1:]
    parts += [_part(SHORT[c], slopes[c], b) for c in named]
    if others:
        parts.append(_part("the rest", sum(slopes[c] for c in others), b))
    line = f"b = {_ms(b)} ms per request ({_range(lo, hi)}); " + ", ".join(parts)
    if any(c in slopes for c in ("indexer", "topk")):
        sparse = sum(slopes.get(c, 0.0) for c in SPARSE_PARTS)
        line += f"; sparse attention in all (attention, indexer, top-k) {_ms(sparse)} ms"
        line += f" ({100 * sparse / b:.0f}%)" if b > 0 else ""
    if b <= 0:
        line += " (b ≤ 0: no share of it is quoted)"
    return line + "."


def breakdown_lines(bd: Mapping[str, Any] | None) -> list[str]:
    """The breakdown for the text reports: the sentence, whether the slopes add up, and where they come from."""
    if not bd:
        return []
    if bd.get("error"):
        return [bd["error"]]
    lines = [bd["sentence"]]
    if bd["adds_up"]:
        lines.append(f"the categories' slopes add up to {_ms(bd['sum_b_ms'])} ms, within b's 95% interval")
    else:
        lines.append(bd["mismatch"])
    per_level = "/".join(map(str, bd["steps_per_level"]))
    lines.append(f"from {bd['n_samples']} traced decode steps ({per_level} per level, one sample per "
                 f"{bd['samples_per']}, {'/'.join(bd['phases'])} phase) at C = {', '.join(map(str, bd['levels']))}, "
                 "each category fitted robustly against the batch size like the total"
                 + (f"; no profile at C = {bd['levels_without_profile']}" if bd["levels_without_profile"] else ""))
    return lines


def breakdown_rows(bd: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """A row per category: its slope and intercept with their intervals and its share of b."""
    b = bd["total"]["b_ms"]
    head = ["category", "b (ms per request)", "b 95% CI", "share of b", "a (ms)", "R²"]
    order = sorted(bd["categories"], key=lambda c: -abs(bd["categories"][c]["b_ms"]))
    rows = [[SHORT[c], _ms(f["b_ms"]), f"[{_ms(f['b_ci'][0])}, {_ms(f['b_ci'][1])}]",
             f"{100 * f['b_ms'] / b:.0f}%" if b > 0 else "—", _ms(f["a_ms"]), f"{f['r2']:.2f}"]
            for c in order for f in [bd["categories"][c]]]
    rows.append(["sum of the categories", _ms(bd["sum_b_ms"]), "", f"{100 * bd['sum_b_ms'] / b:.0f}%" if b > 0 else "—",
                 _ms(sum(f["a_ms"] for f in bd["categories"].values())), ""])
    sp = bd["span_fit"]
    rows.append(["traced steps' span", _ms(sp["b_ms"]), f"[{_ms(sp['b_ci'][0])}, {_ms(sp['b_ci'][1])}]", "",
                 _ms(sp["a_ms"]), f"{sp['r2']:.2f}"])
    return head, rows
