from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from graphserve.analysis import doctor
from graphserve.analysis.doctor import diagnose
from graphserve.engine.startup import OversizeCalibration
from graphserve.errors import BadRequestError
from graphserve.server.steplog import format_decode_line

LOGS = Path(__file__).resolve().parents[1] / "data" / "logs"
# graphserve_*.log are real server runs on CPU: tests/data/logs/make_graphserve_logs.py regenerates them


def _findings(name: str) -> dict[str, dict]:
    rep = diagnose(str(LOGS / name))
    lines = (LOGS / name).read_text().splitlines()
    for f in rep["findings"]:
        assert f["evidence"], f
        for n, text in f["evidence"]:  # evidence quotes the log exactly, with 1-based line numbers
            assert lines[n - 1].rstrip() == text
    return {f["kind"]: f for f in rep["findings"]}


@pytest.mark.parametrize("name,fmt", [("graphserve_clean.log", "graphserve"), ("sglang_clean.log", "sglang"),
                                      ("vllm_clean.log", "vllm")])
def test_clean_logs_give_no_findings(name, fmt):
    rep = diagnose(str(LOGS / name))
    assert rep["format"] == fmt
    assert rep["findings"] == []


def test_sglang_story_log_eager_batches_oom_and_plateau():
    f = _findings("sglang_story.log")
    assert set(f) == {"eager_oversize", "oom", "throughput_plateau"}
    eager = f["eager_oversize"]
    assert "largest captured size 32" in eager["title"]
    assert any("Capture cuda graph bs [1, 2, 4, 8, 12, 16, 24, 32]" in t for _, t in eager["evidence"])
    assert any("#running-req: 64" in t and "cuda graph: False" in t for _, t in eager["evidence"])
    assert "--cuda-graph-max-bs 64" in eager["flags"]
    oom = f["oom"]
    assert oom["severity"] == "error"
    assert "asked 3.94 GiB with 2.80 GiB free" in oom["title"]
    assert "ran eagerly" in oom["explanation"]
    assert oom["evidence"][0][1].startswith("torch.OutOfMemoryError")
    plateau = f["throughput_plateau"]
    assert plateau["title"].endswith("step ≈ 47 + 30.7·N ms")  # b ≈ 30 ms per running request
    assert "cannot pass 32.6 tok/s" in plateau["explanation"]  # ceiling 1000/30.7 tok/s


def test_graphserve_log_kv_full_and_growing_queue():
    """A real overloaded run: 4 prompts fill the 512-token pool while arrivals outpace the server."""
    f = _findings("graphserve_problems.log")
    assert set(f) == {"kv_full", "queue_growing"}
    assert all("token usage: " in t and float(t.split("token usage: ")[1][:4]) >= 0.95 for _, t in f["kv_full"]["evidence"])
    assert f["queue_growing"]["title"] == "waiting queue grows: 0 → 279 requests"


def _graphserve_log_with(tmp_path, extra: list[str]) -> Path:
    """The real clean log with lines graphserve's own formatters print appended (GPU-only lines)."""
    lines = (LOGS / "graphserve_clean.log").read_text().splitlines()
    path = tmp_path / "graphserve_gpu.log"
    path.write_text("\n".join(lines + [f"[2026-11-30 12:00:00,000] {x}" for x in extra]) + "\n")
    return path


def test_measured_full_graph_speedup_recommends_raising_the_captured_size(tmp_path):
    cal = OversizeCalibration(rows=64, split_ms=11.86, eager_ms=13.25, full_graph_ms=8.47, mode="split-graph")
    steps = [format_decode_line(64, 70000, 0.3, True, 5300.0, 0), format_decode_line(48, 50000, 0.2, True, 4100.0, 0)]
    path = _graphserve_log_with(tmp_path, [cal.log_line(32), *steps])
    rep = diagnose(str(path))
    assert rep["format"] == "graphserve"
    (f,) = rep["findings"]
    assert f["kind"] == "oversize_full_graph" and f["flags"] == ["--cuda-graph-max-bs 64"]
    assert "1.40× slower than a graph captured at 64" in f["title"]  # 11.86 / 8.47, as start-up measured
    assert "11.86 ms as split-graph against 8.47 ms" in f["explanation"] and "2 step lines ran above 32" in f["explanation"]
    assert f["evidence"][0][1].endswith(cal.log_line(32))


def test_a_split_path_as_fast_as_a_full_graph_is_no_finding(tmp_path):
    near = OversizeCalibration(rows=64, split_ms=8.6, eager_ms=13.0, full_graph_ms=8.5, mode="split-graph")
    untimed = OversizeCalibration(rows=64, split_ms=11.0, eager_ms=13.0, full_graph_ms=None, mode="split-graph")
    rep = diagnose(str(_graphserve_log_with(tmp_path, [near.log_line(32), untimed.log_line(32)])))
    assert rep["format"] == "graphserve" and rep["findings"] == []


def test_vllm_preemption_storm_kv_full_and_queue():
    f = _findings("vllm_preempt.log")
    assert set(f) == {"preemption", "kv_full", "queue_growing"}
    assert f["preemption"]["severity"] == "error"  # 12 warnings + a Preemptions counter: a storm
    assert any("PreemptionMode.RECOMPUTE" in t for _, t in f["preemption"]["evidence"])
    assert any("GPU KV cache usage: 100.0%" in t for _, t in f["kv_full"]["evidence"])


def test_capture_failure_is_one_finding_with_its_flags():
    f = _findings("sglang_capture_failed.log")
    assert set(f) == {"capture_failed"}
    assert "1.50 GiB" in f["capture_failed"]["title"]
    assert any("--cuda-graph-max-bs" in x for x in f["capture_failed"]["flags"])


def test_cli_json_and_exit_code(capsys):
    rc = doctor.run(types.SimpleNamespace(logfile=str(LOGS / "sglang_story.log"), json=True))
    assert rc == 1  # an OOM is an error
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "sglang" and len(data["findings"]) == 3
    rc = doctor.run(types.SimpleNamespace(logfile=str(LOGS / "vllm_clean.log"), json=False))
    assert rc == 0 and "no problems found" in capsys.readouterr().out
    with pytest.raises(BadRequestError, match="LOGFILE"):
        diagnose(str(LOGS / "missing.log"))


def test_compiles_after_ready_are_one_finding_naming_the_kernels(tmp_path, caplog):
    from graphserve.engine.compile_watch import log_late_compile

    with caplog.at_level("WARNING", logger="graphserve.engine"):
        log_late_compile("_extend_kernel", "stride_bt: i32 divisibility=16 -> i32")
        log_late_compile("fused_moe_gemm_kernel", "BLOCK_N: constexpr=256 -> constexpr=128")
        log_late_compile("_extend_kernel", "stride_bt: constexpr=1 -> i32")
    log = tmp_path / "server.log"
    log.write_text("\n".join(["[2026-12-01 02:00:00,000] INFO engine ready: model=dummy:qwen3-0.6b device=cuda"]
                             + [f"[2026-12-01 02:00:01,000] WARNING {r.getMessage()}" for r in caplog.records]))
    rep = diagnose(str(log))
    (f,) = rep["findings"]
    assert f["kind"] == "late_compile" and f["severity"] == "warning" and f["flags"] == []
    assert f["title"] == "3 kernel compile(s) after ready (_extend_kernel, fused_moe_gemm_kernel)"
    assert [n for n, _ in f["evidence"]] == [2, 3, 4] and "stride_bt" in f["evidence"][0][1]
    assert "change:" not in doctor.format_report(rep)  # no flag to turn


def test_latent_pages_full_on_step_lines_is_its_own_finding():
    """DeepSeek-V4's step line carries its latent pages after SGLang's fields: the token usage is still read as the
    blocks', and nearly every page held names the pages, not the KV pool, as what ran short."""
    from graphserve.server.steplog import format_page_fields

    def line(used: int) -> str:
        return "[t] " + format_decode_line(4, 640, 0.31, True, 120.0, 2) + format_page_fields(used, 3, 40)

    lines = [line(20), line(39), line(40)]
    steps = doctor.parse_steps(lines)
    assert [s.usage for s in steps] == [0.31] * 3 and [s.queue for s in steps] == [2] * 3
    found = {f.kind: f for f in doctor.diagnose_lines(lines)}
    assert set(found) == {"latent_pages_short"} and "latent page usage ≥ 0.95" in found["latent_pages_short"].title
    assert [n for n, _ in found["latent_pages_short"].evidence] == [2, 3]
    assert not doctor.diagnose_lines([line(20), line(30)])
