"""benchmarks/results_md renders RESULTS.md tables from result files: plain and dotted (nested) columns, and
rows lacking a column asked for are left out rather than shown with a made-up value."""

from __future__ import annotations

import json

from benchmarks.results_md import render


def test_dotted_columns_read_nested_fields_and_rows_without_them_drop(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"environment": {"device": "GPU", "date": "d", "commit": "c"}, "rows": [
        {"model": "a", "ratio": 0.5, "steps": {"busy": 0.25}},
        {"model": "b", "ratio": 1.5},
    ]}))
    out = render(f"{path}=model,ratio,steps.busy")
    assert "commit c" in out
    assert "| a | 0.500 | 0.250 |" in out
    assert "| b |" not in out
    assert "| b | 1.500 |" in render(f"{path}=model,ratio")
