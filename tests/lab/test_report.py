from __future__ import annotations

import json
import types
from html.parser import HTMLParser

import numpy as np

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
    assert "ceiling 1000/b = 33.3 tok/s" in md and "| C |" in md
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


class _Page(HTMLParser):
    """The tables (rows of cell texts), headings, verdict paragraphs and <details> of an HTML page."""

    def __init__(self):
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.headings: list[str] = []
        self.verdicts: list[str] = []
        self.details_text = ""
        self.imgs = 0
        self._stack: list[tuple[str, dict]] = []
        self._cell: list[str] | None = None
        self._text: list[str] | None = None
        self._details = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self._stack.append((tag, a))
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag in ("h1", "h2", "h3") or (tag == "p" and a.get("class") == "verdict"):
            self._text = []
        elif tag == "details":
            self._details += 1
        elif tag == "img":
            self.imgs += 1

    def handle_endtag(self, tag):
        while self._stack:
            t, a = self._stack.pop()
            if t == tag:
                break
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag in ("h1", "h2", "h3") and self._text is not None:
            self.headings.append("".join(self._text).strip())
            self._text = None
        elif tag == "p" and self._text is not None:
            self.verdicts.append("".join(self._text).strip())
            self._text = None
        elif tag == "details":
            self._details -= 1

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._text is not None:
            self._text.append(data)
        if self._details:
            self.details_text += data


def _page(path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


def test_html_is_a_page_with_real_tables_and_the_fit_first(tmp_path):
    paths = write_report(_sweep(), tmp_path / "out")
    page = _page(paths["report.html"])
    assert "|" not in "".join(page.headings) and "```" not in paths["report.html"].read_text()
    results = next(t for t in page.tables if t[0][:3] == ["C", "achieved", "out tok/s"])
    assert [r[0] for r in results[1:]] == ["1", "2", "4", "8", "16", "32"]
    assert abs(float(results[1][2]) - 1000 / 84) < 0.1
    html = paths["report.html"].read_text()
    # the answer (fit and ceiling) comes before the tables, the configuration last and folded away
    assert html.index("ceiling 1000/b = 33.3 tok/s") < html.index("<table")
    assert html.rindex("<details") > html.index("<table") and "dummy:llama3-8b" in page.details_text


def test_unreliable_fit_is_named_and_gets_no_ceiling(tmp_path):
    sweep = _sweep()
    rng = np.random.default_rng(0)
    for p in sweep["points"]:  # step times that do not follow N at all
        p["summary"]["tpot_ms"]["median"] = float(rng.uniform(50, 150))
    sweep["fit"] = fit_from_sweep(sweep["points"]).to_dict()
    assert sweep["fit"]["r2"] < 0.5
    paths = write_report(sweep, tmp_path / "out")
    md = paths["report.md"].read_text()
    assert "unreliable, no ceiling quoted: R² = " in md and "ceiling 1000/b" not in md
    assert "ceiling 1000/b" not in paths["report.html"].read_text()


def _level(tmp_path, name: str, tok_per_req: int, duration: float, seed: int) -> str:
    """A bench result of 64 requests whose output rate is tok_per_req·64/duration tok/s."""
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(64):
        out = int(tok_per_req + rng.integers(-3, 4))
        tpot = float(rng.normal(20.0, 1.0))
        reqs.append({"ok": True, "start": 0.0, "end": duration, "output_tokens": out, "ttft_ms": 50.0 + rng.normal(0, 2),
                     "tpot_ms": tpot, "itl_ms": [tpot] * 4, "e2e_ms": duration * 1000})
    path = tmp_path / "levels" / f"{name}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"summary": {"duration_s": duration}, "requests": reqs}))
    return str(path.relative_to(tmp_path))


def test_grid_report_has_a_section_per_configuration_and_verdicts(tmp_path):
    from graphserve.analysis.grid_compare import compare_configurations

    configs = []
    for i, (bs, speed) in enumerate((("32", 1.0), ("64", 1.4))):
        points = []
        for c in (1, 64):
            # at C=1 both run the same; at C=64 the second makes 1.4x the tokens in the same time
            factor = speed if c == 64 else 1.0
            p = {"concurrency": c, "achieved_concurrency": float(c), "summary": _summary(c),
                 "result_file": _level(tmp_path, f"cfg{i}-c{c}", int(100 * factor), 10.0, seed=10 * i + c)}
            points.append(p)
        configs.append({"params": {"cuda_graph_max_bs": bs, "port_hint": "x"}, "status": "ok",
                        "command": f"graphserve serve M --cuda-graph-max-bs {bs}", "points": points, "fit": None,
                        "diagnosis": [{"kind": "eager_oversize", "severity": "warning", "title": "batches ran eager",
                                       "explanation": "because", "flags": ["--cuda-graph-max-bs"]}] if i == 0 else []})
    comparison = compare_configurations(configs, str(tmp_path))
    assert [r["concurrency"] for r in comparison] == [1, 64]
    c1, c64 = comparison
    assert c1["sentence"] == "cuda_graph_max_bs=64 vs 32: no difference in output tok/s at C=1"
    thr = c64["metrics"]["output_throughput"]
    assert 1.3 < thr["ratio_ci"][0] < 1.4 < thr["ratio_ci"][1] < 1.5
    assert c64["sentence"].startswith("cuda_graph_max_bs=64 is 1.4") and "the output tok/s of 32 at C=64" in c64["sentence"]
    sweep = {"config": {"server_cmd": "graphserve serve M --cuda-graph-max-bs {bs}", "levels": [1, 64]},
             "configurations": configs, "points": configs[0]["points"], "comparison": comparison}
    paths = write_report(sweep, tmp_path / "out")
    page = _page(paths["report.html"])
    assert page.verdicts and page.verdicts[0].startswith("cuda_graph_max_bs=64 is 1.4")
    assert page.verdicts[0].endswith("no difference at C=1.")
    assert "cuda_graph_max_bs=32" in page.headings and "cuda_graph_max_bs=64" in page.headings
    comp = next(t for t in page.tables if t[0][0] == "C" and "verdict" in t[0])
    assert [r[0] for r in comp[1:]] == ["1", "64"] and [r[2] for r in comp[1:]] == ["same", "faster"]
    assert sum(1 for t in page.tables if t[0][:2] == ["C", "achieved"]) == 2  # one results table each
    assert "batches ran eager" in paths["report.html"].read_text()
    assert "graphserve serve M --cuda-graph-max-bs 64" in page.details_text
    assert page.imgs == 6  # the two overlays, then each configuration's two plots
    assert {"cfg0-scaling.png", "cfg1-latency.png"} <= set(paths)


def test_verdict_kinds():
    from graphserve.analysis.grid_compare import headline, verdict

    kind, text = verdict("bs=64", "bs=32", 64, {"ratio": 0.8, "ratio_ci": [0.75, 0.85]})
    assert kind == "slower" and text == "bs=64 is 0.80× [0.75, 0.85] the output tok/s of 32 at C=64"
    # inside the interval of 1, or within 1% of it: no difference
    assert verdict("bs=64", "bs=32", 1, {"ratio": 1.05, "ratio_ci": [0.97, 1.12]})[0] == "same"
    assert verdict("bs=64", "bs=32", 1, {"ratio": 1.005, "ratio_ci": [1.003, 1.007]})[0] == "same"
    # equal output lengths collapse the throughput interval to a point: no verdict is drawn from it
    kind, text = verdict("bs=64", "bs=32", 8, {"ratio": 1.3, "ratio_ci": [1.3, 1.3]})
    assert kind == "no interval" and "measured 1.30×" in text and "--random-range-ratio" in text
    rows = [{"candidate": "bs=64", "concurrency": c, "verdict": k, "sentence": s}
            for c, (k, s) in ((1, ("same", "x")), (8, (kind, text)), (64, ("faster", "bs=64 is 1.39× [1.33, 1.45] ...")),
                              (2, ("same", "y")))]
    assert headline(rows) == [f"bs=64 is 1.39× [1.33, 1.45] ...; no difference at C=1, C=2; {text}"]
    # the same throughput with a median TPOT whose interval leaves 1 out: the headline says so; inside it, not
    rows[0]["metrics"] = {"tpot_p50": {"ratio": 0.93, "ratio_ci": [0.92, 0.95]}}
    rows[3]["metrics"] = {"tpot_p50": {"ratio": 0.97, "ratio_ci": [0.90, 1.04]}}
    assert headline(rows)[0].endswith(f"{text}; median TPOT 0.93× [0.92, 0.95] at C=1")
