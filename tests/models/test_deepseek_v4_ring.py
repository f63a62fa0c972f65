"""DeepSeek-V4 with its latents in pages of their own that only running windows hold (engine/latent_pages.py), far
fewer than the blocks: greedy tokens equal transformers' on contexts several windows long, under continuous
batching with chunked prefill, a prefix-cache hit and preemption by recompute, and no page leaked at the end."""

from __future__ import annotations

import logging

import pytest
from model_utils import engine_greedy, hf_greedy, random_prompts
from test_deepseek_v4 import _checkpoint, _config

from graphserve import LLM
from graphserve.analysis.doctor import diagnose_lines
from graphserve.config import EngineConfig
from graphserve.engine import rank_worker
from graphserve.engine.kv_cache import ROOT_HASH, chain_hash
from graphserve.engine.latent_pages import latent_page_count
from graphserve.engine.memory import plan_memory
from graphserve.engine.startup import requested_kv_tokens, synthetic_batch

PAGES = 13  # 12 usable: a prompt's chunk of 16 behind a window of 8 needs 7, a decode 3


@pytest.fixture(scope="module")
def v4_hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4ring")
    return _checkpoint(folder, _config()), folder


def _llm(monkeypatch, folder, **kwargs) -> LLM:
    monkeypatch.setattr(rank_worker, "latent_page_count", lambda kv, num_blocks, *sizes: PAGES)
    return LLM(str(folder), block_size=4, chunked_prefill_size=16, dtype="float32", max_model_len=256, **kwargs)


def test_greedy_tokens_match_transformers_with_latent_pages_for_windows_only(v4_hf, monkeypatch):
    hf, folder = v4_hf
    prompts = random_prompts((9, 23, 45))
    want = [hf_greedy(hf, p, 12) for p in prompts]
    llm = _llm(monkeypatch, folder)
    bm = llm.engine.core.block_manager
    pages = bm.pages
    assert pages.num_usable_pages == PAGES - 1 < bm.num_usable_blocks // 4
    assert engine_greedy(llm, prompts, 12) == want
    assert pages.num_released > 0  # windows slid past blocks and let their pages go
    bm.check_no_leak()
    # a prompt sharing the 45-token one's first 44 tokens: the hit reaches as far as its window still finds pages
    shared = prompts[2][:44] + [7, 8, 9]
    hits = bm.hit_tokens
    assert engine_greedy(llm, [shared], 8) == [hf_greedy(hf, shared, 8)]
    assert bm.hit_tokens - hits == 44  # nothing pressed for pages since: the window's pages idled with their blocks
    bm.check_no_leak()
    # other prompts take every page back from the idle ones: the same prompt then hits only as far as a window
    # finds pages (none here), recomputes the rest, and still gives transformers' tokens
    others = random_prompts((40, 41), seed=9)
    engine_greedy(llm, others, 2)
    hits, parent, cached = bm.hit_tokens, ROOT_HASH, []
    for i in range(11):  # the shared prompt's blocks are all still cached (compact pages), without latent pages
        parent = chain_hash(parent, shared[4 * i:4 * i + 4])
        cached.append(bm.cached.get(parent))
    assert None not in cached and not any(pages.has_page(b) for b in cached)
    assert engine_greedy(llm, [shared], 8) == [hf_greedy(hf, shared, 8)]
    assert bm.hit_tokens == hits
    bm.check_no_leak()


def test_preemption_by_recompute_when_pages_run_short(v4_hf, monkeypatch, caplog):
    """7 usable pages and blocks to spare: three prompts (8, 8 and 12 tokens) take 2 + 2 + 3 pages in one chunk of
    32; the two short ones' next tokens cross into new blocks, and the newest request is preempted for its pages,
    then recomputed: transformers' tokens all the same. The step records, the engine's stats and its log say that
    pages ran out, and `graphserve doctor` reads it from the log."""
    hf, folder = v4_hf
    prompts = random_prompts((8, 8, 12), seed=11)
    want = [hf_greedy(hf, p, 10) for p in prompts]
    monkeypatch.setattr(rank_worker, "latent_page_count", lambda kv, num_blocks, *sizes: 8)
    llm = LLM(str(folder), block_size=4, chunked_prefill_size=32, dtype="float32", max_model_len=256,
              enable_prefix_caching=False)  # fmt: skip
    bm = llm.engine.core.block_manager
    with caplog.at_level(logging.WARNING, logger="graphserve.engine.core"):
        assert engine_greedy(llm, prompts, 10) == want
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and bm.num_usable_blocks > 1000
    bm.check_no_leak()
    assert bm.pages.num_free_pages == 7
    assert stats.num_preemptions_for_pages == stats.num_preemptions and stats.latent_pages_total == 7
    assert stats.latent_pages_used == 0 and stats.latent_pages_idle == 0  # no prefix cache: every page free
    records = llm.engine.core.telemetry.records()
    assert sum(r.preempted_for_pages for r in records) == stats.num_preemptions
    assert all(r.latent_pages_total == 7 and 0 <= r.latent_pages_used <= 7 for r in records)
    assert max(r.latent_pages_used for r in records) == 7  # the step that preempted left every page held
    lines = [r.getMessage() for r in caplog.records if "for want of latent pages" in r.getMessage()]
    assert lines and "of 7 latent pages held by running windows" in lines[0]
    found = {f.kind: f for f in diagnose_lines(lines)}
    assert set(found) == {"latent_pages_short"} and "--max-running-requests" in found["latent_pages_short"].flags[0]


def test_kv_cache_gb_gives_the_plans_blocks_and_pages(v4_hf):
    """--kv-cache-gb's bytes split as the memory plan splits a pool of as many bytes: the windows' latent pages first,
    the blocks at the bytes a token keeps for its whole context the rest. The CPU pool and the GPU cap alike; more
    blocks than the bytes give at the full bytes a token."""
    _, folder = v4_hf
    gb, bs, running, chunk = 0.004, 4, 3, 16
    llm = LLM(str(folder), block_size=bs, chunked_prefill_size=chunk, dtype="float32", max_model_len=256,
              max_running_requests=running, kv_cache_gb=gb)  # fmt: skip
    kv = llm.engine.core.info.kv
    plan = plan_memory(int(gb * (1 << 30)), 1.0, 0, 0, 0, 0, kv.bytes_per_token, bs, 256, running,
                       latent_bytes_per_token=kv.latent_bytes_per_token, latent_window=kv.latent_window,
                       latent_pages=kv.latent_pages_wanted(bs, running, chunk))  # fmt: skip
    assert plan.latent_pages == kv.latent_pages_wanted(bs, running, chunk) == 2 * (3 * 4 + 4) + 1
    bm = llm.engine.core.block_manager
    assert (bm.num_usable_blocks, bm.pages.num_pages) == (plan.num_blocks, plan.latent_pages)
    # 512 of the 1088 B a token are latent: half as many blocks again as at the full bytes
    assert plan.num_blocks > 1.5 * (int(gb * (1 << 30)) // (kv.bytes_per_token * bs))
    # the GPU start-up's cap from the same flag, and the pages beside its blocks
    cfg = EngineConfig(block_size=bs, chunked_prefill_size=chunk, kv_cache_gb=gb)
    cap_blocks = requested_kv_tokens(cfg, kv, running) // bs
    assert cap_blocks == plan.num_blocks
    assert latent_page_count(kv, cap_blocks + 1, bs, running, chunk) == plan.latent_pages
    # start-up's synthetic batches on this runner: its blocks bound them, and its 32 usable pages a batch's rows
    runner = llm.engine.core.runner
    assert synthetic_batch(runner, [1] * 32).num_seqs == 32
    with pytest.raises(ValueError, match="needs 33 latent pages"):
        synthetic_batch(runner, [1] * 33)
    # a budget below the pages wanted: no split, every block keeps its page, on both paths
    small = EngineConfig(block_size=bs, chunked_prefill_size=chunk, kv_cache_gb=30 * bs * kv.bytes_per_token / (1 << 30))
    assert requested_kv_tokens(small, kv, running) == 30 * bs
    assert latent_page_count(kv, 31, bs, running, chunk) == 31
