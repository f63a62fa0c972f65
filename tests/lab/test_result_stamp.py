"""Result files stamp the commit that holds the code measured: a checkout with uncommitted changes under graphserve/
or benchmarks/ is refused unless GRAPHSERVE_ALLOW_DIRTY=1 (then the stamp says -dirty); files the runs write
themselves do not count; a tree without .git takes its stamp from GRAPHSERVE_COMMIT."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import common
from graphserve.tuning import timing


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    root = tmp_path / "checkout"
    for rel in ("graphserve/engine.py", "benchmarks/decode.py", "benchmarks/results/decode.json", "docs/plan.md"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    _git(tmp_path, "init", "-q", str(root))
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "start")
    for name in ("GRAPHSERVE_ALLOW_DIRTY", "GRAPHSERVE_COMMIT"):
        monkeypatch.delenv(name, raising=False)
    return root, _git(root, "rev-parse", "--short", "HEAD")


def test_clean_tree_stamps_head(repo):
    root, head = repo
    assert timing.git_commit(root) == head


def test_changed_code_is_refused_naming_the_file_and_the_switch(repo):
    root, _ = repo
    (root / "graphserve/engine.py").write_text("x = 2\n")
    with pytest.raises(timing.DirtyTreeError, match=r"1 uncommitted change.*graphserve/engine.py.*GRAPHSERVE_ALLOW_DIRTY=1"):
        timing.git_commit(root)
    (root / "benchmarks/new_probe.py").write_text("y = 1\n")  # an untracked module is a change too
    with pytest.raises(timing.DirtyTreeError, match=r"2 uncommitted change"):
        timing.git_commit(root)


def test_allowed_dirty_tree_says_so(repo, monkeypatch):
    root, head = repo
    (root / "benchmarks/decode.py").write_text("x = 2\n")
    monkeypatch.setenv("GRAPHSERVE_ALLOW_DIRTY", "1")
    assert timing.git_commit(root) == f"{head}-dirty"
    monkeypatch.setenv("GRAPHSERVE_COMMIT", "abc1234")
    assert timing.git_commit(root) == "abc1234-dirty"


def test_files_runs_write_and_changes_elsewhere_leave_it_clean(repo):
    root, head = repo
    (root / "benchmarks/results/decode.json").write_text("{}\n")
    (root / "benchmarks/results/new.json").write_text("{}\n")
    (root / "benchmarks/RESULTS.md").write_text("# numbers\n")
    (root / "graphserve/kernels").mkdir()
    (root / "graphserve/kernels/fp8_rule.json").write_text("{}\n")
    (root / "docs/plan.md").write_text("changed\n")
    assert timing.tree_changes(root) == []
    assert timing.git_commit(root) == head


def test_tree_without_git_takes_the_variable(tmp_path, monkeypatch):
    copied = tmp_path / "copied"
    (copied / "graphserve").mkdir(parents=True)
    monkeypatch.delenv("GRAPHSERVE_ALLOW_DIRTY", raising=False)
    monkeypatch.setenv("GRAPHSERVE_COMMIT", "5072745")
    assert timing.tree_changes(copied) is None
    assert timing.git_commit(copied) == "5072745"
    monkeypatch.delenv("GRAPHSERVE_COMMIT")
    assert timing.git_commit(copied) == "unknown"


def test_write_result_refuses_a_dirty_checkout(repo, tmp_path, monkeypatch):
    root, head = repo
    monkeypatch.setattr(timing, "REPO", root)
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.delenv("OUT", raising=False)
    path = common.write_result("stamp", {"rows": [{"model": "m", "ms": 1.5}]})
    assert json.loads(path.read_text())["environment"]["commit"] == head
    (root / "graphserve/engine.py").write_text("x = 3\n")
    with pytest.raises(timing.DirtyTreeError):
        common.write_result("stamp", {"rows": []})
    monkeypatch.setenv("GRAPHSERVE_ALLOW_DIRTY", "1")
    path = common.write_result("stamp", {"rows": []})
    assert json.loads(path.read_text())["environment"]["commit"] == f"{head}-dirty"


def test_stamp_command_for_a_tree_that_travels(repo, monkeypatch, capsys):
    root, head = repo
    monkeypatch.setattr(timing, "REPO", root)
    timing.main()
    assert capsys.readouterr().out.strip() == f"{head}:{timing.code_tree(root)}"
    (root / "graphserve/engine.py").write_text("x = 4\n")
    with pytest.raises(SystemExit, match="refusing to stamp results"):
        timing.main()


def test_tree_beside_an_older_git_proves_its_commit_by_its_code_tree(repo, monkeypatch):
    """A copy of a newer commit's files beside the older history (what a GPU machine is given): git sees changes
    against its HEAD, but the printed ``COMMIT:TREE`` stamp matches the files' tree id, so the stamp is that commit,
    clean; one more edit and the ids differ, so the copy is refused as any dirty checkout."""
    root, _ = repo
    (root / "graphserve/engine.py").write_text("x = 2\n")
    (root / "benchmarks/results/decode.json").write_text("{\"measured\": 1}\n")  # written by a run: not code
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "newer")
    newer, tree = _git(root, "rev-parse", "--short", "HEAD"), timing.code_tree(root)
    assert tree and tree == timing.code_tree(root)
    _git(root, "reset", "-q", "--soft", "HEAD~1")  # the older history under the newer files
    assert timing.tree_changes(root)
    monkeypatch.setenv("GRAPHSERVE_COMMIT", f"{newer}:{tree}")
    assert timing.git_commit(root) == newer
    (root / "graphserve/engine.py").write_text("x = 3\n")
    with pytest.raises(timing.DirtyTreeError, match="graphserve/engine.py"):
        timing.git_commit(root)
    monkeypatch.setenv("GRAPHSERVE_ALLOW_DIRTY", "1")
    assert timing.git_commit(root) == f"{newer}-dirty"
