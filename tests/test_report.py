from __future__ import annotations

import json
import types

from graphserve.analysis import report
from graphserve.analysis.report import format_table, write_report
from graphserve.analysis.scaling import fit_from_sweep


def _summary(c: int) -> dict:
    step = 54 + 30 * c
    lat = lambda base: {"mean": base, "median": base, "std": 1.0, "p90": 1.2 * base, "p95": 1.3 * base, "p99": 1.5 * base}  # noqa: E731
    return {"output_throughput": c * 1000 / step, "ttft_ms": lat(200 + 10 * c), "tpot_ms": lat(step),
            "itl_ms": lat(step), "e2e_ms": lat(step * 256), "duration_s": 60.0, "completed": 64, "failed": 0}


def _sweep() -> dict:
    points = [{"concurrency": c, "achieved_concurrency": float(c), "summary": _summary(c)} for c in (1, 2, 4, 8, 16, 32)]
    return {"config": {"model": "dummy:llama3-8b"}, "points": points, "fit": fit_from_sweep(points).to_dict(),
            "telemetry_fit": None}


def test_write_report_makes_five_files_with_embedded_images(tmp_path):
    paths = write_report(_sweep(), tmp_path / "out")
    assert set(paths) == {"results.json", "scaling.png", "latency.png", "report.md", "report.html"}
    for p in paths.values():
        assert p.is_file() and p.stat().st_size > 0
    for png in ("scaling.png", "latency.png"):
        assert paths[png].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = paths["report.html"].read_text()
    assert html.count("data:image/png;base64,") == 2
    md = paths["report.md"].read_text()
    assert "ceiling 1000/b: 33.3 tok/s" in md and "| C |" in md
    saved = json.loads(paths["results.json"].read_text())
    assert saved["fit"]["b_ms"] > 29.0 and len(saved["points"]) == 6


def test_format_table_and_cli_on_plain_bench_results(tmp_path, capsys):
    table = format_table(_sweep()["points"])
    assert table.splitlines()[0].split()[:3] == ["C", "achieved", "out"]
    assert len(table.splitlines()) == 7
    files = []
    for c in (1, 4, 16):
        f = tmp_path / f"bench_{c}.json"
        f.write_text(json.dumps({"config": {"max_concurrency": c}, "summary": _summary(c), "requests": []}))
        files.append(str(f))
    assert report.run(types.SimpleNamespace(results=files, output_dir=str(tmp_path / "rep"))) == 0
    out = capsys.readouterr().out
    assert "report.html" in out
    assert (tmp_path / "rep" / "scaling.png").is_file()
    assert "step_time = " in (tmp_path / "rep" / "report.md").read_text()
