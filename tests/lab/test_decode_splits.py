"""benchmarks/decode_splits.py's summary on CPU: per shape, cache and batch, the rule's pick and the fastest count
timed, from the rows alone."""

from __future__ import annotations

import pytest

from benchmarks.decode_splits import summary


def test_summary_sets_the_pick_against_the_fastest_count() -> None:
    rows = [{"shape": "s", "cache": c, "bs": 64, "ctx": 1024, "splits": n, "picked": n == pick, "us": us}
            for c, pick, times in (("bf16", 1, {1: 10.0, 2: 8.0, 3: 9.0}), ("fp8_e4m3", 3, {1: 12.0, 3: 9.0}))
            for n, us in times.items()]
    got = {s["cache"]: s for s in summary(rows)}
    assert (got["bf16"]["picked"], got["bf16"]["best"], got["bf16"]["best_us"]) == (1, 2, 8.0)
    assert got["bf16"]["picked/best"] == pytest.approx(10.0 / 8.0)
    assert (got["fp8_e4m3"]["picked"], got["fp8_e4m3"]["best"], got["fp8_e4m3"]["picked/best"]) == (3, 3, 1.0)
