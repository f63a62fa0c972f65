"""benchmarks/gpu_tests.py and gpu_shards.py: tests/gpu packed into shards that fit one command, each file's pytest
run read back into a record, and records of two cards merged into one table. No GPU: the runs are of a tiny test
folder written here, in a child pytest with plugin autoloading off so it starts in about a second."""

from __future__ import annotations

import json
import random
import sys

import pytest

from benchmarks import gpu_shards as gs
from benchmarks import gpu_tests, gpu_tests_report

FAKE = '''
import pytest

def test_ok():
    assert 1 + 1 == 2

def test_bad():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="not on this card")
def test_skip():
    pass

class TestGroup:
    @pytest.mark.parametrize("x", [1, 2])
    def test_p(self, x):
        assert x < 2
'''
SLOW = '''
import time

def test_quick():
    pass

def test_sleeps():
    time.sleep(600)
'''


def _est(seed: int, n: int = 23) -> dict[str, float]:
    rng = random.Random(seed)
    return {f"test_{i:02d}.py": float(rng.randint(5, 260)) for i in range(n)}


def test_packing_is_deterministic_complete_and_balanced():
    est = _est(1)
    shuffled = dict(random.Random(2).sample(list(est.items()), len(est)))
    shards = gs.pack(est, shards=5)
    assert shards == gs.pack(shuffled, shards=5)
    names = [f for sh in shards for f in sh.files]
    assert sorted(names) == sorted(est) and len(names) == len(set(names))
    loads = [sh.seconds for sh in shards]
    assert loads == [sum(est[f] for f in sh.files) for sh in shards]
    # largest first into the least loaded: no shard exceeds the mean by more than the largest file it could take last
    assert max(loads) - min(loads) <= max(est.values())
    assert max(loads) <= sum(loads) / len(loads) + max(est.values())


def test_budget_is_kept_with_as_few_shards_as_it_needs():
    est = _est(3)
    shards = gs.pack(est, budget_s=480)
    assert all(sh.seconds <= 480 for sh in shards) and not gs.packing_notes(shards, 480)
    assert len(shards) >= -(-sum(est.values()) // 480)
    fewer = gs.pack(est, shards=len(shards) - 1, budget_s=480)  # one shard fewer goes over somewhere
    assert max(sh.seconds for sh in fewer) > 480 and gs.packing_notes(fewer, 480)


def test_a_file_over_the_budget_is_alone_and_said_so():
    est = {"test_big.py": 700.0, "test_a.py": 200.0, "test_b.py": 150.0, "test_c.py": 120.0}
    for shards in (gs.pack(est, budget_s=480), gs.pack(est, shards=3, budget_s=480)):
        big = [sh for sh in shards if "test_big.py" in sh.files]
        assert len(big) == 1 and big[0].files == ("test_big.py",) and big[0].alone
        notes = gs.packing_notes(shards, 480)
        assert any("test_big.py" in n and "700 s" in n and "alone" in n for n in notes)
    with pytest.raises(ValueError, match=r"--shard I/2"):
        gs.pack(est, shards=1, budget_s=480)


def test_the_committed_durations_cover_every_gpu_file_and_pack_within_the_budget():
    files = gs.gpu_test_files()
    durations = gs.load_durations()
    assert set(files) <= set(durations["files"])
    assert {e["source"] for e in durations["files"].values()} <= {"measured", "estimate"}
    assert durations["files"]["test_fp8.py"]["seconds"] == 240 and durations["files"]["test_fp8.py"]["source"] == "measured"
    multi = {f for f in files if gs.group_of(gs.TESTS_DIR / f) == "multi"}
    assert {"test_tp_gpu.py", "test_dp_gpu.py", "test_nodes_gpu.py", "test_allreduce_paths_gpu.py"} <= multi
    assert "test_fp8.py" not in multi
    single = [f for f in files if f not in multi]
    shards = gs.pack(gs.estimates(single, durations), budget_s=gs.BUDGET_S)
    assert all(sh.seconds <= gs.BUDGET_S for sh in shards) and sorted(f for s in shards for f in s.files) == single


def test_a_file_with_no_entry_is_estimated_from_its_tests(tmp_path):
    (tmp_path / "test_new.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    entry = gs.estimate_entry(tmp_path / "test_new.py")
    assert entry["source"] == "estimate" and entry["tests"] == 2
    assert entry["seconds"] == gs.ESTIMATE_BASE_S + 2 * gs.ESTIMATE_PER_TEST_S


def test_a_fake_run_becomes_a_record_with_counts_and_failing_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    tests = tmp_path / "fake"
    tests.mkdir()
    (tests / "test_fake_a.py").write_text(FAKE)
    env = {"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234", "started": "2026-01-01T00:00:00+00:00"}
    path, record = gpu_tests.run_shard(["test_fake_a.py"], {"test_fake_a.py": 15.0}, env, tmp_path / "out",
                                       group="single", index=1, total=1, tests_dir=tests, cwd=tmp_path)
    assert path.name == "gpu_tests_nvidia-h100-80gb-hbm3_abc1234_single_1of1.json"
    assert json.loads(path.read_text()) == record and record["complete"]
    r = record["files"][0]
    assert (r["status"], r["passed"], r["failed"], r["skipped"], r["errors"], r["tests"]) == ("failed", 2, 2, 1, 0, 5)
    assert r["failed_ids"] == ["fake/test_fake_a.py::test_bad", "fake/test_fake_a.py::TestGroup::test_p[2]"]
    assert "one is not two" in r["failures"][0]["message"]
    assert r["skip_reasons"] == {"not on this card": 1} and r["returncode"] == 1
    assert 0 < r["pytest_seconds"] < r["seconds"] and (tmp_path / "out" / r["log"]).exists()

    durations = gs.load_durations(tmp_path / "none.json")
    assert gs.update_durations(durations, record["files"], env) == ["test_fake_a.py"]
    entry = durations["files"]["test_fake_a.py"]
    assert entry["source"] == "measured" and entry["tests"] == 5 and entry["card"] == env["device"]
    assert durations["startup_s"]["source"] == "measured"


def test_a_file_past_its_timeout_is_cut_off_with_what_it_finished(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    (tmp_path / "test_fake_slow.py").write_text(SLOW)
    r = gpu_tests.run_file("test_fake_slow.py", tmp_path, tmp_path / "logs", timeout_s=5)
    assert r["status"] == "timeout" and r["returncode"] < 0 and r["junit"] is None
    assert (r["passed"], r["collected"], r["cut_off_in"]) == (1, 2, "test_fake_slow.py::test_sleeps")
    durations = {"startup_s": {"seconds": 10}, "files": {"test_fake_slow.py": {"seconds": 2, "tests": 2}}}
    gs.update_durations(durations, [r], {"device": "x"})
    assert durations["files"]["test_fake_slow.py"]["seconds"] >= 5  # cut off: a floor, never less than it had


def test_multi_gpu_files_are_not_run_on_one_gpu(tmp_path, monkeypatch, capsys):
    tests = tmp_path / "gpu"
    tests.mkdir()
    (tests / "test_two_gpu.py").write_text(
        "import pytest\nimport torch\n\npytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason='x')\n\n\n"
        "def test_a():\n    pass\n")
    monkeypatch.setattr(gpu_tests, "stamp", lambda: {"device": "NVIDIA H200", "commit": "c0ffee1", "device_count": 1})
    rc = gpu_tests.main(["--group", "multi", "--shard", "1/1", "--tests-dir", str(tests), "--out", str(tmp_path / "o"),
                         "--durations", str(tmp_path / "d.json")])
    record = json.loads(next((tmp_path / "o").glob("*.json")).read_text())
    assert rc == 0 and record["files"][0]["status"] == "not run"
    assert record["files"][0]["reason"] == "needs 2 GPUs, 1 visible"
    assert not (tmp_path / "d.json").exists()


def test_stamp_names_the_card_versions_and_commit():
    env = gpu_tests.stamp(sys.executable)
    assert {"device", "commit", "torch", "device_count", "date"} <= set(env)


def _record(card: str, commit: str, started: str, files: list[dict]) -> dict:
    return {"kind": "gpu_tests", "environment": {"device": card, "commit": commit, "started": started},
            "group": "single", "shard": 1, "shards": 1, "complete": True, "files": files}


def _res(file: str, status: str, passed: int = 0, failed: int = 0, skipped: int = 0, **kw) -> dict:
    failures = [{"id": f"tests/gpu/{file}::test_{i}", "kind": "failure", "message": "boom\nmore"} for i in range(failed)]
    return {"file": file, "status": status, "passed": passed, "failed": failed, "skipped": skipped, "errors": 0,
            "tests": passed + failed + skipped, "failures": failures, "seconds": 40.0, "pytest_seconds": 30.0, **kw}


def test_the_report_merges_two_cards(tmp_path):
    h100, h200 = tmp_path / "h100", tmp_path / "h200"
    h100.mkdir()
    h200.mkdir()
    old = _record("NVIDIA H100 80GB HBM3", "1111111", "2026-01-01T10:00:00", [
        _res("test_a.py", "failed", 3, 1), _res("test_b.py", "passed", 5)])
    new = _record("NVIDIA H100 80GB HBM3", "2222222", "2026-01-01T11:00:00", [
        _res("test_a.py", "passed", 4), _res("test_b.py", "not run", reason="deadline")])
    other = _record("NVIDIA H200", "2222222", "2026-01-01T12:00:00", [
        _res("test_a.py", "failed", 2, 2), _res("test_c.py", "timeout", 1, timeout_s=300, collected=9)])
    (h100 / "one.json").write_text(json.dumps(old))
    (h100 / "two.json").write_text(json.dumps(new))
    (h200 / "r.json").write_text(json.dumps(other))
    (h200 / "unrelated.json").write_text(json.dumps({"rows": []}))
    cards = gpu_tests_report.merge(gpu_tests_report.load_records([h100, h200]))
    assert cards["NVIDIA H100 80GB HBM3"]["commits"] == ["2222222", "1111111"]
    assert cards["NVIDIA H100 80GB HBM3"]["files"]["test_a.py"]["commit"] == "2222222"  # the newer run replaces
    assert cards["NVIDIA H100 80GB HBM3"]["files"]["test_b.py"]["status"] == "passed"  # "not run" hides nothing

    tests_dir = tmp_path / "gpu"
    tests_dir.mkdir()
    for name in ("test_a.py", "test_b.py", "test_c.py", "test_d.py"):
        (tests_dir / name).write_text("")
    md = tmp_path / "REPORT.md"
    rc = gpu_tests_report.report_main([h100, h200], md, tests_dir, tmp_path / "durations.json")
    text = md.read_text()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in text.splitlines() if line.startswith("| ")}
    assert rows["file"] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200 |"]
    assert rows["commit"] == ["2222222, 1111111", "2222222 |"]
    assert rows["test_a.py"] == ["pass 4", "**FAIL** 2 of 4 |"]
    assert rows["test_b.py"] == ["pass 5 @1111111", "not run |"]
    assert rows["test_c.py"] == ["not run", "**TIMEOUT** at 300 s (1 passed, 0 failed of 9) |"]
    assert rows["test_d.py"] == ["not run", "not run |"]
    assert "Failing on NVIDIA H200:" in text and "- `tests/gpu/test_a.py::test_1` (failure): boom" in text
    assert "Failing on NVIDIA H100" not in text and rc == 1
    durations = json.loads((tmp_path / "durations.json").read_text())["files"]
    assert durations["test_a.py"]["card"] == "NVIDIA H200" and durations["test_a.py"]["seconds"] == 30.0  # newest run
    assert durations["test_c.py"]["source"] == "measured: timed out, a floor" and durations["test_c.py"]["seconds"] == 40


# each of three files marks that it started, then waits for the other two: one at a time, the first would time out
PASSING = '''
import os
import pathlib
import time

def test_a():
    here = pathlib.Path(os.environ["RENDEZVOUS"])
    (here / pathlib.Path(__file__).stem).touch()
    deadline = time.monotonic() + 30
    while len(list(here.iterdir())) < 3:
        assert time.monotonic() < deadline, "the other files never started beside this one"
        time.sleep(0.05)
'''


# fails in a share of the card, as an engine test does that runs out of memory beside others; passes alone
IN_A_SHARE = '''
import os

def test_alone():
    assert "GRAPHSERVE_GPU_MEMORY_FRACTION" not in os.environ, "CUDA out of memory in its share of the card"
'''


def test_jobs_run_files_beside_each_other_then_alone_and_rerun_takes_what_did_not_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    tests = tmp_path / "gpu"
    tests.mkdir()
    for name in ("test_p1.py", "test_p2.py", "test_p3.py"):
        (tests / name).write_text(PASSING)
    (tests / "test_bad.py").write_text(FAKE)
    (tests / "test_share.py").write_text(IN_A_SHARE)
    env = {"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234", "started": "2026-01-01T00:00:00+00:00",
           "device_count": 1}
    monkeypatch.setattr(gpu_tests, "stamp", lambda: dict(env))
    durations = tmp_path / "d.json"
    (tmp_path / "meet").mkdir()
    monkeypatch.setenv("RENDEZVOUS", str(tmp_path / "meet"))
    rc = gpu_tests.main(["--all", "--jobs", "4", "--tests-dir", str(tests), "--out", str(tmp_path / "o1"),
                         "--durations", str(durations), "--update-durations"])
    records = {r["group"]: r for r in (json.loads(p.read_text()) for p in (tmp_path / "o1").glob("*.json"))}
    record, alone = records["single-all"], records["single-all-alone"]
    assert rc == 1 and record["jobs"] == 4 and record["complete"]
    assert record["memory_fraction"] == pytest.approx(0.9 / 4, abs=1e-3)
    status = {r["file"]: r["status"] for r in record["files"]}
    assert status == {"test_p1.py": "passed", "test_p2.py": "passed", "test_p3.py": "passed", "test_bad.py": "failed",
                      "test_share.py": "failed"}  # fmt: skip
    # what failed beside the others runs again alone, without a share: the company's failure passes, the real one not
    assert alone["jobs"] == 1 and "memory_fraction" not in alone and alone["complete"]
    assert {r["file"]: r["status"] for r in alone["files"]} == {"test_bad.py": "failed", "test_share.py": "passed"}
    # only the times measured alone go into the durations file: beside other files they are not a file's own
    assert set(json.loads(durations.read_text())["files"]) == {"test_bad.py", "test_share.py"}
    rc = gpu_tests.main(["--files", "test_share.py", "test_p1.py", "--jobs", "2", "--tests-dir", str(tests),
                         "--out", str(tmp_path / "o3"), "--durations", str(durations)])  # fmt: skip
    assert rc == 0 and len(list((tmp_path / "o3").glob("*.json"))) == 2  # passed alone: the command passes
    rc = gpu_tests.main(["--files", "test_share.py", "--jobs", "2", "--no-alone", "--tests-dir", str(tests),
                         "--out", str(tmp_path / "o4"), "--durations", str(durations)])  # fmt: skip
    assert rc == 1 and len(list((tmp_path / "o4").glob("*.json"))) == 1

    # a second record of another commit does not count: only this card and commit's passes are taken as seen
    other = dict(record, environment={**env, "commit": "0000000"})
    (tmp_path / "o1" / "other.json").write_text(json.dumps(other))
    assert gpu_tests.rerun_files([tmp_path / "o1"], sorted(status), env) == ["test_bad.py"]
    rc = gpu_tests.main(["--rerun", str(tmp_path / "o1"), "--tests-dir", str(tests), "--out", str(tmp_path / "o2"),
                         "--durations", str(durations)])
    rerun = json.loads(next((tmp_path / "o2").glob("*.json")).read_text())
    assert rc == 1 and rerun["jobs"] == 1 and [r["file"] for r in rerun["files"]] == ["test_bad.py"]
    assert rerun["group"] == "single-rerun" and rerun["files"][0]["status"] == "failed"


def test_files_names_files_and_refuses_unknown_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    tests = tmp_path / "gpu"
    tests.mkdir()
    (tests / "test_p1.py").write_text("def test_a():\n    pass\n")
    monkeypatch.setattr(gpu_tests, "stamp", lambda: {"device": "NVIDIA H200", "commit": "c0ffee1", "device_count": 1})
    with pytest.raises(SystemExit, match="no such file.*test_nope.py"):
        gpu_tests.main(["--files", "test_nope.py", "--tests-dir", str(tests), "--out", str(tmp_path / "o")])
    rc = gpu_tests.main(["--files", "test_p1.py", "--tests-dir", str(tests), "--out", str(tmp_path / "o")])
    record = json.loads(next((tmp_path / "o").glob("*.json")).read_text())
    assert rc == 0 and record["files"][0]["status"] == "passed" and record["group"] == "single-files"
    with pytest.raises(SystemExit):
        gpu_tests.main(["--files", "test_p1.py", "--all", "--tests-dir", str(tests)])
