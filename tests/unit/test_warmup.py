"""The warm-up before ready (engine/warmup.py) on CPU: its token ladder meets every tile bucket, it reaches
the prefix-cache paths, then resets the counters."""

from __future__ import annotations

import pytest

from graphserve.config import EngineConfig
from graphserve.engine import warmup
from graphserve.engine.core import EngineCore

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
