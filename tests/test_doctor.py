from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from graphserve.analysis import doctor
from graphserve.analysis.doctor import diagnose
from graphserve.errors import BadRequestError

LOGS = Path(__file__).parent / "data" / "logs"


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


def test_graphserve_log_kv_full_queue_and_plateau():
    f = _findings("graphserve_problems.log")
    assert set(f) == {"kv_full", "queue_growing", "throughput_plateau"}
    assert "54 + 30.0·N" in f["throughput_plateau"]["title"]
    assert any("token usage: 0.98" in t for _, t in f["kv_full"]["evidence"])
    assert "0 → 51" in f["queue_growing"]["title"]


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
