from __future__ import annotations

import numpy as np
import pytest

from graphserve.analysis.scaling import fit_from_sweep, fit_from_telemetry, fit_step_time
from graphserve.errors import BadRequestError

N = np.repeat([1, 2, 4, 8, 12, 16, 24, 32, 48, 64], 4)


def _noisy(a, b, seed, sigma=3.0, extra=None):
    rng = np.random.default_rng(seed)
    y = a + b * N + rng.normal(0.0, sigma, N.size)
    return y + (0 if extra is None else extra)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_line_and_interval_covers_truth(seed):
    fit = fit_step_time(N, _noisy(54.0, 30.0, seed))
    assert abs(fit.a_ms - 54.0) / 54.0 < 0.05
    assert abs(fit.b_ms - 30.0) / 30.0 < 0.05
    assert fit.a_ci[0] <= 54.0 <= fit.a_ci[1]
    assert fit.b_ci[0] <= 30.0 <= fit.b_ci[1]
    assert fit.r2 > 0.99
    assert fit.breaks == []


def test_asymptote_and_n_at_90pct_match_hand_arithmetic():
    fit = fit_step_time([1, 2, 4, 8], [54 + 30 * n for n in (1, 2, 4, 8)])
    assert fit.a_ms == pytest.approx(54.0) and fit.b_ms == pytest.approx(30.0)
    assert fit.asymptote_tok_s == pytest.approx(1000 / 30)  # 33.3 tok/s: the plateau
    # 90%: N·1000/(54+30N) = 0.9·1000/30  ->  N = 9·54/30 = 16.2
    assert fit.n_at_90pct == pytest.approx(16.2)
    assert fit.throughput_tok_s(16.2) == pytest.approx(0.9 * 1000 / 30)
    d = fit.to_dict()
    for key in ("a_ms", "b_ms", "r2", "asymptote_tok_s", "a_ci", "b_ci", "n_at_90pct", "breaks"):
        assert key in d


def test_outliers_do_not_drag_the_robust_fit():
    y = _noisy(20.0, 2.0, 3, sigma=0.5)
    y[::9] += 400.0  # a few stalled steps
    fit = fit_step_time(N, y)
    assert abs(fit.b_ms - 2.0) < 0.1 and abs(fit.a_ms - 20.0) < 2.0


def test_planted_break_at_32_is_found():
    fit = fit_step_time(N, _noisy(54.0, 30.0, 4, extra=np.where(N >= 32, 150.0, 0.0)))
    assert len(fit.breaks) == 1
    br = fit.breaks[0]
    assert br["at_n"] == 32 and br["after_n"] == 24
    assert br["jump_ms"] == pytest.approx(150.0, rel=0.15)
    assert br["p_value"] < 0.01


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_stalled_steps_neither_hide_a_break_nor_make_one(seed):
    """A few stalls (a step 40-400 ms late) among ~60 steps: the 15 ms jump above N = 16 is still found, and a clean
    line with the same stalls shows none. Without the break test's own outlier rule the stalls' squares swamp both
    fits' sums and the jump goes unreported (the sweep test against the simulated server failed so, now and then)."""
    n = np.repeat([1, 2, 4, 8, 12, 16, 24, 32, 48, 64], 6)
    rng = np.random.default_rng(seed)
    stalls = np.zeros(n.size)
    stalls[rng.choice(n.size, 4, replace=False)] = rng.uniform(40.0, 400.0, 4)
    clean = 20.0 + 2.0 * n + rng.normal(0.0, 1.0, n.size) + stalls
    fit = fit_step_time(n, clean + np.where(n > 16, 15.0, 0.0))
    assert len(fit.breaks) == 1 and fit.breaks[0]["at_n"] == 24
    assert fit.breaks[0]["jump_ms"] == pytest.approx(15.0, abs=3.0)
    assert fit_step_time(n, clean).breaks == []


def test_no_break_on_a_clean_line_and_too_few_points_refused():
    assert fit_step_time(N, _noisy(8.0, 0.05, 5, sigma=0.2)).breaks == []
    with pytest.raises(BadRequestError):
        fit_step_time([4, 4, 4], [10, 11, 12])


def test_fit_from_sweep_and_telemetry():
    pts = [{"concurrency": c, "achieved_concurrency": c * 0.98, "summary": {"tpot_ms": {"median": 54 + 30 * c * 0.98}}}
           for c in (1, 2, 4, 8, 16)]
    fit = fit_from_sweep(pts)
    assert fit.a_ms == pytest.approx(54.0) and fit.b_ms == pytest.approx(30.0)
    # a sweep point without a steady window (tpot_ms_median None) is left out, not refilled run-wide
    skewed = pts + [{"concurrency": 32, "achieved_concurrency": 31.0, "tpot_ms_median": None,
                     "summary": {"tpot_ms": {"median": 5000.0}}}]
    assert fit_from_sweep(skewed).b_ms == pytest.approx(30.0)
    recs = [{"kind": "decode", "batch_size": n, "step_ms": 10 + 0.5 * n} for n in (1, 2, 4, 8, 16)]
    recs += [{"kind": "prefill", "batch_size": 3, "step_ms": 500.0}]  # ignored
    tel = fit_from_telemetry(recs)
    assert tel.a_ms == pytest.approx(10.0) and tel.b_ms == pytest.approx(0.5)
