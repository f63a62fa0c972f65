"""engine/compile_watch.py: how Triton specialized a kernel, what sets a late compile apart, and that only
compiles after ready are reported."""

from __future__ import annotations

import json

from graphserve.config import EngineConfig
from graphserve.engine import compile_watch

MODEL = "builtin:tiny-llama"


def _spec_data(stride_bt: int, q_align: bool) -> str:
    """specialization_data as Triton 3.6's JIT serializes it for a 4-argument kernel."""
    aligned = [i for i, on in ((0, q_align), (1, stride_bt % 16 == 0)) if on]
    attrs_keys, attrs_vals = [[i] for i in aligned], [[["tt.divisibility", 16]] for _ in aligned]
    constant_keys, constant_vals = [[3]], [64]
    signature = {"q_ptr": "*bf16", "stride_bt": "i32", "scale": "fp32", "BLOCK": "constexpr"}
    if stride_bt == 1:
        signature["stride_bt"] = "constexpr"
        constant_keys, constant_vals = [[3], [1]], [64, 1]
    return json.dumps({"name": "k", "signature": signature, "constant_keys": constant_keys,
                       "constant_vals": constant_vals, "attrs_keys": attrs_keys, "attrs_vals": attrs_vals,
                       "options": {}, "key": "x"})


def test_specialization_reads_types_constants_and_divisibility():
    spec = compile_watch.specialization({"specialization_data": _spec_data(32, q_align=True)})
    assert spec == {"q_ptr": "*bf16 divisibility=16", "stride_bt": "i32 divisibility=16", "scale": "fp32",
                    "BLOCK": "constexpr=64"}
    assert compile_watch.specialization({"specialization_data": _spec_data(1, q_align=False)})["stride_bt"] == "constexpr=1"
    assert compile_watch.specialization({"key": "raw"}) == {"key": "raw"}  # a format it does not know: the raw key


def test_difference_names_the_arguments_against_the_nearest_earlier():
    def spec(stride_bt, q_align):
        return compile_watch.specialization({"specialization_data": _spec_data(stride_bt, q_align)})

    assert compile_watch.difference(spec(32, True), []) == "its first specialization"
    earlier = [spec(32, True), spec(7, False)]
    assert compile_watch.difference(spec(7, True), earlier) == "stride_bt: i32 divisibility=16 -> i32"
    assert compile_watch.difference(spec(32, True), earlier) == "the same arguments (options differ)"


def test_the_compile_watch_reports_only_compiles_after_ready():
    """Its hook is called the way Triton's JIT calls the post-compile hook (keyword arguments only), and
    passes each compile on to the hook it replaced."""
    import triton

    late: list[tuple[str, str]] = []
    before = triton.knobs.runtime.jit_post_compile_hook
    info = type("Info", (), {"name": "_extend_kernel"})()

    def compiled(stride_bt: int, q_align: bool) -> None:
        triton.knobs.runtime.jit_post_compile_hook(
            key="k", repr="_extend_kernel[]()", fn=info, is_manual_warmup=False, already_compiled=False,
            compile={"key": "k", "specialization_data": _spec_data(stride_bt, q_align)})

    chained: list[str] = []

    def earlier(*, fn, **_) -> None:  # a hook somebody installed before: it still sees every compile
        chained.append(fn.name)

    try:
        triton.knobs.runtime.jit_post_compile_hook = earlier
        watch = compile_watch.CompileWatch(lambda name, diff: late.append((name, diff)))
        compiled(32, True)  # during the warm-up: recorded, not reported
        watch.ready()
        compiled(5, True)
        watch.close()
        assert triton.knobs.runtime.jit_post_compile_hook is earlier  # put back
    finally:
        triton.knobs.runtime.jit_post_compile_hook = before
    assert late == [("_extend_kernel", "stride_bt: i32 divisibility=16 -> i32")]
    assert chained == ["_extend_kernel", "_extend_kernel"]


def test_no_compile_watch_on_the_cpu():
    assert compile_watch.watch_compiles(EngineConfig(model=MODEL, device="cpu")) is None
