"""The warm-up before ready (server/warmup.py) on CPU: it reaches the prefix-cache paths, then resets the
counters; its compile watch reports each kernel specialized after it."""

from __future__ import annotations

import json

import pytest

from graphserve.config import EngineConfig
from graphserve.engine.core import EngineCore
from graphserve.server import warmup

MODEL = "builtin:tiny-llama"
SMALL = dict(max_model_len=512, num_kv_tokens=8192)


def test_prefix_lengths_leave_each_kind_of_remainder():
    lengths = warmup.prefix_lengths(16, 500)
    remainders = {n - ((n - 1) // 16) * 16 for n in lengths}  # tokens left after the cached whole blocks
    assert {1, 16} <= remainders and any(1 < r < 16 for r in remainders)
    assert max(lengths) + 16 + 3 <= 500  # the longest extended prompt still fits
    assert warmup.prefix_lengths(16, 30) == []  # no room for a hit and its extension


def test_the_token_ladder_meets_every_doubling_bucket():
    assert warmup.token_ladder(2048) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert warmup.token_ladder(3000)[-1] == 2048
    ladder = warmup.token_ladder(8192)
    for top_k in (1, 6, 8):  # pair buckets (b/2, b] of the tuned tables, and the default table's (b/8, b]
        for low, high in [(b // 2, b) for b in (12, 96, 1536, 6144)] + [(64, 512), (512, 4096)]:
            assert any(low < t * top_k <= high for t in ladder), (top_k, low, high)
    assert warmup.split_prompts(8192, 4088) == [4088, 4088, 16]
    assert warmup.split_prompts(512, 4088) == [512]
    assert sum(warmup.split_prompts(4096, 1000)) == 4096


@pytest.mark.parametrize("caching", [True, False])
def test_warm_up_hits_the_prefix_cache_then_resets_the_counters(caching):
    core = EngineCore(EngineConfig(model=MODEL, enable_prefix_caching=caching, **SMALL))
    done = warmup.warm_up(core)
    assert (done["prefix_hit_tokens"] > 0) is caching
    bm = core.block_manager
    assert bm.hit_tokens == bm.queried_tokens == 0
    assert core.prompt_tokens_total == core.generation_tokens_total == 0
    assert not core.has_unfinished_requests()


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
    spec = warmup.specialization({"specialization_data": _spec_data(32, q_align=True)})
    assert spec == {"q_ptr": "*bf16 divisibility=16", "stride_bt": "i32 divisibility=16", "scale": "fp32",
                    "BLOCK": "constexpr=64"}
    assert warmup.specialization({"specialization_data": _spec_data(1, q_align=False)})["stride_bt"] == "constexpr=1"
    assert warmup.specialization({"key": "raw"}) == {"key": "raw"}  # a format it does not know: the raw key


def test_difference_names_the_arguments_against_the_nearest_earlier():
    def spec(stride_bt, q_align):
        return warmup.specialization({"specialization_data": _spec_data(stride_bt, q_align)})

    assert warmup.difference(spec(32, True), []) == "its first specialization"
    earlier = [spec(32, True), spec(7, False)]
    assert warmup.difference(spec(7, True), earlier) == "stride_bt: i32 divisibility=16 -> i32"
    assert warmup.difference(spec(32, True), earlier) == "the same arguments (options differ)"


def test_the_compile_watch_reports_only_compiles_after_ready():
    """Its hook is called the way Triton's JIT calls the post-compile hook (keyword arguments only)."""
    import triton

    late: list[tuple[str, str]] = []
    before = triton.knobs.runtime.jit_post_compile_hook
    info = type("Info", (), {"name": "_extend_kernel"})()

    def compiled(stride_bt: int, q_align: bool) -> None:
        triton.knobs.runtime.jit_post_compile_hook(
            key="k", repr="_extend_kernel[]()", fn=info, is_manual_warmup=False, already_compiled=False,
            compile={"key": "k", "specialization_data": _spec_data(stride_bt, q_align)})

    try:
        watch = warmup.CompileWatch(lambda name, diff: late.append((name, diff)))
        compiled(32, True)  # during the warm-up: recorded, not reported
        watch.ready()
        compiled(5, True)
        watch.close()
        assert triton.knobs.runtime.jit_post_compile_hook is None
    finally:
        triton.knobs.runtime.jit_post_compile_hook = before
    assert late == [("_extend_kernel", "stride_bt: i32 divisibility=16 -> i32")]


def test_no_compile_watch_on_the_cpu():
    assert warmup.watch_compiles(EngineConfig(model=MODEL, device="cpu")) is None
