"""Scheduler policy on its own: a fake 'model' samples a fixed token; no tensors involved."""

from __future__ import annotations

from model_utils import apply_sampled, sample_and_finish, schedule_and_sample

from graphserve.config import EngineConfig
from graphserve.engine.kv_cache import BlockManager
from graphserve.engine.request import Sequence, SequenceStatus
from graphserve.engine.scheduler import Scheduler
from graphserve.sampling_params import SamplingParams

BS = 4


def _make(num_blocks=64, chunk=16, max_running=None, prefix=True) -> Scheduler:
    config = EngineConfig(block_size=BS, chunked_prefill_size=chunk, max_running_requests=max_running)
    return Scheduler(config, BlockManager(num_blocks, BS, prefix))


def _seq(rid: str, prompt_len: int, max_tokens: int = 4, t: float = 0.0, index=0, parent=None, base=0) -> Sequence:
    prompt = [(base + i) % 50 + 1 for i in range(prompt_len)]
    return Sequence(rid, index, prompt, SamplingParams(max_tokens=max_tokens), seed=0, arrival_time=t, parent=parent)


_step = schedule_and_sample
_apply = sample_and_finish


def _drain(s: Scheduler, limit: int = 500) -> list:
    outs = []
    while s.num_unfinished and len(outs) < limit:
        outs.append(_step(s))
    assert not s.num_unfinished, "scheduler did not converge"
    return outs


def test_decodes_first_then_prefill_under_budget():
    s = _make(chunk=16)
    a = _seq("a", 6, t=0)
    s.add(a)
    first = _step(s)
    assert first.kind == "prefill" and first.num_prefill_tokens == 6
    b, c = _seq("b", 12, t=1, base=10), _seq("c", 12, t=2, base=30)
    s.add(b)
    s.add(c)
    out = _step(s)
    assert out.kind == "mixed"
    assert [x.seq.request_id for x in out.scheduled] == ["a", "b", "c"]
    assert [x.num_new_tokens for x in out.scheduled] == [1, 12, 4]  # c gets what is left of 16
    out = _step(s)
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 1), ("c", 8)]
    _drain(s)
    s.block_manager.check_no_leak()


def test_chunked_prefill_samples_only_at_the_end():
    s = _make(chunk=16)
    a = _seq("a", 40, max_tokens=2)
    s.add(a)
    sizes = []
    for _ in range(3):
        out = _step(s)
        sizes.append(out.scheduled[0].num_new_tokens)
        assert a.num_output_tokens == (1 if len(sizes) == 3 else 0)
    assert sizes == [16, 16, 8]
    _drain(s)
    s.block_manager.check_no_leak()


def test_max_running_requests_is_respected():
    s = _make(max_running=2, chunk=64)
    for i in range(5):
        s.add(_seq(str(i), 3, max_tokens=3, t=i))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.running) == 2 and len(s.waiting) == 3
    apply_sampled(s, out, [7, 7])
    _drain(s)
    s.block_manager.check_no_leak()


def test_preemption_recomputes_newest_and_oldest_progresses():
    # 6 usable blocks of 4 tokens; two sequences that each end at 4 blocks cannot both fit.
    s = _make(num_blocks=7, chunk=16, prefix=False)
    old, new = _seq("old", 8, max_tokens=8, t=0), _seq("new", 8, max_tokens=8, t=1, base=20)
    s.add(old)
    s.add(new)
    outs = _drain(s)
    preempted = [p for o in outs for p in o.preempted]
    assert preempted and all(p is new for p in preempted)
    assert s.num_preemptions == len(preempted)
    assert old.num_output_tokens == 8 and new.num_output_tokens == 8
    # the preempted sequence kept its outputs and re-prefilled prompt + outputs
    assert max(o.num_prefill_tokens for o in outs[2:]) > 8
    s.block_manager.check_no_leak()


def test_preempted_sequence_goes_to_the_front_of_waiting():
    s = _make(num_blocks=5, chunk=16, prefix=False)
    a, b, c = _seq("a", 8, max_tokens=9, t=0), _seq("b", 8, max_tokens=9, t=1, base=10), _seq("c", 3, t=2)
    s.add(a)
    s.add(b)
    _step(s)  # a and b prefilled: 4 blocks in use, pool full
    s.add(c)
    out = _step(s)  # a and b decode into new blocks: b is preempted for a
    assert out.preempted == [b]
    assert list(s.waiting)[:2] == [b, c] and b.status == SequenceStatus.WAITING
    assert b.num_output_tokens == 1 and b.block_table == [] and b.num_computed_tokens == 0
    _drain(s)
    s.block_manager.check_no_leak()


def test_sequence_too_big_for_the_pool_fails_instead_of_looping():
    s = _make(num_blocks=3, chunk=16)  # 8 tokens of KV in all
    big = _seq("big", 6, max_tokens=10)
    s.add(big)
    outs = _drain(s)
    failed = [f for o in outs for f in o.failed]
    assert failed == [big] and big.finish_reason == "abort"
    assert "KV blocks" in big.error and "--num-kv-tokens" in big.error
    s.block_manager.check_no_leak()
    huge = _seq("huge", 20)
    s.add(huge)
    out = s.schedule()
    assert out.failed == [huge] and not s.num_unfinished


def test_abort_frees_blocks_of_running_and_waiting():
    s = _make(max_running=1)
    a, b = _seq("a", 9, t=0), _seq("b", 9, t=1)
    s.add(a)
    s.add(b)
    _step(s)
    assert s.abort("a") == [a] and s.abort("b") == [b]
    assert not s.num_unfinished
    s.block_manager.check_no_leak()


def test_siblings_wait_for_the_first_prompt_then_hit_the_prefix_cache():
    s = _make(chunk=16)
    first = _seq("r", 13, max_tokens=2)
    second = _seq("r", 13, max_tokens=2, index=1, parent=first)
    s.add(first)
    s.add(second)
    out = s.schedule()
    assert [x.seq for x in out.scheduled] == [first]
    apply_sampled(s, out, [7])
    out = s.schedule()
    assert second in [x.seq for x in out.scheduled]
    assert second.num_cached_tokens == 12 and second.block_table[:3] == first.block_table[:3]
    _apply(s, out)
    _drain(s)
    s.block_manager.check_no_leak()
