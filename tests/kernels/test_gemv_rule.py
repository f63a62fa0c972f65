"""The gemv routing rule follows the committed measurement: graphserve/kernels/gemv_rule.json is what
benchmarks/gemv.py derives from benchmarks/results/gemv.json, and it routes nothing it did not measure."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gemv import largest_winning_m, rule_from_results
from graphserve.kernels.gemv_config import RULE_PATH, GemvRule, load_rule

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gemv.json"


def test_committed_rule_is_the_one_the_committed_measurement_gives():
    committed = json.loads(RULE_PATH.read_text())
    derived = rule_from_results(json.loads(RESULTS.read_text()))
    assert committed == derived, "rerun: python3 -m benchmarks.gemv --rule-from benchmarks/results/gemv.json"


def test_rule_limits_follow_every_measured_row():
    """No (kind, shape) routes M rows to gemv unless gemv won at every measured batch up to M."""
    results = json.loads(RESULTS.read_text())
    rule = load_rule()
    assert rule.device == results["environment"]["device"]
    for r in results["rows"]:
        if r["M"] <= rule.max_rows("linear", r["N"], r["K"]):
            assert r["gemv/cublas"] < 1.0, r


def _payload(ratios: dict[str, list[float]], fused: list[dict] | None = None) -> dict:
    rows = [{"shape": name, "M": m, "N": 64 * (i + 1), "K": 32, "gemv/cublas": ratio}
            for i, (name, rs) in enumerate(ratios.items()) for m, ratio in zip([1, 2, 4, 8], rs)]
    return {"environment": {"device": "Card X", "date": "d", "commit": "c"}, "rows": rows, "fused": fused or []}


def test_a_loss_ends_the_winning_range_even_if_larger_batches_win_again():
    payload = _payload({"a": [0.5, 0.9, 1.2, 0.8], "b": [1.01, 0.5, 0.5, 0.5], "c": [0.9, 0.9, 0.9, 0.9]})
    assert largest_winning_m(payload["rows"], "gemv/cublas") == {"a": 2, "b": 0, "c": 8}
    rule = GemvRule.from_json(rule_from_results(payload))
    assert rule.device == "Card X"
    assert [rule.max_rows("linear", n, 32) for n in (64, 128, 192)] == [2, 0, 8]
    assert rule.max_rows("linear", 999, 32) == 0  # a shape never measured stays on cuBLAS
    assert rule.max_rows("norm", 64, 32) == 0  # a kind never measured too


def test_fused_kinds_are_ruled_apart():
    fused = [{"shape": "a", "M": m, "kind": "norm", "fused/unfused": r} for m, r in [(1, 0.7), (2, 1.1)]]
    fused += [{"shape": "a", "M": m, "fused/unfused": r} for m, r in [(1, 0.9), (2, 0.9), (4, 0.9)]]  # no kind: SiLU·mul
    rule = GemvRule.from_json(rule_from_results(_payload({"a": [1.5, 1.5, 1.5, 1.5]}, fused)))
    assert (rule.max_rows("linear", 64, 32), rule.max_rows("norm", 64, 32), rule.max_rows("silu_mul", 64, 32)) == (0, 1, 4)
