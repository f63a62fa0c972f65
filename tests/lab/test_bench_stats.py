"""The resolution benchmarks/overhead.py reports beside a host-time difference: a bootstrap interval of
the difference of two medians, signed, never clamped."""

from __future__ import annotations

import random

from benchmarks.common import median_difference_ci, print_table


def _samples(center: float, spread: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [center + rng.uniform(-spread, spread) for _ in range(n)]


def test_a_clear_difference_excludes_zero_and_a_negative_one_stays_negative():
    lo, hi = median_difference_ci(_samples(5.1, 0.1, 200, 1), _samples(3.9, 0.1, 50, 2))
    assert 1.1 < lo < 1.2 < hi < 1.3
    lo, hi = median_difference_ci(_samples(3.70, 0.1, 200, 3), _samples(3.86, 0.1, 50, 4))
    assert -0.25 < lo < hi < 0.0  # the loop ran ahead of the GPU time taken apart: reported as such


def test_noise_larger_than_the_difference_gives_an_interval_holding_zero():
    lo, hi = median_difference_ci(_samples(4.0, 2.0, 20, 5), _samples(3.98, 2.0, 20, 6))
    assert lo < 0.0 < hi and hi - lo > 0.5


def test_a_table_without_rows_prints_its_header(capsys) -> None:
    """A run that measured nothing of a kind (a MoE model has no prefill row) prints the header and goes on."""
    print_table([], ["model", "ratio"])
    print_table([{"model": "m", "ratio": 1.25}], ["model", "ratio"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["model", "ratio"] and lines[1].split() == ["model", "ratio"]
    assert lines[2].split() == ["m", "1.2500"]  # a ratio column: 4 decimals (common.ratio_text)
