"""The PDL switch (kernels/pdl.py) off the GPU: kernels launch without it on the CPU and under the interpreter,
and the scope and the environment variable decide where the device allows it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from graphserve.kernels import pdl as pdl_mod

KERNELS = Path(pdl_mod.__file__).parent


def test_cpu_never_launches_with_pdl(env):
    env(GRAPHSERVE_PDL="1")
    cpu = torch.device("cpu")
    assert not pdl_mod.pdl_on(cpu)
    assert pdl_mod.pdl_args(cpu, "_gemv_kernel") == {"PDL": False, "launch_pdl": False}
    with pdl_mod.pdl(True):
        assert not pdl_mod.pdl_on(cpu)


@pytest.fixture
def env(monkeypatch):
    """Sets GRAPHSERVE_PDL*; the module reads them once per process, so each setting starts a fresh read."""
    def set_env(**values: str | None) -> None:
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        pdl_mod.env_setting.cache_clear()

    yield set_env
    pdl_mod.env_setting.cache_clear()


def test_scope_and_environment_decide_on_a_capable_device(monkeypatch, env):
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(pdl_mod, "_capable", lambda device: device.type == "cuda")
    env(GRAPHSERVE_PDL=None, GRAPHSERVE_PDL_SKIP=None)
    assert pdl_mod.pdl_on(dev)  # on by default
    assert not pdl_mod.pdl_on(dev, "_fp8_gemv_kernel")  # except the kernels measured to lose by it
    env(GRAPHSERVE_PDL="0")
    assert not pdl_mod.pdl_on(dev)
    with pdl_mod.pdl(True):  # a scope overrides the environment, and nests
        assert pdl_mod.pdl_args(dev, "_gemv_kernel") == {"PDL": True, "launch_pdl": True}
        with pdl_mod.pdl(False):
            assert not pdl_mod.pdl_on(dev)
        assert pdl_mod.pdl_on(dev)
    assert not pdl_mod.pdl_on(dev)


def test_named_kernels_can_be_left_out(monkeypatch, env):
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(pdl_mod, "_capable", lambda device: device.type == "cuda")
    env(GRAPHSERVE_PDL=None, GRAPHSERVE_PDL_SKIP=" _fp8_gemv_kernel, _w8a8_kernel ")
    assert not pdl_mod.pdl_on(dev, "_fp8_gemv_kernel") and not pdl_mod.pdl_on(dev, "_w8a8_kernel")
    assert pdl_mod.pdl_on(dev, "_gemv_kernel")
    with pdl_mod.pdl(True, skip={"_gemv_kernel"}):  # a scope's own list replaces the environment's
        assert not pdl_mod.pdl_on(dev, "_gemv_kernel") and pdl_mod.pdl_on(dev, "_fp8_gemv_kernel")


def test_a_late_releasing_kernel_left_out_still_releases(monkeypatch, env):
    """The FP8 streaming matmul, left out, launches without the attribute but keeps its release after the main
    loop (so a decode kernel after it may launch during its tail), unless the scope or the environment says not;
    with PDL off, or a kernel that releases at its start, nothing of it."""
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(pdl_mod, "_capable", lambda device: device.type == "cuda")
    monkeypatch.delenv(pdl_mod.RELEASE_ENV, raising=False)
    pdl_mod._release_env.cache_clear()
    env(GRAPHSERVE_PDL=None, GRAPHSERVE_PDL_SKIP=None)
    assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == {"PDL": True, "launch_pdl": False}
    with pdl_mod.pdl_release_left_out(False):
        assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == {"PDL": False, "launch_pdl": False}
    with pdl_mod.pdl(True, skip={"_fp8_gemv_kernel", "_gemv_kernel"}):  # released at its start: never when left out
        assert pdl_mod.pdl_args(dev, "_gemv_kernel") == {"PDL": False, "launch_pdl": False}
    with pdl_mod.pdl(False):
        assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv(pdl_mod.RELEASE_ENV, "0")
    pdl_mod._release_env.cache_clear()
    try:
        assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == {"PDL": False, "launch_pdl": False}
        with pdl_mod.pdl_release_left_out(True):  # a scope overrides the environment
            assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == {"PDL": True, "launch_pdl": False}
    finally:
        monkeypatch.delenv(pdl_mod.RELEASE_ENV)
        pdl_mod._release_env.cache_clear()
    # every kernel that may release when left out waits first (pdl_wait) and releases after its main loop
    firsts = {}
    for path in sorted(KERNELS.glob("*.py")):
        for fn in ast.parse(path.read_text()).body:
            if isinstance(fn, ast.FunctionDef) and fn.name in pdl_mod.LATE_RELEASE:
                body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
                firsts[fn.name] = ast.unparse(body[0])
    assert firsts == {name: "pdl_wait(PDL)" for name in pdl_mod.LATE_RELEASE}


def test_a_joined_call_site_launches_a_left_out_kernel_with_pdl(monkeypatch, env):
    """``pdl_joined`` takes the kernels it names off the skip list in force, when joining is on as it opens (the
    environment, else a ``pdl_joins`` scope); never with PDL off, never a kernel it does not name, a scope opened
    inside it decides for itself, and a name that is not a kernel is refused."""
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(pdl_mod, "_capable", lambda device: device.type == "cuda")
    env(GRAPHSERVE_PDL=None, GRAPHSERVE_PDL_SKIP=None)
    monkeypatch.delenv(pdl_mod.JOIN_ENV, raising=False)
    pdl_mod._join_env.cache_clear()
    left_out = {"PDL": True, "launch_pdl": False}  # launched plain, releasing after its loop
    try:
        with pdl_mod.pdl_joined({"_fp8_gemv_kernel"}):
            assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == {"PDL": True, "launch_pdl": True}  # on by default
            assert pdl_mod.pdl_args(dev, "_gemv_kernel") == {"PDL": True, "launch_pdl": True}  # never left out
            with pdl_mod.pdl(True, skip={"_fp8_gemv_kernel", "_w8a8_kernel"}):  # a scope inside replaces it
                assert pdl_mod.pdl_args(dev, "_w8a8_kernel") == {"PDL": False, "launch_pdl": False}
                assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == left_out
            with pdl_mod.pdl(False):
                assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == {"PDL": False, "launch_pdl": False}
        with pdl_mod.pdl(True, skip={"_fp8_gemv_kernel", "_w8a8_kernel"}), pdl_mod.pdl_joined({"_fp8_gemv_kernel"}):
            assert pdl_mod.pdl_args(dev, "_w8a8_kernel") == {"PDL": False, "launch_pdl": False}  # still left out
            assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == {"PDL": True, "launch_pdl": True}
        with pdl_mod.pdl(False), pdl_mod.pdl_joined({"_fp8_gemv_kernel"}):  # PDL off stays off
            assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == {"PDL": False, "launch_pdl": False}
        assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == left_out  # outside the scope
        with pdl_mod.pdl_joins(False), pdl_mod.pdl_joined({"_fp8_gemv_kernel"}):
            assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == left_out
        monkeypatch.setenv(pdl_mod.JOIN_ENV, "0")
        pdl_mod._join_env.cache_clear()
        with pdl_mod.pdl_joined({"_fp8_gemv_kernel"}):
            assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == left_out
        with pdl_mod.pdl_joins(True), pdl_mod.pdl_joined({"_fp8_gemv_kernel"}):  # a scope overrides the environment
            assert pdl_mod.pdl_args(dev, "_fp8_gemv_kernel") == {"PDL": True, "launch_pdl": True}
    finally:
        monkeypatch.delenv(pdl_mod.JOIN_ENV, raising=False)
        pdl_mod._join_env.cache_clear()
    with pytest.raises(ValueError, match="_fp8_gemv: not a Triton kernel"):
        with pdl_mod.pdl_joined({"_fp8_gemv"}):
            pass


def test_decode_attention_leaves_room_up_to_one_wave(monkeypatch):
    """The call site's rule: a decode step whose split kernel's grid (rows x kv heads x splits, from static sizes)
    is at most PROGRAMS_PER_SM (2) programs an SM, 264 on 132 SMs; prefill never. The grids, worked by hand from
    the split rule (ceil(264 / (rows x 8)) splits, at most one a 64-token step and 32)."""
    import graphserve.layers.attention_triton as triton_backend
    from graphserve.layers.forward_batch import ForwardBatch

    monkeypatch.setattr(triton_backend, "sm_count", lambda device: 132)
    backend = triton_backend.TritonAttentionBackend()
    cache = torch.zeros(2, 4, 16, 8, 8, dtype=torch.bfloat16)  # 8 kv heads, pages of 16
    # (rows, table width in pages of 16): programs
    grids = {(1, 32): 64, (1, 512): 256, (2, 32): 128, (2, 512): 272, (4, 32): 256, (4, 512): 288, (8, 32): 320,
             (16, 512): 384, (64, 32): 512}  # fmt: skip
    for (rows, width), programs in grids.items():
        batch = ForwardBatch.__new__(ForwardBatch)
        batch.mode, batch.kv_caches = "decode", [cache]
        batch.block_tables = torch.zeros(rows, width, dtype=torch.int32)
        assert backend.leaves_room(batch, 0) == (programs <= 264), (rows, width, programs)
        batch.mode = "prefill"
        assert not backend.leaves_room(batch, 0)


def _only_l2_prefetch(statement: ast.stmt) -> bool:
    """``if FLAG: issue_l2_prefetch(...)`` and nothing else (kernels/l2_prefetch.py): it loads no value
    and stores nothing, so nothing an earlier kernel writes can reach it."""
    return (isinstance(statement, ast.If) and not statement.orelse and len(statement.body) == 1
            and isinstance(statement.body[0], ast.Expr) and isinstance(statement.body[0].value, ast.Call)
            and getattr(statement.body[0].value.func, "id", "") == "issue_l2_prefetch")


def test_every_launched_kernel_enters_through_pdl_enter():
    """A kernel launched with the attribute that skipped the wait could run ahead of the kernel before it: its
    first statement is pdl_enter, or pdl_wait with a pdl_release later."""
    trees = {path.name: ast.parse(path.read_text()) for path in sorted(KERNELS.glob("*.py"))}
    launched = set()  # NAME[grid](..., **pdl_args(...)), in whichever file launches it
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                if any(isinstance(k.value, ast.Call) and getattr(k.value.func, "id", "") == "pdl_args"
                       for k in node.keywords if k.arg is None):
                    launched.add(getattr(node.func.value, "id", None))
                    name = next(k.value.args[1] for k in node.keywords if k.arg is None
                                and isinstance(k.value, ast.Call) and getattr(k.value.func, "id", "") == "pdl_args")
                    kernel = getattr(node.func.value, "id", None)
                    # a literal name is the kernel's own; a kernel passed in as a variable gives its __name__
                    literal = isinstance(name, ast.Constant) and name.value == kernel
                    own = isinstance(name, ast.Attribute) and name.attr == "__name__" and name.value.id == kernel
                    assert literal or own, f"{kernel} launches under the name {ast.unparse(name)}"
    missing, checked = [], 0
    for name, tree in trees.items():
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and fn.name in launched:
                body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                if _only_l2_prefetch(body[0]):  # requests for weights no launch writes may precede the wait
                    body = body[1:]
                first = body[0]
                entry = getattr(first.value.func, "id", "") if isinstance(first, ast.Expr) and isinstance(
                    first.value, ast.Call) else ""
                # pdl_wait first lets the next kernel launch later, at its pdl_release, which it must then have
                released = any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "pdl_release"
                               for n in ast.walk(fn))
                ok = entry == "pdl_enter" or (entry == "pdl_wait" and released)
                checked += 1
                if not ok:
                    missing.append(f"{name}:{fn.name}")
    assert checked >= 20 and not missing, (checked, missing)
    # every kernel launched by its own name is one a list of kernels to leave out may name
    defined = {fn.name for tree in trees.values() for fn in tree.body if isinstance(fn, ast.FunctionDef)}
    assert launched & defined <= pdl_mod.kernel_names(), sorted(launched & defined - pdl_mod.kernel_names())


def test_a_kernel_list_must_name_kernels(monkeypatch, env):
    """A misspelt name would leave every kernel on PDL without a word: refused where it was given."""
    names = pdl_mod.kernel_names()
    assert {"_gemv_kernel", "_fp8_gemv_kernel", "fused_moe_gemm_kernel"} <= names
    assert pdl_mod.DEFAULT_SKIP <= names
    env(GRAPHSERVE_PDL_SKIP="_fp8_gemv_kernal")
    with pytest.raises(ValueError, match="GRAPHSERVE_PDL_SKIP='_fp8_gemv_kernal' names _fp8_gemv_kernal"):
        pdl_mod.pdl_on(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"pdl\(skip=...\) names nope"):
        with pdl_mod.pdl(True, skip={"nope", "_gemv_kernel"}):
            pass


def test_the_benchmark_refuses_an_unknown_kernel_before_it_loads_anything(monkeypatch, capsys):
    from benchmarks import pdl as bench

    monkeypatch.setattr("sys.argv", ["pdl", "--skip", "_gemv_kernel,_decode_kernel"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    assert "--skip '_gemv_kernel,_decode_kernel' names _decode_kernel" in capsys.readouterr().err
