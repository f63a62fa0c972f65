"""graphserve/env.py declares every GRAPHSERVE_* switch: none is named in graphserve/ or benchmarks/ without a
declaration, none is read from os.environ outside env.py, and the README's table is env.py's output."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from graphserve import env

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bGRAPHSERVE_[A-Z0-9_]*[A-Z0-9]\b")


def sources() -> list[Path]:
    return sorted(p for folder in ("graphserve", "benchmarks") for pattern in ("*.py", "*.sh")
                  for p in (ROOT / folder).rglob(pattern))


def named(path: Path) -> set[str]:
    """The GRAPHSERVE_* names a file uses as text: string literals (docstrings and f-strings included) in Python, the
    whole text of a shell script. Python identifiers (a regex called GRAPHSERVE_MARKS) are no switch."""
    text = path.read_text()
    if path.suffix == ".sh":
        return set(NAME.findall(text))
    return {name for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            for name in NAME.findall(node.value)}


def test_every_switch_named_in_the_tree_is_declared():
    undeclared = {f"{p.relative_to(ROOT)}: {name}" for p in sources() for name in named(p) if name not in env.SWITCHES}
    assert not undeclared, f"declare these in graphserve/env.py: {sorted(undeclared)}"
    # and the scan sees the tree's readers: the switches the kernels and the server read are among its findings
    found = {name for p in sources() for name in named(p)}
    assert {"GRAPHSERVE_PDL", "GRAPHSERVE_CACHE", "GRAPHSERVE_FAULT_INJECT", "GRAPHSERVE_COMMIT"} <= found


def _constants() -> dict[str, str]:
    """Module-level ``NAME = "GRAPHSERVE_..."`` constants anywhere in the tree (pdl.ENV, core_driver.FAULT_ENV)."""
    out = {}
    for p in sources():
        if p.suffix == ".py":
            for node in ast.parse(p.read_text()).body:
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                        and isinstance(node.value.value, str) and node.value.value.startswith("GRAPHSERVE_")):
                    out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")) or (
        isinstance(node, ast.Name) and node.id in ("environ", "getenv"))


def direct_reads(tree: ast.AST, constants: dict[str, str]) -> list[str]:
    """The GRAPHSERVE_* keys read from os.environ / os.getenv in ``tree``: a subscript, .get / getenv, or ``in``."""

    def key(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value if node.value.startswith("GRAPHSERVE_") else None
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            found.append(key(node.slice))
        elif isinstance(node, ast.Call) and node.args and (
                _is_environ(node.func) or (isinstance(node.func, ast.Attribute) and _is_environ(node.func.value))):
            found.append(key(node.args[0]))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            found.append(key(node.left))
    return [k for k in found if k]


def test_direct_reads_are_found():
    constants = {"ENV": "GRAPHSERVE_PDL"}
    code = ('import os\nos.environ.get("GRAPHSERVE_CACHE")\nos.environ[ENV]\nENV in os.environ\n'
            'os.getenv("GRAPHSERVE_X")\nos.environ.get("HOME")\nos.environ.setdefault("OTHER", "1")\n')
    assert direct_reads(ast.parse(code), constants) == [
        "GRAPHSERVE_CACHE", "GRAPHSERVE_PDL", "GRAPHSERVE_PDL", "GRAPHSERVE_X"]


def test_no_switch_is_read_around_env_py():
    constants = _constants()
    reads = [f"{p.relative_to(ROOT)}: {k}" for p in sources() if p.suffix == ".py" and p != ROOT / "graphserve/env.py"
             for k in direct_reads(ast.parse(p.read_text()), constants)]
    assert not reads, f"read these through graphserve.env: {reads}"


def test_accessors(monkeypatch):
    monkeypatch.delenv("GRAPHSERVE_PDL", raising=False)
    assert env.flag("GRAPHSERVE_PDL") and not env.is_set("GRAPHSERVE_PDL")
    monkeypatch.setenv("GRAPHSERVE_PDL", "0")
    assert not env.flag("GRAPHSERVE_PDL") and env.is_set("GRAPHSERVE_PDL")
    monkeypatch.setenv("GRAPHSERVE_PDL_SKIP", "")
    assert env.get("GRAPHSERVE_PDL_SKIP") == ""  # set empty (leave nothing out) is not unset (the default list)
    monkeypatch.setenv("GRAPHSERVE_CACHE", "")
    assert env.path("GRAPHSERVE_CACHE") == Path("~/.cache/graphserve").expanduser()
    monkeypatch.setenv("GRAPHSERVE_CACHE", "~/elsewhere")
    assert env.path("GRAPHSERVE_CACHE") == Path.home() / "elsewhere"
    with pytest.raises(KeyError, match="GRAPHSERVE_NOPE is not declared in graphserve/env.py"):
        env.get("GRAPHSERVE_NOPE")


def test_readme_table_is_env_py_output():
    readme = (ROOT / "README.md").read_text()
    table = env.markdown()
    assert table.count("\n") + 1 == len(env.SWITCHES) + 2
    assert table in readme, "README.md's switch table differs from `python3 -m graphserve.env --markdown`"
