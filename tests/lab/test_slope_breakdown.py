"""`sweep --breakdown`: each category's ms per decode step fitted against N like the total, so the report says how
much of b is attention. The arithmetic on synthetic profiles with known slopes, the sentence, what is said when the
slopes do not add up, and the flag end to end on builtin:tiny-llama through a real server (and off: nothing)."""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
import pytest
from fake_server import FakeServer

from graphserve.analysis import profile as profile_mod
from graphserve.analysis import slope_breakdown as sb
from graphserve.analysis.scaling import fit_step_time
from graphserve.bench import sweep

LEVELS = (1, 2, 4, 8, 16)
STEPS = 8
# (a, b) per category in ms; the rest stay zero, as on a dense model without MoE
TRUE = {"attention": (0.5, 0.20), "moe": (1.0, 0.10), "dense_gemm": (3.0, 0.04), "gaps_host": (0.3, 0.01)}
TRUE_B = sum(b for _, b in TRUE.values())


def _phase(mode: str, n: int, rng: np.random.Generator, per_step_categories: bool = True,
           cats: dict | None = None) -> dict:
    cats = cats or TRUE
    steps = []
    for _ in range(STEPS):
        c = {k: 0.0 for k in sb.CATEGORIES}
        # 1% noise on each category, so every fit has a residual scale and an interval of some width
        c.update({k: (a + b * n) * (1 + 0.01 * rng.standard_normal()) for k, (a, b) in cats.items()})
        steps.append({"step_ms": sum(c.values()) * 1.02, "span_ms": sum(c.values()), "batch_size": n,
                      **({"categories_ms": c} if per_step_categories else {})})
    mean = {k: float(np.mean([s.get("categories_ms", {}).get(k, 0.0) for s in steps])) for k in sb.CATEGORIES}
    if not per_step_categories:  # a server older than per-step categories: only the means
        mean = {k: (a + b * n) for k, (a, b) in cats.items()}
    span = sum(mean.values())
    return {"mode": mode, "steps": STEPS, "batch_size": n, "attribution": "measured", "step_ms": span * 1.02,
            "span_ms": span, "categories_ms": mean, "per_step": steps}


def _points(seed: int = 0, **kw) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"concurrency": n, "profile": {"phases": [_phase("eager", n, rng, **kw)]}} for n in LEVELS]


def _total_fit(b: float, seed: int = 1) -> dict:
    """A sweep fit of median TPOT against N with slope ``b`` and a little noise (its interval has a width)."""
    rng = np.random.default_rng(seed)
    a = sum(a for a, _ in TRUE.values())
    return fit_step_time(LEVELS, [(a + b * n) * (1 + 0.003 * rng.standard_normal()) for n in LEVELS]).to_dict()


def test_category_slopes_recover_known_slopes_and_add_up_to_b():
    bd = sb.fit_breakdown(_points(), _total_fit(TRUE_B))
    assert bd["samples_per"] == "step" and bd["n_samples"] == STEPS * len(LEVELS) and bd["levels"] == list(LEVELS)
    assert set(bd["categories"]) == set(TRUE)  # all-zero categories are left out: their slope is 0
    for c, (a, b) in TRUE.items():
        # 1% noise on a 3 ms intercept moves a 0.04 ms slope by a few µs: an absolute tolerance too
        assert bd["categories"][c]["b_ms"] == pytest.approx(b, rel=0.05, abs=0.005), c
        assert bd["categories"][c]["a_ms"] == pytest.approx(a, rel=0.05, abs=0.02), c
    assert bd["sum_b_ms"] == pytest.approx(sum(f["b_ms"] for f in bd["categories"].values()))
    assert bd["sum_b_ms"] == pytest.approx(TRUE_B, rel=0.02)
    assert bd["sum_b_ms"] == pytest.approx(bd["span_fit"]["b_ms"], rel=0.01)  # each step's categories sum to its span
    lo, hi = bd["total"]["b_ci"]
    assert lo <= bd["sum_b_ms"] <= hi and bd["adds_up"] and bd["mismatch"] is None
    assert bd["total"]["source"].startswith("sweep fit")


def test_sentence_leads_with_b_and_names_attentions_share():
    bd = sb.fit_breakdown(_points(), _total_fit(TRUE_B))
    b, (lo, hi) = bd["total"]["b_ms"], bd["total"]["b_ci"]
    attn = bd["categories"]["attention"]["b_ms"]
    s = bd["sentence"]
    assert s.startswith(f"b = {b:.2f} ms per request ({lo:.2f}–{hi:.2f}); attention takes {attn:.2f} ms of it "
                        f"({100 * attn / b:.0f}%), MoE ")
    assert re.search(r"attention takes 0\.2\d ms of it \(5\d%\)", s)
    assert "sparse attention" not in s  # no indexer or top-k on this model
    lines = sb.breakdown_lines(bd)
    assert lines[0] == s and "within b's 95% interval" in lines[1] and "40 traced decode steps (8 per level" in lines[2]
    head, rows = sb.breakdown_rows(bd)
    assert rows[0][0] == "attention" and rows[-2][0] == "sum of the categories" and len(rows[0]) == len(head)


def test_sparse_attention_parts_are_summed_too():
    cats = {"attention": (0.4, 0.05), "indexer": (0.2, 0.03), "topk": (0.1, 0.02), "moe": (2.0, 0.1)}
    rng = np.random.default_rng(3)
    points = [{"concurrency": n, "profile": {"phases": [_phase("graph", n, rng, cats=cats)]}} for n in LEVELS]
    bd = sb.fit_breakdown(points, None)  # no sweep fit: the traced steps' span is the total
    assert bd["total"]["source"] == "traced steps' span" and bd["adds_up"]
    sparse = sum(bd["categories"][c]["b_ms"] for c in ("attention", "indexer", "topk"))
    assert sparse == pytest.approx(0.10, rel=0.05)
    assert f"sparse attention in all (attention, indexer, top-k) {sparse:.3g} ms" in bd["sentence"]


def test_slopes_outside_the_sweeps_interval_are_said_with_the_reason():
    bd = sb.fit_breakdown(_points(), _total_fit(2 * TRUE_B))
    assert not bd["adds_up"]
    assert "outside b's 95% interval" in bd["mismatch"] and "median TPOT" in bd["mismatch"]
    assert "weights each category's steps on its own" not in bd["mismatch"]  # they do add up to the span's slope
    assert bd["mismatch"] in sb.breakdown_lines(bd)
    # and outside the span's own interval too: the robust fits' weights are named as well
    forced = {**bd, "span_fit": {**bd["span_fit"], "b_ci": [10.0, 11.0]}}
    assert sb.WHY_NOT_SPAN in sb.mismatch_text(forced) and sb.WHY_NOT_SWEEP in sb.mismatch_text(forced)


def test_graph_phase_is_fitted_and_older_profiles_give_one_sample_per_level():
    rng = np.random.default_rng(4)
    points = []
    for n in LEVELS:
        eager = _phase("eager", n, rng, cats={"attention": (9.0, 9.0)})  # slower eager steps must not be read
        points.append({"concurrency": n, "profile": {"phases": [_phase("graph", n, rng, per_step_categories=False),
                                                                eager]}})
    bd = sb.fit_breakdown(points, None)
    assert bd["samples_per"] == "level" and bd["n_samples"] == len(LEVELS) and bd["phases"] == ["graph"]
    assert bd["categories"]["attention"]["b_ms"] == pytest.approx(0.20, rel=1e-6)
    assert bd["sum_b_ms"] == pytest.approx(TRUE_B, rel=1e-6)


def test_too_few_profiled_levels_is_an_error_that_says_which():
    points = _points()[:2]
    points[1]["profile"] = {"error": "no profile at C=2: ..."}
    bd = sb.fit_breakdown(points, None)
    assert "at least 2 distinct N" in bd["error"] and "no profile at C=[2]" in bd["error"]
    assert sb.breakdown_lines(bd) == [bd["error"]]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sweep.add_arguments(p)
    return p.parse_args(list(argv))


LOAD = ["--num-prompts-per-level", "1", "--random-input-len", "8", "--random-output-len", "6", "--random-range-ratio",
        "1", "--disable-tqdm"]


def test_breakdown_end_to_end_on_tiny_llama(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sb, "BREAKDOWN_STEPS", 3)  # fewer traced steps keep the CPU test short
    rc = sweep.run(_args("--model", "builtin:tiny-llama", "--max-model-len", "256", "--num-kv-tokens", "4096",
                         "--concurrency", "1,2", "--output-dir", str(tmp_path), "--breakdown", *LOAD))
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    bd = res["breakdown"]
    assert "error" not in bd, bd.get("error")
    assert bd["levels"] == [1, 2] and bd["n_samples"] == 6 and bd["samples_per"] == "step" and bd["phases"] == ["eager"]
    assert bd["cards"] == ["cpu"] and all(p["profile"]["card"] == "cpu" for p in res["points"])
    # CPU step times on a shared machine are noise: the checks are of the arithmetic, not of the values
    assert "attention" in bd["categories"] and "dense_gemm" in bd["categories"]
    assert bd["sum_b_ms"] == pytest.approx(sum(f["b_ms"] for f in bd["categories"].values()))
    assert bd["total"]["b_ms"] == pytest.approx(res["fit"]["b_ms"])
    for p in res["points"]:
        (phase,) = p["profile"]["phases"]
        assert phase["batch_size"] == p["concurrency"] and phase["steps"] == 3
        for s in phase["per_step"]:  # each step's categories add up to its span: what makes b = Σ b_category
            assert sum(s["categories_ms"].values()) == pytest.approx(s["span_ms"], rel=1e-6)
    out = capsys.readouterr().out
    assert f"breakdown: {bd['sentence']}" in out and "attention takes" in bd["sentence"]
    md = (tmp_path / "report.md").read_text()
    assert f"- {bd['sentence']}" in md and "| sum of the categories |" in md
    html = (tmp_path / "report.html").read_text()
    assert "attention takes" in html and "What each request adds to a decode step, per category" in html
    assert html.index("attention takes") < html.index("scaling fit (median TPOT")  # the answer leads


def test_flag_off_profiles_nothing_and_reports_no_breakdown(tmp_path, capsys, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a sweep without --breakdown or --profile must not profile")

    monkeypatch.setattr(profile_mod, "profile_level", refuse)
    with FakeServer("--a-ms", "5", "--b-ms", "1") as url:
        rc = sweep.run(_args("--base-url", url, "--output-dir", str(tmp_path), "--concurrency", "1,2", *LOAD))
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert "breakdown" not in res and all("profile" not in p for p in res["points"])
    assert res["config"]["breakdown"] is False
    assert "breakdown:" not in capsys.readouterr().out
    assert "per request (" not in (tmp_path / "report.md").read_text()
    assert "per category" not in (tmp_path / "report.html").read_text()


def test_breakdown_traces_its_few_steps_unless_profile_asks_for_more():
    from graphserve.bench.levels import profile_steps

    assert profile_steps(_args("--breakdown")) == sb.BREAKDOWN_STEPS
    assert profile_steps(_args("--breakdown", "--profile", "--profile-steps", "4")) == 4
    assert sweep.run(_args("--base-url", "http://127.0.0.1:9", "--breakdown", "--profile", "--profile-steps", "0")) == 2
