"""benchmarks.ncu_kernels' reading of Nsight Compute's CSV pages, and step_breakdown's replay boundaries (CPU)."""

from __future__ import annotations

import csv
import io
from types import SimpleNamespace

import pytest
import torch

from benchmarks.ncu_kernels import read_report
from benchmarks.step_breakdown import replay_boundaries

DETAIL_COLS = ["ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value"]


def _details(rows: list[tuple]) -> str:
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    w.writerow(DETAIL_COLS)
    for r in rows:
        w.writerow(r)
    return out.getvalue()


def _raw(header: list[str], units: list[str], lines: list[list[str]]) -> str:
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    for line in (header, units, *lines):
        w.writerow(line)
    return out.getvalue()


@pytest.fixture
def pages(tmp_path):
    details = _details([
        ("0", "_fp8_gemv_kernel", "GPU Speed Of Light Throughput", "Duration", "ns", "12,030"),
        ("0", "_fp8_gemv_kernel", "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "43.74"),
        ("0", "_fp8_gemv_kernel", "Launch Statistics", "Dynamic Shared Memory Per Block", "Kbyte/block", "98.30"),
        ("0", "_fp8_gemv_kernel", "Launch Statistics", "Grid Size", "", "768"),
        ("1", "_stream_read_kernel", "GPU Speed Of Light Throughput", "Duration", "us", "8.03"),
        ("1", "_stream_read_kernel", "Occupancy", "Achieved Occupancy", "%", "80.88"),
    ])
    stall = "smsp__pcsamp_warps_issue_stalled_"
    header = ["ID", "Kernel Name", "dram__bytes_read.sum", stall + "long_scoreboard", stall + "long_scoreboard_not_issued",
              stall + "barrier", stall + "wait", stall + "selected"]
    raw = _raw(header, ["", "", "Mbyte", "", "", "", "", ""],
               [["0", "_fp8_gemv_kernel", "25.24", "60", "999", "20", "15", "5"],
                ["1", "_stream_read_kernel", "25.17", "80", "0", "10", "5", "5"]])
    d, r = tmp_path / "details.csv", tmp_path / "raw.csv"
    d.write_text(details)
    r.write_text(raw)
    return str(d), str(r)


def test_report_rows_carry_units_stalls_and_labels(pages) -> None:
    rows = read_report(*pages, ["qkv m1", "qkv bare read"])
    gemv, read = rows
    assert gemv["case"] == "qkv m1" and read["case"] == "qkv bare read"
    assert gemv["duration_us"] == pytest.approx(12.03)  # ns -> us, thousands separator read
    assert gemv["smem_bytes"] == pytest.approx(98_300)  # ncu's Kbyte is 1000 bytes
    assert gemv["grid"] == 768 and gemv["dram_pct"] == pytest.approx(43.74)
    assert gemv["dram_read_mb"] == pytest.approx(25.24)
    assert gemv["dram_gbps"] == pytest.approx(25.24 / 12.03 * 1e3)
    # the three most sampled stall reasons as fractions of all samples; the _not_issued counters are not stalls
    assert gemv["stalls"] == {"long_scoreboard": 0.6, "barrier": 0.2, "wait": 0.15}
    assert list(read["stalls"]) == ["long_scoreboard", "barrier", "wait"]
    assert read["achieved_occupancy_pct"] == pytest.approx(80.88)


def test_report_refuses_labels_that_do_not_line_up(pages) -> None:
    with pytest.raises(ValueError, match="2 launches for 3 cases"):
        read_report(*pages, ["a", "b", "c"])


def _event(name: str, start: float, end: float):
    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                           time_range=SimpleNamespace(start=start, end=end))


def test_replay_boundaries_sum_idle_and_overlap_per_pair_of_kernels() -> None:
    # times in microseconds, as the profiler's time ranges; two layers of (gemv, attention), a CPU event ignored
    events = [_event("gemv", 0, 10), _event("attn", 12, 20), _event("gemv", 19, 30), _event("attn", 30, 40),
              SimpleNamespace(name="host", device_type=torch.autograd.DeviceType.CPU,
                              time_range=SimpleNamespace(start=0, end=100))]
    prof = SimpleNamespace(events=lambda: events)
    rows, in_graph = replay_boundaries(prof)
    by = {r["boundary"]: r for r in rows}
    assert by["gemv -> attn"]["count"] == 2
    assert by["gemv -> attn"]["idle_ms"] == pytest.approx(0.002)  # 12 - 10; 30 - 30 adds nothing
    assert by["attn -> gemv"]["overlap_ms"] == pytest.approx(-0.001)  # the second gemv started 1 us early
    assert by["attn -> gemv"]["gap_ms"] == pytest.approx(-0.001)
    assert rows[0]["boundary"] == "gemv -> attn"  # the most idle first
    assert in_graph == {"gemv": pytest.approx(0.021), "attn": pytest.approx(0.018)}
