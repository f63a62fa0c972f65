"""Wall-time attribution of a profiled step: on timelines whose every number is known (kernels overlapping
under programmatic dependent launch, kernels nested in a long one on another stream, gaps), the categories add
up to the step's span, overlapped time is split evenly and counted once, and the order of the trace does not
matter. Summing kernel durations instead reported 128% of a replayed MoE step."""

from __future__ import annotations

import random

import pytest

from graphserve.engine.step_trace import breakdown
from graphserve.engine.trace_categories import CATEGORIES, GAPS, WORK_CATEGORIES, union_length, wall_shares


def _approx(d: dict[str, float]) -> dict[str, object]:
    return {k: pytest.approx(v, abs=1e-9) for k, v in d.items()}


def test_pdl_chain_splits_each_overlap_between_the_two_kernels():
    # each kernel starts during its predecessor's tail, as programmatic dependent launch lets it
    ivs = [(0.0, 10.0, "dense_gemm"), (8.0, 20.0, "attention"), (18.0, 30.0, "moe")]
    s = wall_shares(ivs, 0.0, 35.0)
    assert s.wall["dense_gemm"] == pytest.approx(9.0)  # 0-8 alone, half of 8-10
    assert s.wall["attention"] == pytest.approx(10.0)  # half of 8-10, 10-18 alone, half of 18-20
    assert s.wall["moe"] == pytest.approx(11.0)
    assert s.wall[GAPS] == pytest.approx(5.0)
    assert sum(s.wall.values()) == pytest.approx(35.0)
    assert (s.busy["dense_gemm"], s.busy["attention"], s.busy["moe"]) == (10.0, 12.0, 12.0)
    assert sum(s.busy.values()) == pytest.approx(34.0) and s.overlapped == pytest.approx(4.0)


def test_nested_kernels_and_overlap_within_one_category():
    ivs = [(0.0, 100.0, "communication"),  # a long kernel on another stream, the others inside it
           (10.0, 20.0, "dense_gemm"), (30.0, 40.0, "attention"),
           (50.0, 70.0, "moe"), (60.0, 80.0, "moe")]  # two MoE kernels overlapping: still MoE's time, once
    s = wall_shares(ivs, 0.0, 100.0)
    assert s.wall["dense_gemm"] == pytest.approx(5.0) and s.wall["attention"] == pytest.approx(5.0)
    assert s.wall["moe"] == pytest.approx(15.0)  # half of the 30 us the MoE kernels cover, not of their 40 busy
    assert s.wall["communication"] == pytest.approx(75.0) and s.wall[GAPS] == 0.0
    assert s.busy["moe"] == pytest.approx(40.0) and s.busy["communication"] == pytest.approx(100.0)
    assert s.overlapped == pytest.approx(50.0)


def test_work_outside_the_span_is_clipped_and_gaps_fill_the_rest():
    # a kernel launched early starts before the previous step's last one ends: only its part inside counts
    ivs = [(-5.0, 3.0, "dense_gemm"), (6.0, 7.0, "norm_elementwise"), (9.0, 14.0, "sampling"), (20.0, 25.0, "other")]
    s = wall_shares(ivs, 0.0, 12.0)
    assert s.wall == _approx({**dict.fromkeys(CATEGORIES, 0.0), "dense_gemm": 3.0, "norm_elementwise": 1.0,
                              "sampling": 3.0, GAPS: 5.0})
    assert s.busy["dense_gemm"] == pytest.approx(3.0) and s.busy["other"] == 0.0 and s.overlapped == 0.0
    empty = wall_shares([], 2.0, 4.0)
    assert empty.wall[GAPS] == pytest.approx(2.0) and sum(empty.busy.values()) == 0.0


def test_union_length_against_a_unit_grid():
    rng = random.Random(1)
    for _ in range(50):
        ivs = []
        for _ in range(rng.randrange(0, 12)):
            a = rng.randrange(0, 60)
            ivs.append((a, a + rng.randrange(0, 15)))
        covered = {t for a, b in ivs for t in range(a, b)}
        assert union_length(ivs) == len(covered)


def test_random_timelines_add_up_and_do_not_depend_on_trace_order():
    rng = random.Random(0)
    for _ in range(200):
        lo, hi = 0.0, rng.uniform(10.0, 1000.0)
        ivs = []
        for _ in range(rng.randrange(0, 40)):
            a = rng.uniform(-0.1 * hi, hi)
            ivs.append((a, a + rng.expovariate(20.0 / hi), rng.choice(WORK_CATEGORIES)))
        s = wall_shares(ivs, lo, hi)
        assert abs(sum(s.wall.values()) - (hi - lo)) <= 1e-9 * hi
        # the shares of a step add up to 100%: the 2% of `graphserve profile`'s promise, here to rounding
        assert abs(sum(100 * v / (hi - lo) for v in s.wall.values()) - 100.0) < 2.0
        clipped = [(max(a, lo), min(b, hi), c) for a, b, c in ivs if min(b, hi) > max(a, lo)]
        assert s.wall[GAPS] == pytest.approx(hi - lo - union_length((a, b) for a, b, _ in clipped), abs=1e-9 * hi)
        present = {c for _, _, c in clipped}
        for c in WORK_CATEGORIES:
            own = union_length((a, b) for a, b, k in clipped if k == c)
            # at every instant a category runs it gets at least 1/k of it, k the categories running then
            assert own / max(1, len(present)) - 1e-9 * hi <= s.wall[c] <= own + 1e-9 * hi
            assert s.busy[c] >= s.wall[c] - 1e-9 * hi
        shuffled = ivs[:]
        rng.shuffle(shuffled)
        again = wall_shares(shuffled, lo, hi)
        assert again.wall == _approx(s.wall) and again.overlapped == pytest.approx(s.overlapped, abs=1e-9 * hi)


def test_an_unknown_category_is_refused_by_name():
    with pytest.raises(ValueError, match="category='gaps_host'"):
        wall_shares([(0.0, 1.0, GAPS)], 0.0, 2.0)


def _x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_a_replayed_pdl_step_read_from_a_trace_adds_up_to_its_span():
    """A trace shaped like a replayed MoE decode step under PDL: every kernel starts 40% into its predecessor,
    so their durations sum to far more than the span (what was reported as 128%); the wall shares do not."""
    ev = [_x("user_annotation", "graphserve.launch", 0, 10), _x("user_annotation", "graphserve.launch", 20, 10)]
    names = ["nvjet_gemm_qkv", "_decode_split_kernel", "nvjet_gemm_o", "_rms_norm_kernel", "moe_route_kernel",
             "fused_moe_kernel", "fused_moe_kernel_down", "_rms_norm_kernel"]
    ev += [_x("cuda_runtime", "cudaGraphLaunch", 1, 2, corr=1), _x("kernel", "nvjet_gemm", 100, 50, tid=7, corr=1)]
    t = 170.0  # 20 us after the previous step's last kernel: the host's gap
    for i, name in enumerate(names):
        corr = 10 + i
        ev += [_x("cuda_runtime", "cudaLaunchKernel", 21 + i, 1, corr=corr), _x("kernel", name, t, 20, tid=7, corr=corr)]
        t += 12  # the next one starts 12 us into this one's 20
    first, step = breakdown(ev, "cuda")
    assert first is None
    span = (t - 12 + 20 - 150) / 1e3
    assert step.span_ms == pytest.approx(span)
    assert sum(step.busy_ms.values()) == pytest.approx(8 * 0.020) and sum(step.busy_ms.values()) > 1.2 * span
    assert sum(step.categories_ms.values()) == pytest.approx(span)
    assert abs(100 * sum(step.categories_ms.values()) / step.span_ms - 100) < 2.0
    assert step.categories_ms[GAPS] == pytest.approx(0.020) and step.overlapped_ms == pytest.approx(7 * 0.008)
    # the MoE kernels' own overlaps stay MoE's; their overlaps with the norms around them are split
    assert step.categories_ms["moe"] == pytest.approx((4 + 28 + 4) / 1e3)
    assert step.categories_ms["moe"] < step.busy_ms["moe"] == pytest.approx(0.060)
    assert step.kernel_ms["fused_moe_kernel"] == pytest.approx(0.020)
