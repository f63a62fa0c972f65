"""`graphserve sweep` against the simulated server: the fit recovers the simulated step time, a
deliberate regime break is flagged, and a configuration grid survives a server that dies."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from fake_server import FakeServer  # noqa: E402

from graphserve.bench import levels, sweep  # noqa: E402
from graphserve.bench.server_grid import parse_grid, render_command  # noqa: E402
from graphserve.errors import BadRequestError  # noqa: E402

FAKE = Path(__file__).resolve().parents[1] / "support" / "fake_server.py"
LEVELS = ["--concurrency", "1,2,4,8", "--num-prompts-per-level", "5", "--random-input-len", "8",
          "--random-output-len", "8", "--disable-tqdm"]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sweep.add_arguments(p)
    return p.parse_args(list(argv))


def test_sweep_recovers_a_and_b(tmp_path, capsys):
    with FakeServer("--a-ms", "20", "--b-ms", "2") as url:
        rc = sweep.run(_args("--base-url", url, "--output-dir", str(tmp_path), "--random-range-ratio", "1", *LEVELS))
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert [p["concurrency"] for p in res["points"]] == [1, 2, 4, 8]
    for p in res["points"]:
        assert p["num_requests"] == max(5, 5 * p["concurrency"]) and p["failed"] == 0
        assert p["achieved_concurrency"] == pytest.approx(p["concurrency"], rel=0.05)
    fit = res["fit"]
    assert fit["a_ms"] == pytest.approx(20.0, rel=0.10)
    assert fit["b_ms"] == pytest.approx(2.0, rel=0.10)
    tel = res["telemetry_fit"]  # the server's own step records, same model
    assert tel["a_ms"] == pytest.approx(20.0, rel=0.10) and tel["b_ms"] == pytest.approx(2.0, rel=0.10)
    assert tel["breaks"] == []
    assert (tmp_path / "report.md").is_file() and (tmp_path / "levels" / "c8.json").is_file()
    assert "step_time = " in capsys.readouterr().out


def test_sweep_flags_a_break(tmp_path):
    # Steps jump by 15 ms above 4 requests; varied output lengths make the drains visit N = 5..7.
    with FakeServer("--a-ms", "20", "--b-ms", "2", "--break-at", "4", "--break-ms", "15") as url:
        args = _args("--base-url", url, "--random-range-ratio", "0.5", *LEVELS)
        out = levels.sweep_levels(args, url, [1, 2, 4, 8], str(tmp_path))
    breaks = out["telemetry_fit"]["breaks"]
    assert len(breaks) == 1
    assert 4 <= breaks[0]["at_n"] <= 5 and breaks[0]["jump_ms"] == pytest.approx(15.0, abs=4.0)
    assert out["fit"]["b_ms"] > 3.0  # the sweep's own line is bent upwards by the jump


def test_grid_survives_a_dying_server(tmp_path):
    cmd = (f"{sys.executable} {FAKE} --port {{port}} --a-ms 5 --b-ms 1 --cuda-graph-max-bs 4 "
           f"--die-above {{die_above}}")
    rc = sweep.run(_args("--server-cmd", cmd, "--server-grid", "die_above=4,0", "--server-timeout", "30",
                         "--output-dir", str(tmp_path), "--random-range-ratio", "1", *LEVELS))
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    dead, alive = res["configurations"]
    assert dead["params"] == {"die_above": "4"} and dead["status"] == "died" and dead["failed_at"] == 8
    assert [p["concurrency"] for p in dead["points"]] == [1, 2, 4, 8]
    assert any("out of memory" in line for line in dead["log_tail"])
    assert any(f["kind"] == "oom" for f in dead["diagnosis"])
    assert dead["exit_code"] == 1
    assert alive["status"] == "ok" and alive["failed_at"] is None and alive["fit"]["b_ms"] > 0
    # the simulated server's ceiling: one token per request per step of 5 + 1·N ms -> 1000 / 1 tok/s (loose:
    # with 1 ms per request, a loaded test machine's scheduling jitter moves the fitted slope by ~15%)
    assert alive["asymptote_tok_s"] == pytest.approx(1000.0, rel=0.3)
    assert res["points"] == dead["points"]  # the top level shows the first configuration with points
    # the levels both configurations measured are compared; each configuration has its own section
    assert [r["concurrency"] for r in res["comparison"]] == [1, 2, 4]  # every request at C=8 failed on one side
    assert all(r["baseline"] == "die_above=4" and r["candidate"] == "die_above=0" for r in res["comparison"])
    html = (tmp_path / "report.html").read_text()
    assert "<h2>die_above=4</h2>" in html and "<h2>die_above=0</h2>" in html and 'class="verdict"' in html
    assert html.index('class="verdict"') < html.index("<table") < html.index("<details")
    assert "out of memory" in html.lower() and "--a-ms 5" in html  # the doctor's finding, the command run


def test_grid_parsing_and_placeholders():
    assert parse_grid(["a=1,2", "b=x"]) == [{"a": "1", "b": "x"}, {"a": "2", "b": "x"}]
    assert parse_grid([]) == [{}]
    assert render_command("srv --port {port} --bs {a}", {"a": "8"}, "127.0.0.1", 99) == ["srv", "--port", "99", "--bs", "8"]
    with pytest.raises(BadRequestError, match="server_grid"):
        parse_grid(["nokey"])
    with pytest.raises(BadRequestError, match="placeholder"):
        render_command("srv {missing}", {}, "127.0.0.1", 1)
    assert sweep.parse_levels("8,1,2") == [1, 2, 8]
    assert levels.prompts_for_level(8, 16) == 40 and levels.prompts_for_level(2, 16) == 16


def test_grid_on_the_real_cpu_server_with_profiles(tmp_path):
    """`sweep --server-cmd --server-grid --profile` end to end on builtin:tiny-llama: two real servers, one
    with the profile endpoint (a profile per level) and one without (each level says how to get one)."""
    cmd = (f"{sys.executable} -m graphserve.cli serve builtin:tiny-llama --port {{port}} --max-model-len 512 "
           f"--num-kv-tokens 8192 --log-interval 4 {{endpoint}}")
    rc = sweep.run(_args("--server-cmd", cmd, "--server-grid", "endpoint=--enable-profile-endpoint,--log-level=info",
                         "--server-timeout", "180", "--output-dir", str(tmp_path), "--concurrency", "1,2",
                         "--num-prompts-per-level", "1", "--random-input-len", "8", "--random-output-len", "6",
                         "--random-range-ratio", "1", "--disable-tqdm", "--profile", "--profile-steps", "2"))
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    with_ep, without = res["configurations"]
    assert with_ep["status"] == without["status"] == "ok"
    assert "--enable-profile-endpoint" in with_ep["command"] and "--enable-profile-endpoint" not in without["command"]
    assert "num_kv_tokens" not in res["config"] and res["config"]["server_cmd"] == cmd  # no in-process engine flags
    for p in with_ep["points"]:
        (phase,) = p["profile"]["phases"]
        assert phase["batch_size"] == p["concurrency"]
        # the categories add up to the traced span by construction; the span lies inside the step the engine
        # timed, whose wall clock also holds what the OS took on a loaded machine, so it is a bound, not an equal
        assert sum(phase["categories_ms"].values()) == pytest.approx(phase["span_ms"], rel=1e-6)
        assert 0 < phase["span_ms"] <= 1.10 * phase["step_ms"]
        assert (tmp_path / p["profile"]["png"]).is_file()
    for p in without["points"]:
        assert "--enable-profile-endpoint" in p["profile"]["error"]
    assert [r["concurrency"] for r in res["comparison"]] == [1, 2]
    html = (tmp_path / "report.html").read_text()
    assert 'class="verdict"' in html and "Decode-step profile at C=2" in html
    assert html.count("<h2>endpoint=") == 2 and "builtin:tiny-llama" in html


def test_host_share_is_the_median_launch_share_per_step_kind():
    records = [{"kind": "decode", "step_ms": 10.0, "launch_ms": 1.0}, {"kind": "decode", "step_ms": 10.0, "launch_ms": 3.0},
               {"kind": "decode", "step_ms": 10.0, "launch_ms": 2.0}, {"kind": "prefill", "step_ms": 15.0, "launch_ms": 14.7},
               {"kind": "decode", "step_ms": 0.0, "launch_ms": 1.0},  # no time: no share
               {"kind": "mixed", "step_ms": 9.0}]  # a server older than launch_ms
    shares = levels.host_share(records)
    assert shares == {"decode": pytest.approx(0.2), "prefill": pytest.approx(0.98), "mixed": None}
    from graphserve.analysis.report import host_share_text

    assert host_share_text(shares) == ("host share of a step (launch_ms / step_ms, median): decode 20%, prefill 98% "
                                       "(on a GPU, near 100% means the device waited on the host's launches; on a CPU the forward "
                                       "runs inside the launch)")
    assert host_share_text({"decode": None}) is None and host_share_text(None) is None
