"""benchmarks.xcheck: our client against an external one, read from their own output files."""

from __future__ import annotations

import json

import pytest

from benchmarks import xcheck


def _ours(path, backend, mean, median, tokens=512):
    path.write_text(json.dumps({"config": {"backend": backend}, "summary": {
        "completed": 2, "total_output_tokens": tokens, "output_throughput": 100.0,
        "ttft_ms": {"mean": mean, "median": median, "p99": 2 * mean}, "tpot_ms": {"mean": 5.0}}}))
    return path


def _external(path, backend, mean, median, tokens=512):
    first = {"backend": "old", "completed": 1}  # bench_serving appends: only the last line is this run
    last = {"backend": backend, "completed": 2, "total_output_tokens": tokens, "output_throughput": 90.0,
            "mean_ttft_ms": mean, "median_ttft_ms": median, "p99_ttft_ms": 2 * mean, "mean_tpot_ms": 5.5}
    path.write_text(json.dumps(first) + "\n" + json.dumps(last) + "\n")
    return path


def test_rows_come_from_both_formats(tmp_path):
    ours = xcheck.read_row(_ours(tmp_path / "gs.json", "native", 100.0, 80.0))
    ext = xcheck.read_row(_external(tmp_path / "bs.jsonl", "sglang", 110.0, 70.0))
    assert (ours["client"], ours["backend"], ours["ttft_median_ms"], ours["output_tokens"]) == \
        ("graphserve", "native", 80.0, 512)
    assert (ext["client"], ext["backend"], ext["ttft_mean_ms"], ext["tpot_mean_ms"]) == \
        ("bench_serving", "sglang", 110.0, 5.5)


def test_within_noise_is_the_external_clients_own_spread(tmp_path):
    def run(label, ours_mean, ext_means, ext_medians, tokens=512):
        rows = [xcheck.read_row(_ours(tmp_path / f"{label}gs.json", "native", ours_mean, 50.0, tokens))]
        for i, (m, md) in enumerate(zip(ext_means, ext_medians)):
            rows.append(xcheck.read_row(_external(tmp_path / f"{label}bs{i}.jsonl", f"b{i}", m, md)))
        return label, rows

    out = xcheck.summarize([run("a", 130.0, [100.0, 140.0], [50.0, 52.0]), run("b", 100.0, [90.0, 95.0], [40.0, 60.0])])
    a, b, pooled = out["comparison"]
    assert a["ttft_mean_ms"]["difference"] == pytest.approx(10.0) and a["ttft_mean_ms"]["noise"] == 40.0
    assert a["ttft_mean_ms"]["within"] and a["ttft_median_ms"]["difference"] == pytest.approx(-1.0)
    assert a["ttft_median_ms"]["noise"] == pytest.approx(2.0) and a["ttft_median_ms"]["within"]
    assert b["ttft_mean_ms"]["difference"] == pytest.approx(7.5) and not b["ttft_mean_ms"]["within"]  # spread 5
    # pooled: the noise is one backend's largest change between runs (b0's mean 100 -> 90: 10; b1's 45)
    assert pooled["run"] == "all runs" and pooled["ttft_mean_ms"]["noise"] == pytest.approx(45.0)
    assert pooled["same_output_tokens"]
    odd = xcheck.summarize([run("c", 100.0, [100.0, 100.0], [50.0, 50.0], tokens=500)])
    assert len(odd["comparison"]) == 1 and not odd["comparison"][0]["same_output_tokens"]  # our 500 tokens against their 512


def test_a_run_needs_both_clients(tmp_path):
    rows = [xcheck.read_row(_ours(tmp_path / "gs.json", "native", 1.0, 1.0))]
    with pytest.raises(ValueError, match="run x: needs both clients"):
        xcheck.summarize([("x", rows)])


def test_the_result_names_where_it_was_measured(tmp_path, monkeypatch):
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.delenv("OUT", raising=False)
    ours = _ours(tmp_path / "gs.json", "native", 100.0, 80.0)
    ours.write_text(json.dumps({**json.loads(ours.read_text()), "environment": {"time": "2026-12-01T02:55:35+00:00"}}))
    ext = _external(tmp_path / "bs.jsonl", "sglang", 110.0, 70.0)
    monkeypatch.setattr("sys.argv", ["xcheck", "--device", "NVIDIA H200", "--run", "abc1234", str(ours), str(ext),
                                     "--result-name", "xc"])
    xcheck.main()
    out = json.loads((tmp_path / "results" / "xc.json").read_text())
    assert out["environment"] == {"date": "2026-12-01", "commit": "abc1234", "device": "NVIDIA H200"}
    assert [r["client"] for r in out["rows"]] == ["graphserve", "bench_serving"]
    assert out["comparison"][0]["run"] == "abc1234" and out["comparison"][0]["same_output_tokens"]
