"""The benchmarks' bandwidth floor: best of the probes and of the rates the run's own work reached,
so no measured row can sit below its floor; the datasheet column only where the card is known."""

from __future__ import annotations

import pytest

from benchmarks.roofline import ReadBandwidth, datasheet_read_gbs

L2 = 50 << 20


def test_datasheet_lookup_prefers_the_specific_variant():
    assert datasheet_read_gbs("NVIDIA H200") == 4800.0
    assert datasheet_read_gbs("NVIDIA H100 80GB HBM3") == 3350.0  # SXM
    assert datasheet_read_gbs("NVIDIA H100 PCIe") == 2000.0
    assert datasheet_read_gbs("NVIDIA L4") is None


def test_a_run_faster_than_every_probe_becomes_the_floor():
    bw = ReadBandwidth({"stream_read": 4200.0, "torch.sum": 4100.0, "copy (read side)": 2100.0}, 4800.0, L2)
    assert bw.best_method == "stream_read" and bw.floor_ms(4.2e9) == pytest.approx(1.0)
    steps = [(8e9, 1.9), (6e9, 1.40), (3e9, 0.9)]  # 4211, 4286 and 3333 GB/s
    for i, (nbytes, ms) in enumerate(steps):
        bw.observe(f"step {i}", nbytes, ms)
    assert bw.best_method == "step 1" and bw.best_gbs == pytest.approx(6e9 / 1.40 / 1e6)
    ratios = [bw.ratios(ms, nbytes)["ratio"] for nbytes, ms in steps]
    assert min(ratios) == pytest.approx(1.0) and all(r >= 1.0 - 1e-12 for r in ratios)
    summary = bw.summary()
    assert summary["best_observed"] == "step 1" and summary["methods"]["stream_read"] == 4200.0


def test_work_that_fits_in_l2_is_not_taken_as_a_memory_rate():
    bw = ReadBandwidth({"stream_read": 4000.0}, None, L2)
    bw.observe("small kernel", L2, 0.001)  # 52 TB/s: served from cache
    assert bw.best_gbs == 4000.0 and bw.observed == {}


def test_ratios_take_the_compute_floor_and_the_datasheet():
    bw = ReadBandwidth({"stream_read": 4000.0}, 4800.0, L2)
    r = bw.ratios(2.0, 4e9, flops=1e12, peak_tflops=1000.0)  # read 1.0 ms, compute 1.0 ms
    assert r["floor_ms"] == pytest.approx(1.0) and r["ratio"] == pytest.approx(2.0)
    assert r["datasheet_floor_ms"] == pytest.approx(1.0)  # compute-bound at either bandwidth
    r = bw.ratios(2.0, 4.8e9)
    assert r["ratio"] == pytest.approx(2.0 / 1.2) and r["ratio_datasheet"] == pytest.approx(2.0)
    unknown = ReadBandwidth({"stream_read": 4000.0}, None, L2).ratios(2.0, 4e9)
    assert unknown["datasheet_floor_ms"] is None and unknown["ratio_datasheet"] is None


def test_stream_grids_are_persistent_or_one_program_a_block():
    from benchmarks.roofline import STREAM_GRIDS, stream_programs

    assert stream_programs(4, 132, 10_000, 4096) == 528  # a few programs an SM, whatever the size
    assert stream_programs(0, 132, 10_000, 4096) == 3  # one a block: the last one partly masked
    assert stream_programs(0, 132, 8192, 4096) == 2
    assert any(per_sm == 0 for per_sm, _, _ in STREAM_GRIDS) and any(per_sm > 0 for per_sm, _, _ in STREAM_GRIDS)


def test_one_byte_buffers_are_read_as_16_bit_elements_of_the_same_bytes():
    import torch

    from benchmarks.roofline import wide_view

    w = torch.randn(8, 6).to(torch.float8_e4m3fn)
    wide = wide_view(w)
    assert wide.dtype == torch.bfloat16 and wide.numel() * 2 == w.numel()
    assert wide.data_ptr() == w.data_ptr()  # a view: the same bytes, no copy
    h = torch.randn(8, 6, dtype=torch.bfloat16)
    assert wide_view(h) is h
    with pytest.raises(ValueError, match="of 7 elements"):
        wide_view(torch.zeros(7, dtype=torch.uint8))
