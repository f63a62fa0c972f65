"""benchmarks.results_md --current (benchmarks/current.py): the newest row per (benchmark, model, card, case), each with
its card, commit and date; rows measured before the last change to their benchmark's code are stale, rows from a
dirty tree or an unknown commit are not current either. Checked on a small git history of its own."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.current import benchmark_of, current_page

ROOT = Path(__file__).resolve().parents[2]


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def _commit(root: Path, files: dict[str, str], message: str) -> str:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", message)
    return _git(root, "rev-parse", "--short", "HEAD")


def _result(folder: Path, name: str, env: dict, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({"environment": env, "rows": rows}))


@pytest.fixture
def history(tmp_path: Path) -> tuple[Path, Path, str, str]:
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    first = _commit(root, {"graphserve/kernels/attn.py": "a = 1\n", "graphserve/bench/client.py": "c = 1\n"}, "one")
    second = _commit(root, {"graphserve/kernels/attn.py": "a = 2\n"}, "two")
    return root, tmp_path / "results", first, second


def _line(page: str, *parts: str) -> str:
    hits = [line for line in page.splitlines() if line.startswith("|") and all(p in line for p in parts)]
    assert len(hits) == 1, (parts, hits)
    return hits[0]


def test_newest_row_per_case_and_its_status(history):
    root, results, first, second = history
    h200 = {"device": "NVIDIA H200", "date": "2026-12-01"}
    _result(results, "kernels", {**h200, "commit": first},
            [{"kernel": "decode", "shape": "llama", "us": 11.5}, {"kernel": "norm", "shape": "llama", "us": 3.25}])
    # the same day, a later commit: its decode row replaces the first file's; the norm row stays the first file's
    _result(results, "kernels_rerun", {**h200, "commit": second}, [{"kernel": "decode", "shape": "llama", "us": 9.75}])
    _result(results, "kernels_h100", {"device": "NVIDIA H100", "date": "2026-11-30", "commit": first},
            [{"kernel": "decode", "shape": "llama", "us": 14.5}])  # another card: its own row
    _result(results, "client_capacity", {"device": "cpu", "date": "2026-11-29", "commit": first},
            [{"concurrency": 64, "req_per_s": 2148.25}])
    _result(results, "decode", {"device": "NVIDIA H200", "date": "2026-12-02", "commit": f"{second}-dirty"},
            [{"model": "dummy:llama3-8b", "bs": 1, "ctx": 512, "step_ms": 4.5, "ratio": 1.25}])
    _result(results, "overhead", {"device": "NVIDIA H200", "date": "2026-12-02", "commit": "deadbee"},
            [{"model": "dummy:llama3-8b", "bs": 1, "step_ms": 5.5}])
    page = current_page(results, root)

    assert "11.500" not in page  # the older decode row of the same card and case is not shown
    assert _line(page, "NVIDIA H200", "kernel=decode", "us 9.750").endswith(
        f"| {second} | 2026-12-01 | `results/kernels_rerun.json` | current |")
    assert _line(page, "kernel=norm").endswith(f"| {first} | 2026-12-01 | `results/kernels.json` | "
                                               f"stale: code changed at {second} |")
    assert _line(page, "NVIDIA H100", "kernel=decode").endswith(f"stale: code changed at {second} |")
    # graphserve/bench did not change after the first commit: its row is current
    assert _line(page, "concurrency=64", "req_per_s 2,148.2").endswith(f"| {first} | 2026-11-29 | "
                                                                       "`results/client_capacity.json` | current |")
    assert _line(page, "bs=1 ctx=512").endswith(f"dirty ({second}-dirty): not a commit's code |")
    assert _line(page, "deadbee").endswith("unknown commit deadbee |")
    assert "2 of 6 rows are current" in page
    assert f"`python3 -m benchmarks.kernels` · 1 of 3 rows current · its code (graphserve/kernels, graphserve/layers) " \
           f"last changed at {second}" in page


def test_merged_rows_carry_their_own_run(history):
    root, results, first, second = history
    file_env = {"device": "NVIDIA H200", "date": "2026-12-02", "commit": second}
    _result(results, "kernels", file_env, [
        {"measured_at": {"device": "NVIDIA H200", "date": "2026-12-01", "commit": first}, "kernel": "old", "us": 1.5},
        {"measured_at": file_env, "kernel": "new", "us": 2.5}])
    page = current_page(results, root)
    assert _line(page, "kernel=old").endswith(f"| {first} | 2026-12-01 | `results/kernels.json` | "
                                              f"stale: code changed at {second} |")
    assert _line(page, "kernel=new").endswith(f"| {second} | 2026-12-02 | `results/kernels.json` | current |")


def test_a_file_that_names_its_model_and_case_at_the_top_lends_them_to_its_rows(history):
    """step_breakdown writes one model, quantization, batch and context a file and a row a kernel family: each file's
    rows are their own cases, not one case that the newest file would hide."""
    root, results, first, second = history
    env = {"device": "NVIDIA H100", "date": "2026-12-06", "commit": second}
    for model, bs, ms in (("dummy:gpt-oss-120b", 1, 1.93), ("dummy:llama3-8b", 64, 3.25)):
        results.mkdir(parents=True, exist_ok=True)
        (results / f"step_breakdown_{model[6:]}_bs{bs}.json").write_text(json.dumps(
            {"environment": env, "model": model, "quantization": "none", "bs": bs, "ctx": 512,
             "rows": [{"family": "matmul", "ms": ms}]}))  # fmt: skip
    page = current_page(results, root)
    assert _line(page, "| dummy:gpt-oss-120b |", "quantization=none bs=1 ctx=512 family=matmul", "ms 1.930")
    assert _line(page, "| dummy:llama3-8b |", "quantization=none bs=64 ctx=512 family=matmul", "ms 3.250")


def test_a_sweep_file_is_summarised_one_line_a_run(history, monkeypatch):
    from benchmarks import current

    root, results, first, second = history
    _result(results, "decode_splits", {"device": "NVIDIA H200", "date": "2026-12-01", "commit": first},
            [{"shape": "llama", "splits": s, "us": 10.0 + s} for s in range(1, 6)])
    _result(results, "kernels", {"device": "NVIDIA H200", "date": "2026-12-01", "commit": second},
            [{"kernel": "norm", "us": 3.5}])
    monkeypatch.setattr(current, "MAX_ROWS", 3)
    page = current_page(results, root)
    assert "splits=1" not in page and "| `results/decode_splits.json` | NVIDIA H200 | 5 | " in page
    assert _line(page, "decode_splits.json").endswith(f"| 5 | {first} | 2026-12-01 | stale: code changed at {second} |")
    assert _line(page, "kernel=norm").endswith("current |")  # a small file beside it is shown row by row


def test_result_files_map_to_the_benchmark_that_wrote_them():
    assert benchmark_of("decode_splits_fp8") == "decode_splits"
    assert benchmark_of("decode_bs1") == "decode"
    assert benchmark_of("fp8_decode_e89ce30_second") == "fp8"
    assert benchmark_of("http_idle_ttft") == "http_overhead"
    assert benchmark_of("something_new") == "other"
    stems = [p.stem for p in (ROOT / "benchmarks" / "results").glob("*.json")]
    assert stems and not [s for s in stems if benchmark_of(s) == "other"]


def test_results_md_is_the_current_page():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert text.startswith("# Benchmark results: where things stand\n")
    assert "python3 -m benchmarks.results_md --current" in text
    journal = (ROOT / "benchmarks" / "JOURNAL.md").read_text()
    assert journal.count("\n## 20") >= 27  # the dated sittings moved whole


def test_headlines_are_refused_where_the_page_lacks_a_case():
    from benchmarks.current import HEADLINES, TABLE_HEAD, headlines

    rows = {h: f"| NVIDIA H200 | {h[1]} | {h[2]} | step_ms 1.250 | abc1234 | 2026-12-01 | `results/x.json` | current |"
            for h in HEADLINES}
    page = "\n\n".join(f"## {h[0]}\n\n{TABLE_HEAD}\n{row}" for h, row in rows.items())
    assert headlines(page).splitlines()[2:] == [rows[h] for h in HEADLINES]
    with pytest.raises(KeyError, match="the current page has no row for"):
        headlines(page.replace(f"| {HEADLINES[0][2]} |", "| bs=3 |"))
