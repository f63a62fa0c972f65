"""Imports run one way: every module under graphserve/ imports only from its own layer or the layers below.

The layers, lowest first (a module may import from its own group and from any lower tier; the groups of one
tier are peers that do not import each other):

  errors.py, env.py                           the exception hierarchy everything raises; the GRAPHSERVE_* switches
  outputs.py, structured/                     finished-request records; output constraints (xgrammar)
  sampling_params.py, config.py               what a request asks for; EngineConfig and its flags
  distributed/                                process groups and collectives
  kernels/                                    Triton kernels beside their PyTorch references
  layers/                                     attention backends, linear, MoE, quantized weights
  models/                                     families, their descriptions, loaders, the parallel check
  engine/                                     scheduler, KV pool, runner, graphs, ranks, the core
  server/, llm.py, analysis/                  HTTP front-end; offline LLM; the analyzer
  bench/, router/                             load generator and sweeps (start servers, run the analyzer); the
                                              prefix-aware router over `serve` workers
  tuning/, cli.py, demo.py, graphserve/__init__.py   the commands and the package face

Every ``import`` counts, at module level and inside functions (an in-function import that only hides a
circle is still one); only ``if TYPE_CHECKING:`` blocks are left out, since they never run. Imports made by
``importlib.import_module`` (cli.py's command table, kernels/pdl.py's kernel walk) are not read.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Lowest tier first; each tier is a tuple of peer groups, each group a tuple of module prefixes.
TIERS: tuple[tuple[tuple[str, ...], ...], ...] = (
    (("graphserve.errors",), ("graphserve.env",)),
    (("graphserve.outputs",), ("graphserve.structured",)),
    (("graphserve.sampling_params",), ("graphserve.config",)),
    (("graphserve.distributed",),),
    (("graphserve.kernels",),),
    (("graphserve.layers",),),
    (("graphserve.models",),),
    (("graphserve.engine",),),
    (("graphserve.server",), ("graphserve.llm",), ("graphserve.analysis",)),
    (("graphserve.bench",), ("graphserve.router",)),
    (("graphserve.tuning",), ("graphserve.cli",), ("graphserve.demo",), ("graphserve",)),
)

@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module
    line: int
    in_function: bool


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, str | None, int, bool]]:
    """(module, name or None, line, inside a function) for every import that can run."""
    found: list[tuple[str, str | None, int, bool]] = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:  # an `else:` under TYPE_CHECKING does run
                    walk_one(stmt, in_function)
                continue
            walk_one(child, in_function)

    def walk_one(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, None, node.lineno, in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            found.extend((base, alias.name, node.lineno, in_function) for alias in node.names)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.orelse:
                walk_one(stmt, in_function)
        else:
            walk(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(tree, False)
    return found


def import_graph(root: Path, package: str = "graphserve") -> tuple[set[str], list[Import]]:
    """Every module of ``package`` under ``root`` and every import between two of them."""
    paths = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    imports = []
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for base, name, line, in_function in _imported_names(tree, module, path.name == "__init__.py"):
            if base != package and not base.startswith(package + "."):
                continue
            # `from a.b import c`: c is a module when a file says so, else a name defined in a.b
            target = f"{base}.{name}" if name and f"{base}.{name}" in paths else base
            while target and target not in paths:  # `import a.b.c` of a name-less path: its nearest module
                target = target.rpartition(".")[0]
            if target and target != module:
                imports.append(Import(module, target, line, in_function))
    return set(paths), list(dict.fromkeys(imports))  # one per line: `from a import b, c` is one import of a


def circles(modules: set[str], imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    edges: dict[str, list[str]] = {m: [] for m in modules}
    for imp in imports:
        edges[imp.source].append(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(modules):
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def place(module: str, tiers=TIERS) -> tuple[int, str] | None:
    """(tier, group) of a module: the group whose prefix matches it longest. The root package (``graphserve``,
    its __init__.py) matches itself only, so that a new top-level module is placed by hand, not by default."""
    best: tuple[int, str, int] | None = None
    for tier, groups in enumerate(tiers):
        for group in groups:
            for prefix in group:
                if module == prefix or ("." in prefix and module.startswith(prefix + ".")):
                    if best is None or len(prefix) > best[2]:
                        best = (tier, group[0], len(prefix))
    return None if best is None else best[:2]


def wrong_way(imports: list[Import], tiers=TIERS) -> list[Import]:
    """Imports from a higher tier, or from a peer group of the same tier."""
    bad = []
    for imp in imports:
        (tier_s, group_s), (tier_t, group_t) = place(imp.source, tiers), place(imp.target, tiers)
        if tier_t > tier_s or (tier_t == tier_s and group_t != group_s):
            bad.append(imp)
    return bad


def _where(imp: Import, root: Path) -> str:
    path = imp.source.replace(".", "/")
    path = f"{path}/__init__.py" if (root / path).is_dir() else f"{path}.py"
    return f"{path}:{imp.line} imports {imp.target}{' (inside a function)' if imp.in_function else ''}"


def test_graphserve_has_no_import_circle():
    modules, imports = import_graph(ROOT)
    assert len(modules) > 200 and len(imports) > 500, "the reader found too little: it no longer reads the tree"
    found = circles(modules, imports)
    lines = []
    for component in found:
        members = set(component)
        lines.append(f"circle of {len(component)} modules: {', '.join(component)}")
        lines += [f"  {_where(imp, ROOT)}" for imp in imports if imp.source in members and imp.target in members]
    assert not found, "\n".join(lines)


def test_every_module_sits_in_a_declared_layer():
    modules, _ = import_graph(ROOT)
    unplaced = sorted(m for m in modules if place(m) is None)
    assert not unplaced, f"modules in no layer of TIERS (add their package where it belongs): {unplaced}"


def test_imports_run_one_way():
    _, imports = import_graph(ROOT)
    bad = wrong_way(imports)
    lines = [f"{_where(imp, ROOT)}: layer {place(imp.source)[1]} may not import layer {place(imp.target)[1]}"
             for imp in bad]
    assert not bad, "imports that run up the layers (or across peers):\n" + "\n".join(lines)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_reader_finds_circles_upward_imports_and_skips_type_checking(tmp_path):
    """A small package whose faults are known: the checks above are only as good as this reader."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high.c import C\n"
                        "def f():\n    from pkg.low import b\n",
        "pkg/low/b.py": "import os\nfrom pkg.low.a import f\n",
        "pkg/low/d.py": "from . import b\nclass K:\n    def m(self):\n        import pkg.high.c\n",
        "pkg/high/__init__.py": "",
        "pkg/high/c.py": "from pkg.low.b import f as g\nfrom pkg.low import d\n",
    })  # fmt: skip
    modules, imports = import_graph(tmp_path, "pkg")
    assert modules == {"pkg", "pkg.low", "pkg.low.a", "pkg.low.b", "pkg.low.d", "pkg.high", "pkg.high.c"}
    got = {(i.source, i.target, i.line, i.in_function) for i in imports}
    assert got == {("pkg.low.a", "pkg.low.b", 5, True), ("pkg.low.b", "pkg.low.a", 2, False),
                   ("pkg.low.d", "pkg.low.b", 1, False), ("pkg.low.d", "pkg.high.c", 4, True),
                   ("pkg.high.c", "pkg.low.b", 1, False), ("pkg.high.c", "pkg.low.d", 2, False)}
    assert sorted(circles(modules, imports)) == [["pkg.high.c", "pkg.low.d"], ["pkg.low.a", "pkg.low.b"]]
    tiers = ((("pkg.low",),), (("pkg.high",), ("pkg",)))
    assert place("pkg.high.c", tiers) == (1, "pkg.high") and place("pkg", tiers) == (1, "pkg")
    assert place("pkg.new", tiers) is None  # a module of no declared layer is not the root package's
    up = wrong_way(imports, tiers)
    assert [(i.source, i.target) for i in up] == [("pkg.low.d", "pkg.high.c")]
    peers = ((("pkg.low.a", "pkg.low.b"), ("pkg.low.d",)), (("pkg.high",), ("pkg",)))
    assert {(i.source, i.target) for i in wrong_way(imports, peers)} == {("pkg.low.d", "pkg.low.b"),
                                                                         ("pkg.low.d", "pkg.high.c")}
