"""`graphserve profile` of a replayed MoE decode step adds up: its categories are wall time on the step's
timeline, so kernels overlapping under programmatic dependent launch (on by default on Hopper) are not
counted twice. Summing their durations gave 128% of a replayed batch-1 step and 107% at batch 64."""

from __future__ import annotations

import gc

import pytest
import torch

from graphserve.analysis.profile import format_profile, profile_in_process
from graphserve.config import EngineConfig
from graphserve.engine.core import EngineCore
from graphserve.engine.trace_categories import CATEGORIES, GAPS, WORK_CATEGORIES

STEPS = 6


@pytest.fixture(scope="module")
def moe_core():
    c = EngineCore(EngineConfig(model="dummy:olmoe-1b-7b", max_model_len=512, cuda_graph_max_bs=64,
                                mem_fraction_static=0.5))
    yield c
    del c
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("batch_size", [1, 64])
def test_replayed_moe_step_shares_add_up_to_100_percent(moe_core, batch_size):
    prof = profile_in_process(moe_core, batch_size, STEPS, 64)
    graph, eager = prof["phases"]
    assert (graph["mode"], graph["run_as"], graph["batch_size"]) == ("graph", ["graph"], batch_size)
    assert graph["steps"] == eager["steps"] == STEPS
    for phase in (graph, eager):
        cats, pct = phase["categories_ms"], phase["categories_pct"]
        assert set(cats) == set(pct) == set(CATEGORIES) and set(phase["busy_ms"]) == set(WORK_CATEGORIES)
        assert abs(sum(pct.values()) - 100.0) <= 2.0, (phase["mode"], pct)
        assert abs(sum(cats.values()) - phase["span_ms"]) <= 0.02 * phase["span_ms"], phase
        assert cats["moe"] > 0 and cats["dense_gemm"] > 0 and cats["attention"] > 0, (phase["mode"], cats)
        for c in WORK_CATEGORIES:  # a share never exceeds the category's own summed kernel time
            assert cats[c] <= phase["busy_ms"][c] * 1.0001 + 1e-6, (phase["mode"], c, cats[c], phase["busy_ms"])
        assert 0.0 <= phase["overlapped_ms"] <= phase["span_ms"] and cats[GAPS] >= 0.0
    # the trace's timeline and the engine's own clock describe the same replayed steps
    assert abs(graph["span_ms"] - graph["step_ms"]) <= 0.10 * graph["step_ms"], graph["per_step"]
    if graph["attribution"] == "measured" and sum(graph["busy_ms"].values()) > graph["span_ms"]:
        # kernels overlapped: summing them would have passed 100%; the overlap is what the shares split
        assert graph["overlapped_ms"] > 0.0
    text = format_profile(prof)
    assert "split evenly among them" in text and "ms wall per step" in text
    assert not moe_core.has_unfinished_requests()
