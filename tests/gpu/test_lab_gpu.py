"""The lab's GPU pieces: the streaming-read probe in bf16 at a size that needs many passes, and the
start-up calibration that times a graph captured at the running size beside split and eager."""

from __future__ import annotations

import logging

import torch

from graphserve.config import EngineConfig
from graphserve.engine.startup import start_gpu
from graphserve.kernels.stream_read import stream_read, stream_read_reference
from graphserve.models.loader import load_model


def test_stream_read_bf16_sums_the_whole_buffer():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.rand((64 << 20) + 123, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    for programs, block, warps in ((528, 4096, 8), (1056, 2048, 4)):
        partial = stream_read(x, programs, block=block, num_warps=warps)
        torch.testing.assert_close(partial.double().sum(), stream_read_reference(x).double(), rtol=1e-4, atol=0)


def test_oversize_calibration_times_a_full_graph_and_logs_its_factor(caplog):
    device = torch.device("cuda")
    config = EngineConfig(model="builtin:tiny-llama", device="cuda", dtype="float32", cuda_graph_max_bs=8,
                          max_running_requests=24, max_model_len=256)
    loaded = load_model(config, device)
    with caplog.at_level(logging.INFO):
        gpu = start_gpu(config, loaded, device, 256)
    cal = gpu.oversize
    assert gpu.graph_sizes[-1] == 8 and cal is not None and cal.rows == 24
    assert cal.split_ms > 0 and cal.eager_ms > 0 and cal.full_graph_ms is not None and cal.full_graph_ms > 0
    assert cal.mode == gpu.oversize_mode == gpu.runner.oversize_mode
    assert cal.full_graph_speedup == min(cal.split_ms, cal.eager_ms) / cal.full_graph_ms
    text = caplog.text
    assert f"run as {cal.mode}: split-graph" in text and f"is {cal.full_graph_speedup:.2f}x faster" in text
    # the trial capture stays out of the log: doctor reads capture lines as the captured sizes
    assert "bs [24]" not in text
    assert gpu.runner.graphs.sizes[-1] == 8  # the engine's graphs are untouched
