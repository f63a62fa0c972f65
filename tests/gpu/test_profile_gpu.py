"""`graphserve profile` on the GPU: graph replay and the same batch eager, each adding up to the step time
the engine measured, and the engine put back as it was (graphs, no hooks)."""

from __future__ import annotations

import gc

import pytest
import torch

from graphserve.analysis.profile import profile_in_process
from graphserve.config import EngineConfig
from graphserve.engine.core import EngineCore
from graphserve.engine.trace_categories import CATEGORIES


@pytest.fixture(scope="module")
def core():
    c = EngineCore(EngineConfig(model="dummy:qwen3-0.6b", max_model_len=1024, cuda_graph_max_bs=16,
                                mem_fraction_static=0.5))
    yield c
    del c
    gc.collect()
    torch.cuda.empty_cache()


def test_graph_and_eager_phases_add_up(core):
    graphs = core.runner.graphs
    prof = profile_in_process(core, 8, 6, 64)
    graph, eager = prof["phases"]
    assert (graph["mode"], eager["mode"]) == ("graph", "eager")
    assert graph["run_as"] == ["graph"] and eager["run_as"] == ["eager"]
    assert graph["batch_size"] == eager["batch_size"] == 8
    assert eager["attribution"] == "measured" and eager["kernels_per_step"] > 50
    for phase in (graph, eager):
        cats = phase["categories_ms"]
        assert set(cats) == set(CATEGORIES) and phase["steps"] == 6
        # the overlap schedule's last traced step holds the profiler's stop and export: kept out, said so
        assert all(x["profiler_ms"] > 0 for x in phase["excluded_steps"])
        assert phase["step_ms_range"][1] < 3.0 * phase["step_ms_median"], phase["per_step"]
        assert abs(sum(cats.values()) - phase["step_ms"]) <= 0.10 * phase["step_ms"], phase
        # wall-time shares of the step's timeline: overlapping kernels are not counted twice
        assert abs(sum(phase["categories_pct"].values()) - 100.0) <= 2.0, phase["categories_pct"]
        for c in ("dense_gemm", "attention", "norm_elementwise", "sampling"):
            assert cats[c] > 0, (phase["mode"], c)
    if graph["attribution"] == "eager":  # kernels inside replays were hidden: the output must say so
        assert any("hides kernels inside CUDA graphs" in n for n in prof["notes"])
        assert sum(v for k, v in graph["categories_ms"].items() if k != "gaps_host") <= 1.10 * graph["step_ms"]
    else:
        assert graph["kernels_per_step"] >= 0.5 * eager["kernels_per_step"]
    assert core.runner.graphs is graphs and "launch" not in vars(core.runner)
    assert not core.has_unfinished_requests()
