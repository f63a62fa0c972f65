"""KV blocks outside the window of a running sequence go back to the pool where every layer is windowed: the block
manager and scheduler on their own, the memory plan's count per layer type, and the engine end to end (a tiny
Mistral whose requests outgrow a pool they fit only through their windows, tokens equal to transformers')."""

from __future__ import annotations

import pytest
import torch
from model_utils import engine_greedy, hf_greedy, make_hf_checkpoint, random_prompts, schedule_and_sample
from transformers import MistralConfig, Qwen2Config

from graphserve import LLM, SamplingParams
from graphserve.config import EngineConfig
from graphserve.engine.kv_cache import BlockManager
from graphserve.engine.memory import plan_memory
from graphserve.engine.request import Sequence
from graphserve.engine.scheduler import Scheduler
from graphserve.errors import BadRequestError
from graphserve.kernels.paged_kv import DUMMY_BLOCK
from graphserve.layers.kv_layout import KVLayout

BS, WINDOW = 4, 8


def _scheduler(num_blocks: int, window: int | None = WINDOW, chunk: int = 8, prefix: bool = True) -> Scheduler:
    config = EngineConfig(block_size=BS, chunked_prefill_size=chunk)
    return Scheduler(config, BlockManager(num_blocks, BS, prefix, window=window))


def _seq(rid: str, prompt_len: int, max_tokens: int, base: int = 0) -> Sequence:
    prompt = [(base + i) % 50 + 1 for i in range(prompt_len)]
    return Sequence(rid, 0, prompt, SamplingParams(max_tokens=max_tokens), seed=0, arrival_time=float(base))


_step = schedule_and_sample


def test_blocks_before_the_window_go_back_and_the_table_keeps_its_positions():
    s = _scheduler(num_blocks=32)
    bm = s.block_manager
    a = _seq("a", 20, max_tokens=30)
    s.add(a)
    _step(s)  # 8 of 20 prompt tokens
    _step(s)  # 16: position 8, whose window is 1..8, kept block 0 (positions 0-3)
    assert a.num_released_blocks == 0 and DUMMY_BLOCK not in a.block_table
    _step(s)  # the next step's first token (position 16) sees 9..16: blocks 0 and 1 went back before it ran
    table = list(a.block_table)
    assert table[:2] == [DUMMY_BLOCK] * 2 and DUMMY_BLOCK not in table[2:] and a.num_released_blocks == 2
    for _ in range(20):  # decodes
        computed = a.num_computed_tokens
        _step(s)
        held = [b for b in a.block_table if b != DUMMY_BLOCK]
        # the step's token at position c saw c - 7 .. c: two blocks' worth, cut by block edges, and the new one
        assert len(held) <= WINDOW // BS + 1
        assert a.block_table[: (computed - WINDOW + 1) // BS] == [DUMMY_BLOCK] * ((computed - WINDOW + 1) // BS)
        assert all(bm.ref_counts[b] == 1 for b in held)
    while s.num_unfinished:
        _step(s)
    bm.check_no_leak()
    assert bm.num_released > 0


def test_released_blocks_are_reused_by_another_request():
    """A pool of 7 blocks: a 40-token request (10 blocks) runs through its window, and another request admitted
    while it runs takes the blocks it gave back."""
    s = _scheduler(num_blocks=8, prefix=False)
    bm = s.block_manager
    a = _seq("a", 30, max_tokens=10)
    s.add(a)
    given_back: set[int] = set()  # blocks a gave back (the same ids may come straight back to it, further on)
    for _ in range(4):  # 30 prompt tokens in chunks of 8, then a decode
        before = list(a.block_table)
        _step(s)
        given_back |= {blk for blk, now in zip(before, a.block_table) if blk != now == DUMMY_BLOCK}
    assert len(given_back) >= 4
    b = _seq("b", 9, max_tokens=3, base=20)
    s.add(b)
    _step(s)
    assert set(b.block_table) & given_back, (b.block_table, given_back)
    while s.num_unfinished:
        _step(s)
    assert a.finish_reason == b.finish_reason == "length" and not s.num_preemptions
    bm.check_no_leak()


def test_without_a_window_the_same_request_cannot_fit_and_is_failed():
    s = _scheduler(num_blocks=8, window=None, prefix=False)
    a = _seq("a", 30, max_tokens=10)
    s.add(a)
    while s.num_unfinished:
        out = _step(s)
    assert a.finish_reason == "abort" and out.failed == [a]


def test_released_blocks_stay_in_the_prefix_cache_for_another_request():
    """A released, committed block stays cached (unreferenced): a later request with the same prompt matches the
    whole prefix, then gives back at once what lies before its own window."""
    s = _scheduler(num_blocks=32)
    bm = s.block_manager
    a = _seq("a", 24, max_tokens=2)
    s.add(a)
    for _ in range(3):
        _step(s)
    assert a.num_released_blocks == 2
    while s.num_unfinished:
        _step(s)
    b = _seq("b", 24, max_tokens=2)
    s.add(b)
    out = _step(s)
    assert b.num_cached_tokens == 20  # every full block but the one holding the last prompt token
    assert out.num_prefill_tokens == 4
    assert b.block_table[: (20 - WINDOW + 1) // BS] == [DUMMY_BLOCK] * ((20 - WINDOW + 1) // BS)
    while s.num_unfinished:
        _step(s)
    bm.check_no_leak()


def test_the_memory_plan_counts_per_layer_type():
    all_windowed = KVLayout("kv", 4, 8, 128, torch.bfloat16, (4096,) * 4)
    alternating = KVLayout("kv", 4, 8, 128, torch.bfloat16, (128, None, 128, None))
    full = KVLayout("kv", 4, 8, 128, torch.bfloat16)
    assert all_windowed.release_window == 4096 and alternating.release_window is None and full.release_window is None
    # decode: the window and a block; a prefill chunk of 2048 on top; never more than the sequence
    assert all_windowed.held_tokens(32768, 16) == 4096 + 16
    assert all_windowed.held_tokens(32768, 16, chunk=2048) == 4096 + 2048 + 16
    assert all_windowed.held_tokens(1000, 16, chunk=2048) == 1008
    assert alternating.held_tokens(32768, 16) == full.held_tokens(32768, 16) == 32768
    with pytest.raises(ValueError, match="KVLayout.windows names 2 layers, the cache has 4"):
        KVLayout("kv", 4, 8, 128, torch.bfloat16, (8, 8))
    common = dict(total_bytes=80 << 30, mem_fraction_static=0.9, weights_bytes=15 << 30, activation_bytes=1 << 30,
                  graph_pool_bytes=0, reserve_bytes=1 << 30, kv_bytes_per_token=all_windowed.bytes_per_token,
                  block_size=16, max_model_len=32768, max_running_requests=256)  # fmt: skip
    plain = plan_memory(**common)
    windowed = plan_memory(**common, request_tokens=all_windowed.held_tokens(32768, 16, 2048))
    assert windowed.kv_tokens == plain.kv_tokens
    assert windowed.max_concurrent_at_max_len == min(256, plain.kv_tokens // (4096 + 2048 + 16))
    assert windowed.max_concurrent_at_max_len > plain.max_concurrent_at_max_len
    tight = dict(common, total_bytes=19 << 30)  # 1.1 GiB of KV: 8.8k tokens, not one 32k request
    assert not plan_memory(**tight).fits
    assert plan_memory(**tight, request_tokens=all_windowed.held_tokens(32768, 16, 2048)).fits
    tighter = plan_memory(**dict(tight, total_bytes=int(17.9 * (1 << 30))), request_tokens=6160)
    assert not tighter.fits and "6160 tokens" in tighter.refusal
    assert "lower --chunked-prefill-size" in tighter.refusal and "--max-model-len from" not in tighter.refusal


_TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)


def test_engine_serves_requests_longer_than_its_pool_through_their_windows(tmp_path):
    """A 24-block pool (96 tokens) serves three requests of 52-60 tokens at once (168 tokens in all), each holding
    its window's blocks; greedy tokens equal transformers' generate."""
    hf = make_hf_checkpoint(tmp_path, MistralConfig(**_TINY, sliding_window=WINDOW, rope_theta=10000.0))
    prompts = random_prompts((40, 33, 36), seed=8)
    new_tokens = 20
    expected = [hf_greedy(hf, ids, new_tokens) for ids in prompts]
    llm = LLM(str(tmp_path), block_size=BS, chunked_prefill_size=8, num_kv_tokens=96, dtype="float32")
    assert engine_greedy(llm, prompts, new_tokens) == expected
    core = llm.engine.core
    assert core.block_manager.window == WINDOW and core.block_manager.num_released >= 3 * (52 - WINDOW) // BS - 3
    assert core.scheduler.num_preemptions == 0
    core.block_manager.check_no_leak()
    # a request that could not hold even its window is still refused, by name
    with pytest.raises(BadRequestError, match=r"of which it holds at most 20 at once does not fit the KV pool of 16"):
        engine_greedy(LLM(str(tmp_path), block_size=BS, chunked_prefill_size=8, num_kv_tokens=16, dtype="float32"),
                      prompts[:1], new_tokens)  # fmt: skip


def test_partly_windowed_models_keep_their_blocks(tmp_path):
    """Qwen2 with a full-attention layer beside windowed ones: nothing is released (the full layer reads every
    block), and a request longer than the pool is refused at the edge."""
    make_hf_checkpoint(tmp_path, Qwen2Config(**_TINY, use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=1, rope_theta=10000.0))  # fmt: skip
    llm = LLM(str(tmp_path), block_size=BS, chunked_prefill_size=8, num_kv_tokens=96, dtype="float32")
    assert llm.engine.core.block_manager.window is None
    with pytest.raises(BadRequestError, match=r"= 120 tokens does not fit the KV pool of 96 tokens"):
        llm.generate([{"prompt_token_ids": list(range(4, 104))}], SamplingParams(max_tokens=20), use_tqdm=False)


def test_graphserve_plan_counts_a_windowed_request_by_its_window():
    from graphserve.analysis.plan import build_plan
    from graphserve.models.presets import get_preset_config

    v01, v02 = get_preset_config("mistral-7b-v0.1"), get_preset_config("mistral-7b")
    kw = dict(gpu_memory_gb=80, input_len=30000, output_len=2000, concurrency=[32], chunked_prefill_size=2048)
    windowed, full = build_plan(v01, **kw), build_plan(v02, **kw)
    assert windowed["verdicts"][0]["kv_tokens_needed"] == 32 * (4096 + 2048 + 16)
    assert full["verdicts"][0]["kv_tokens_needed"] == 32 * 32000
    assert windowed["verdicts"][0]["verdict"] == "fits" and full["verdicts"][0]["verdict"] == "preempts"


def test_a_block_released_before_its_commit_is_never_cached():
    """With the overlap schedule a block can leave the window before the step that filled it is read back and
    committed: its hash still chains the later blocks, but no cache entry names the dummy block or the reused id."""
    bm = BlockManager(16, BS, True, window=WINDOW)
    seq = _seq("a", 30, max_tokens=4)
    assert bm.allocate_slots(seq, 24)
    seq.num_computed_tokens = 24
    first = list(seq.block_table)
    assert bm.release_outside_window(seq) == (24 - WINDOW + 1) // BS == 4
    bm.commit(seq)
    assert len(seq.block_hashes) == 6 and DUMMY_BLOCK not in bm.block_hash
    assert set(bm.block_hash) == set(first[4:6])  # only the blocks the sequence still holds
    other = _seq("b", 30, max_tokens=4)
    assert bm.match_prefix(other) == 0  # the chain's first blocks are gone: nothing matches
    bm.free(other)
    bm.free(seq)
    bm.check_no_leak()
