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
    assert "| a | 0.5000 | 0.250 |" in out  # a ratio column with 4 decimals, any other float with 3
    assert "| b |" not in out
    assert "| b | 1.5000 |" in render(f"{path}=model,ratio")


def test_a_file_named_with_equals_signs_and_commas_parses(tmp_path):
    """The MoE tile tables' names hold ``=`` and ``,``: FILE ends at .json, then the optional :KEY and =COLS."""
    path = tmp_path / "E=8,I=16,H=32,dtype=bf16.json"
    path.write_text(json.dumps({"environment": {"commit": "t"}, "rows": [{"pairs": 2, "us": 1.5}],
                                "measurements": [{"pairs": 8, "us": 2.5}]}))
    assert "| 8 | 2.500 |" in render(f"{path}:measurements=pairs,us")
    assert "| 2 | 1.500 |" in render(f"{path}=pairs,us") and "| 2 | 1.500 |" in render(str(path))
    assert f"`{path}` ·" in render(str(path))


def test_names_under_results_take_key_and_columns(tmp_path, monkeypatch):
    from benchmarks import results_md

    monkeypatch.setattr(results_md, "RESULTS_DIR", tmp_path)
    (tmp_path / "r.json").write_text(json.dumps({"rows": [{"a": 1}], "other": [{"a": 2, "b": 3}]}))
    assert "| 2 | 3 |" in render("r:other=a,b") and "| 1 |" in render("r") and "| 2 |" in render("r:other")
    assert "`results/r.json`" in render("r")


def test_a_file_that_is_a_list_is_its_rows_and_says_it_names_no_run(tmp_path):
    path = tmp_path / "scratch.json"
    path.write_text(json.dumps([{"bs": 1, "ms": 2.5}, {"bs": 64, "ms": 7.25}]))
    out = render(f"{path}=bs,ms")
    assert "| 1 | 2.500 |" in out and "| 64 | 7.250 |" in out
    assert "no environment recorded" in out and "commit ?" not in out


def test_ratios_are_not_rounded_onto_a_target_and_none_reads_as_a_dash(tmp_path):
    """1.3004 against a <= 1.3 target must not read 1.300; a row with no floor (None) shows a dash, not 0.000."""
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps({"environment": {"commit": "x"}, "rows": [
        {"model": "a", "ratio": 1.3004, "vs_bf16": 0.60049, "stream/floor": 1.30004, "floor_ms": None, "ms": 2.0004},
        {"model": "b", "ratio": 1.2996, "vs_bf16": 0.5996, "stream/floor": 1.2, "floor_ms": 1.8376, "ms": 12345.678},
    ]}))
    out = render(f"{path}=model,ratio,vs_bf16,stream/floor,floor_ms,ms")
    assert "| a | 1.3004 | 0.6005 | 1.30004 | — | 2.000 |" in out
    assert "| b | 1.2996 | 0.5996 | 1.2000 | 1.838 | 12,345.7 |" in out
    assert "1.300 " not in out and "| 0.000 |" not in out


def test_columns_whose_names_hold_commas_are_separated_by_bars(tmp_path):
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"environment": {"commit": "c"}, "rows": [{"model": "m", "32,after": 13.25,
                                                                          "32,before": 13.0}]}))
    out = render(f"{path}=model|32,after|32,before")
    assert "| model | 32,after | 32,before |" in out and "| m | 13.250 | 13.000 |" in out
