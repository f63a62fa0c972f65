"""benchmarks/serve_reference: its options, its verdict (the published figure never a measured row; server over offline
only on the same requests, card and commit), and its two invocations on a tiny model through a real `graphserve serve`
on loopback, the second's verdict reading the first's row from the merged file."""

from __future__ import annotations

import json

import pytest

from benchmarks import common
from benchmarks.serve_reference import SGLANG_GPT_OSS_20B, engine_args, main, parse_args, verdict

WORKLOAD = "256 x 1024 in / 1024 out"


def test_defaults_are_the_published_workload_and_bad_values_are_refused():
    args = parse_args([])
    assert (args.side, args.model, args.num_prompts, args.input_len, args.output_len, args.concurrency) == \
        ("server", "dummy:gpt-oss-20b", 256, 1024, 1024, 32)
    assert engine_args(args) == "--max-running-requests 32 --max-model-len 2048"
    args = parse_args(["--side", "offline", "--engine-args", "--max-model-len 4096", "--input-len", "8"])
    assert args.side == "offline" and engine_args(args) == "--max-model-len 4096 --max-running-requests 32"
    assert engine_args(parse_args(["--input-len", "8", "--output-len", "4"])).endswith("--max-model-len 512")
    for bad in (["--concurrency", "0"], ["--num-prompts", "-1"], ["--side", "hf"],
                ["--engine-args", "--max-running-requests 8"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def _row(mode: str, tok_s: float, commit: str = "abc1234", card: str = "H100", digest: str = "d1",
         started: str = "2026-12-06T10:00:00") -> dict:
    return {"model": "dummy:gpt-oss-20b", "mode": mode, "concurrency": 32, "workload": WORKLOAD, "num_prompts": 256,
            "input_len": 1024, "output_len": 1024, "card": card, "prompts_digest": digest, "output_tok_s": tok_s,
            "measured_at": {"commit": commit, "run_id": f"{mode}-{started}", "started": started}}


def test_the_verdict_compares_only_what_it_may():
    cmd = "python3 -m benchmarks.serve_reference"
    line, entry = verdict([_row("server", 2212.0), _row("offline", 2400.0)], "dummy:gpt-oss-20b", 32, WORKLOAD, cmd)
    assert line.startswith("verdict: dummy:gpt-oss-20b at C=32")
    assert entry["vs_reference"] == pytest.approx(2212.0 / 2765.0) and entry["reference_tok_s"] == 2765.0
    assert "0.80 x SGLang's published gpt-oss-20b serving figure" in line and "NOT measured here" in line
    assert entry["vs_offline"] == pytest.approx(2212.0 / 2400.0) and entry["meets_target"] is True
    # an offline row of another commit is no baseline of this server row: named, not divided by
    line, entry = verdict([_row("server", 2212.0), _row("offline", 2400.0, commit="fff0000")], "dummy:gpt-oss-20b",
                          32, WORKLOAD, cmd)
    assert entry["vs_offline"] is None and entry["meets_target"] is None and f"rerun {cmd} --side offline" in line
    _, entry = verdict([_row("server", 2000.0), _row("offline", 2400.0, digest="d2")], "dummy:gpt-oss-20b", 32,
                       WORKLOAD, cmd)
    assert entry["vs_offline"] is None
    # the newest server row speaks; a server at 0.85 of offline misses the target
    line, entry = verdict([_row("server", 2212.0), _row("server", 2040.0, started="2026-12-06T11:00:00"),
                           _row("offline", 2400.0)], "dummy:gpt-oss-20b", 32, WORKLOAD, cmd)
    assert entry["server_tok_s"] == 2040.0 and entry["meets_target"] is False and "MISSED" in line
    line, entry = verdict([_row("offline", 2400.0)], "dummy:gpt-oss-20b", 32, WORKLOAD, cmd)
    assert "no server row yet" in line and entry["server_tok_s"] is None
    line, _ = verdict([_row("server", 2212.0)], "dummy:gpt-oss-20b", 32, WORKLOAD, cmd)
    assert "no offline row yet" in line
    # another workload is no published figure's
    other = {**_row("server", 900.0), "num_prompts": 64, "workload": "64 x 1024 in / 1024 out"}
    line, entry = verdict([other], "dummy:gpt-oss-20b", 32, other["workload"], cmd)
    assert entry["vs_reference"] is None and "no published figure" in line


def test_two_invocations_through_a_real_server_merge_into_one_file(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    earlier = {**_row("server", 2212.0), "measured_at": {"commit": "abc1234", "run_id": "old"}}
    (tmp_path / "serve_reference.json").write_text(json.dumps({"rows": [earlier]}))
    tiny = ["--model", "builtin:tiny-llama", "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
            "--concurrency", "2"]
    assert main(["--side", "offline", *tiny]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("verdict: builtin:tiny-llama at C=2 (4 x 8 in / 4 out): offline ")
    assert "no server row yet" in first
    assert main(tiny) == 0  # the server side, the default
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("verdict: builtin:tiny-llama at C=2") and "server/offline" in out[0]
    assert "no published figure" in out[0]
    data = json.loads((tmp_path / "serve_reference.json").read_text())
    assert data["reference"]["gpt-oss-20b"] == {**SGLANG_GPT_OSS_20B, "measured_here": False}
    assert data["rows"][0]["measured_at"]["run_id"] == "old"  # another model's row stays
    mine = {r["mode"]: r for r in data["rows"] if r["model"] == "builtin:tiny-llama"}
    assert set(mine) == {"offline", "server"} and len(data["rows"]) == 3
    srv, off = mine["server"], mine["offline"]
    assert srv["prompts_digest"] == off["prompts_digest"] and srv["tokens"] == off["tokens"] == 16
    assert srv["ttft_ms"]["n"] == 4 and srv["ttft_ms"]["p99"] >= srv["ttft_ms"]["median"] > 0
    # a gap a request at a time between its events: at most 3 each (an event may carry two tokens)
    assert 1 <= srv["itl_ms"]["n"] <= 4 * 3 and srv["steps"]["steps"] > 0 and off["steps"]["decode_steps"] > 0
    assert srv["engine_args"] == "--max-running-requests 2 --max-model-len 512"
    (entry,) = data["verdict"]
    assert entry["vs_offline"] == pytest.approx(srv["output_tok_s"] / off["output_tok_s"])
    assert entry["vs_reference"] is None
    # report reads the file and writes nothing
    before = (tmp_path / "serve_reference.json").read_text()
    assert main(["--side", "report", *tiny]) == 0
    assert capsys.readouterr().out.startswith("verdict: builtin:tiny-llama") and \
        (tmp_path / "serve_reference.json").read_text() == before
