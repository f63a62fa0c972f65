from __future__ import annotations

import json
import types

import numpy as np
import pytest

from graphserve.analysis import compare
from graphserve.analysis.compare import NO_DIFF, RunData, compare_runs
from graphserve.errors import BadRequestError


def _result(seed: int, scale: float = 1.0, n: int = 150) -> dict:
    """Synthetic bench result: latencies scaled by ``scale`` and a run that lasts ``scale`` times longer."""
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(n):
        out = int(rng.integers(40, 80))
        itl = rng.gamma(25.0, 0.8, out - 1) * scale
        ttft = rng.gamma(6.0, 15.0) * scale
        reqs.append({"ttft_ms": ttft, "tpot_ms": float(itl.mean()), "e2e_ms": ttft + float(itl.sum()),
                     "output_tokens": out, "input_tokens": 128, "start": 0.0, "end": 1.0,
                     "itl_ms": itl.tolist(), "ok": True, "error": None})
    return {"config": {}, "summary": {"duration_s": 30.0 * scale, "completed": n, "failed": 0}, "requests": reqs}


METRICS = ["output_throughput", "tpot_mean", "itl_p50", "ttft_mean", "e2e_mean"]


def _by_metric(rows):
    return {r.metric: r for r in rows}


def test_planted_ten_percent_slowdown_is_detected_by_direction():
    rows = _by_metric(compare_runs([RunData.from_result(_result(1))], [RunData.from_result(_result(2, 1.10))],
                                   METRICS, n_boot=400, seed=0))
    assert rows["tpot_mean"].verdict == "slower"
    assert rows["itl_p50"].verdict == "slower"
    assert rows["output_throughput"].verdict == "slower"  # same tokens over a longer run
    assert rows["tpot_mean"].rel_ci[0] < 0.10 < rows["tpot_mean"].rel_ci[1]


def test_planted_ten_percent_speedup_is_faster():
    rows = _by_metric(compare_runs([RunData.from_result(_result(3))], [RunData.from_result(_result(4, 1 / 1.10))],
                                   METRICS, n_boot=400, seed=0))
    assert rows["tpot_mean"].verdict == "faster"
    assert rows["output_throughput"].verdict == "faster"
    assert rows["output_throughput"].diff > 0


def test_same_distribution_is_no_difference_also_with_repeats():
    a = [RunData.from_result(_result(s)) for s in (100, 101)]
    b = [RunData.from_result(_result(s)) for s in (102, 103)]
    rows = compare_runs(a, b, METRICS, n_boot=200, seed=0)
    assert {r.verdict for r in rows} == {NO_DIFF}
    for r in rows:
        assert r.diff_ci[0] <= 0 <= r.diff_ci[1]


def test_cli_prints_table_and_json(tmp_path, capsys):
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(_result(5)))
    res = _result(6, 1.10)
    res["requests"][0]["tpot_ms"] = None  # not streamed: skipped, not guessed
    pb.write_text(json.dumps(res))
    args = types.SimpleNamespace(a=str(pa), b=str(pb), repeats_a=[], repeats_b=[], metric=["tpot_mean"],
                                 bootstrap=200, seed=0, json=True)
    assert compare.run(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[0]["metric"] == "tpot_mean" and data[0]["verdict"] == "slower"
    args.json = False
    compare.run(args)
    assert "tpot_mean" in capsys.readouterr().out


def test_unknown_metric_is_refused():
    run = RunData.from_result(_result(7, n=20))
    with pytest.raises(BadRequestError, match="--metric"):
        compare_runs([run], [run], ["nope"], n_boot=10)
