"""The warm-up before ready (server/warmup.py) on CPU: it reaches the prefix-cache paths, then resets the
counters; its compile watch reports each kernel specialized after it."""

from __future__ import annotations

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


@pytest.mark.parametrize("caching", [True, False])
def test_warm_up_hits_the_prefix_cache_then_resets_the_counters(caching):
    core = EngineCore(EngineConfig(model=MODEL, enable_prefix_caching=caching, **SMALL))
    done = warmup.warm_up(core)
    assert (done["prefix_hit_tokens"] > 0) is caching
    bm = core.block_manager
    assert bm.hit_tokens == bm.queried_tokens == 0
    assert core.prompt_tokens_total == core.generation_tokens_total == 0
    assert not core.has_unfinished_requests()


def test_the_compile_watch_names_the_kernel():
    """The hook is called the way Triton's JIT calls its post-compile hook (keyword arguments only)."""
    import triton

    seen: list[tuple[str, str]] = []
    before = triton.knobs.runtime.jit_post_compile_hook
    try:
        warmup.watch_compiles(lambda name, sig: seen.append((name, sig)))
        info = type("Info", (), {"name": "_extend_kernel"})()
        triton.knobs.runtime.jit_post_compile_hook(key=None, repr="_extend_kernel[num_warps=4](q: *bf16)", fn=info,
                                                   compile={}, is_manual_warmup=False, already_compiled=False)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = before
    assert seen == [("_extend_kernel", "_extend_kernel[num_warps=4](q: *bf16)")]
