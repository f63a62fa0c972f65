"""Helpers for the tests that run benchmarks/moe_tune.py's sweep on the interpreter."""

from __future__ import annotations


def before_never_kept(real_ms):
    """``moe_tune._Bucket.ms`` with the timing of what ran before the sweep (a call with no overrides) made slow:
    the wall-clock timings of these tests then never keep what ran before (moe_tune's ``gemm_from``), so the tiles
    they assert are the sweep's."""
    return lambda self, **overrides: real_ms(self, **overrides) + (0.0 if overrides else 1e9)
