"""The routing policy on synthetic and real cache-event streams, the block pool's events, the server's event log."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from graphserve.engine.kv_cache import CLEARED, REMOVED, STORED, BlockManager
from graphserve.engine.request import Sequence
from graphserve.engine.routing_policy import PrefixIndex, RoutingPolicy, block_hashes
from graphserve.router.workers import WorkerPool
from graphserve.sampling_params import SamplingParams
from graphserve.server.cache_events import HASH_PROBE, CacheEventLog

BS = 4


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(), seed=0, arrival_time=0.0)


def _prefill(bm: BlockManager, seq: Sequence) -> bool:
    bm.match_prefix(seq)
    if not bm.allocate_slots(seq, seq.num_pending_tokens):
        bm.free(seq)
        return False
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return True


def test_index_fed_by_block_pool_events_is_the_pool_cache_exactly():
    """Random prompts sharing prefixes through a small pool (evictions) and a flush: after every operation the
    index built from the events alone holds the pool's cached hashes, and predicts its prefix hits."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=12, block_size=BS)
    bm.record_events()
    index = PrefixIndex(BS)
    stems = [[rng.randrange(1000) for _ in range(3 * BS)] for _ in range(4)]
    live: list[Sequence] = []
    kinds: set[str] = set()
    for step in range(80):
        tokens = rng.choice(stems)[: rng.randrange(1, 3 * BS)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]
        probe = _seq(tokens)
        predicted = index.match(block_hashes(tokens, BS))
        hit = bm.match_prefix(probe)
        assert hit == predicted * BS, f"step {step}: the pool hit {hit} tokens, the index predicted {predicted} blocks"
        bm.free(probe)
        seq = _seq(tokens)
        if _prefill(bm, seq):
            live.append(seq)
        if len(live) > 2 or rng.random() < 0.3:
            bm.free(live.pop(0))
        if step == 50:
            bm.reset_prefix_cache()
        events = bm.take_events()
        kinds |= {e[0] for e in events}
        index.apply(events)
        assert index.hashes == set(bm.cached), f"step {step}"
    assert kinds == {STORED, REMOVED, CLEARED}  # the walk exercised every kind of event


def test_record_events_starts_with_what_is_cached_and_stored_events_chain():
    bm = BlockManager(num_blocks=16, block_size=BS)
    _prefill(bm, _seq(list(range(2 * BS + 1))))  # cached before recording (a warm-up)
    bm.record_events()
    seeded = bm.take_events()
    assert {e[1] for e in seeded} == set(bm.cached) and len(seeded) == 2
    tokens = [7] * (3 * BS + 2)
    _prefill(bm, _seq(tokens))
    stored = bm.take_events()
    hashes = block_hashes(tokens, BS)
    assert [e[1] for e in stored] == hashes[:3]
    assert [e[2] for e in stored[1:]] == hashes[:2]  # each names its parent
    assert bm.take_events() == []


def test_prefix_index_synthetic_stream_and_refusal():
    index = PrefixIndex(BS)
    index.apply([(STORED, 1, 0), (STORED, 2, 1), (STORED, 3, 2), (STORED, 9, 8)])
    assert index.match([1, 2, 3, 4]) == 3
    index.apply([(REMOVED, 2)])
    assert index.match([1, 2, 3]) == 1  # a block without its parent is never served
    assert index.match([9]) == 1
    index.apply([(CLEARED,)])
    assert len(index) == 0
    with pytest.raises(ValueError, match="unknown kind 'moved'"):
        index.apply([("moved", 1)])


def test_longest_prefix_wins_over_load_and_ties_go_to_least_loaded():
    policy = RoutingPolicy(["a", "b", "c"], block_size=BS)
    prompt = [random.Random(1).randrange(1000) for _ in range(4 * BS + 1)]
    h = block_hashes(prompt, BS)
    policy.apply("a", [(STORED, x, None) for x in h[:1]])
    policy.apply("b", [(STORED, x, None) for x in h[:3]])
    policy.apply("c", [(STORED, x, None) for x in h[:3]])
    load = {"a": 0, "b": 5, "c": 2}
    choice = policy.choose([prompt], ["a", "b", "c"], load)
    assert (choice.replica, choice.hit_blocks, choice.by_prefix) == ("c", 3, True)  # b ties c, c less loaded
    assert policy.choose([prompt], ["a", "b"], load).replica == "b"  # c down: 3 blocks beat a's 1 and idle
    other = [5] * (2 * BS + 1)
    choice = policy.choose([other], ["a", "b", "c"], load)
    assert (choice.replica, choice.by_prefix) == ("a", False)  # no hit: least loaded
    # equal and idle: in turn
    assert {policy.choose([other], ["a", "c"], {}).replica for _ in range(4)} == {"a", "c"}
    # a batched request sums its prompts' hits
    assert policy.choose([prompt, prompt], ["a", "b"], {}).hit_blocks == 6
    with pytest.raises(ValueError, match="no replica"):
        policy.choose([prompt], [], {})


def test_replicas_with_other_block_sizes_hash_with_their_own():
    policy = RoutingPolicy()
    policy.add("small", block_size=BS)
    policy.add("big", block_size=2 * BS)
    prompt = list(range(4 * BS + 1))
    policy.apply("big", [(STORED, x, None) for x in block_hashes(prompt, 2 * BS)])
    policy.apply("small", [(STORED, x, None) for x in block_hashes(prompt, BS)[:1]])
    hits = policy.hits([prompt], ["small", "big"])
    assert hits == {"small": 1, "big": 2}


def test_event_log_serials_snapshots_and_long_poll():
    log = CacheEventLog(max_events=4)
    assert log.read(-1) == {"snapshot": [], "events": [], "next": 0}
    log.extend([(STORED, 1, 0), (STORED, 2, 1)])
    assert log.read(0) == {"events": [["stored", 1, 0], ["stored", 2, 1]], "next": 2}
    assert log.read(2) == {"events": [], "next": 2}
    log.extend([(REMOVED, 1), (STORED, 3, 2), (STORED, 4, 3)])  # serial 1 falls out of the ring
    assert log.read(0) == {"snapshot": [2, 3, 4], "events": [], "next": 5}
    assert log.read(1)["events"] == [["stored", 2, 1], ["removed", 1], ["stored", 3, 2], ["stored", 4, 3]]
    assert "snapshot" in log.read(99)  # a serial of another epoch

    async def poll() -> tuple[dict, dict]:
        timer = threading.Timer(0.05, log.extend, [[(CLEARED,)]])  # the engine's side is another thread
        timer.start()
        woken = await asyncio.wait_for(log.wait(5, timeout=5.0), 2.0)
        idle = await log.wait(6, timeout=0.05)
        return woken, idle

    woken, idle = asyncio.run(poll())
    assert woken == {"events": [["cleared"]], "next": 6}
    assert idle == {"events": [], "next": 6}
    assert log.cached == set()


def test_worker_pool_follows_snapshots_events_and_restarts():
    policy = RoutingPolicy()
    pool = WorkerPool(["http://w"], "builtin:tiny-llama", client=None, policy=policy)  # type: ignore[arg-type]
    w = pool.workers[0]
    base = {"hash_probe": HASH_PROBE, "block_size": BS}
    pool._apply(w, {**base, "epoch": "e1", "snapshot": [1, 2], "events": [], "next": 3})
    pool._apply(w, {**base, "epoch": "e1", "events": [["stored", 5, 2], ["removed", 1]], "next": 5})
    assert policy.indexes["http://w"].hashes == {2, 5} and w.since == 5 and w.events == 2
    # a restarted worker (new epoch) answering a stale serial with events: ask again for a snapshot
    pool._apply(w, {**base, "epoch": "e2", "events": [["stored", 7, 0]], "next": 9})
    assert w.since == -1 and policy.indexes["http://w"].hashes == {2, 5}
    pool._apply(w, {**base, "epoch": "e2", "snapshot": [7], "events": [], "next": 9})
    assert policy.indexes["http://w"].hashes == {7} and w.since == 9


def test_a_busy_holder_loses_its_prefix_past_the_balance_threshold():
    prompt = list(range(3 * BS + 1))
    for threshold, load, expected in ((2, {"a": 2, "b": 0}, "a"), (2, {"a": 3, "b": 0}, "b"),
                                      (None, {"a": 100, "b": 0}, "a"), (0, {"a": 1, "b": 1}, "a")):
        policy = RoutingPolicy(["a", "b"], block_size=BS, balance_threshold=threshold)
        policy.apply("a", [(STORED, h, None) for h in block_hashes(prompt, BS)])
        choice = policy.choose([prompt], ["a", "b"], load)
        assert choice.replica == expected, (threshold, load)
        assert choice.by_prefix == (expected == "a")
    with pytest.raises(ValueError, match="balance_threshold=-1"):
        RoutingPolicy(balance_threshold=-1)


def test_router_flags_and_mismatched_workers_are_refused_by_name():
    import argparse

    from graphserve.errors import ConfigError
    from graphserve.router.launch import add_arguments, check_args, check_models

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ok = parser.parse_args(["--worker", "http://h1:30001/", "--worker", "http://h2:30001"])
    assert check_args(ok) == ["http://h1:30001", "http://h2:30001"]
    for argv, message in ((["--worker", "h1:30001"], "--worker='h1:30001' is invalid"),
                          (["--worker", "http://h:1", "--worker", "http://h:1/"], "given twice"),
                          (["--worker", "http://h:1", "--balance-threshold", "-1"], "--balance-threshold=-1"),
                          (["--worker", "http://h:1", "--health-interval", "0"], "--health-interval=0.0")):
        with pytest.raises(ConfigError, match=message):
            check_args(parser.parse_args(argv))
    assert check_models({"http://a": "builtin:tiny-llama", "http://b": "builtin:tiny-llama"}) == "builtin:tiny-llama"
    with pytest.raises(ConfigError, match="http://a serves model='m1' but --worker http://b serves model='m2'"):
        check_models({"http://a": "m1", "http://b": "m2"})


def test_a_dropped_worker_forgets_its_index_until_a_fresh_snapshot():
    policy = RoutingPolicy()
    pool = WorkerPool(["http://w"], "m", client=None, policy=policy)  # type: ignore[arg-type]
    w = pool.workers[0]
    base = {"hash_probe": HASH_PROBE, "block_size": BS, "epoch": "e1"}
    pool._apply(w, {**base, "snapshot": [1, 2], "events": [], "next": 3})
    pool.mark_dead(w, "connection refused")
    assert policy.indexes["http://w"].hashes == set() and w.since == -1
    pool._apply(w, {**base, "events": [["stored", 4, 2]], "next": 4})  # a poll sent before the drop
    assert policy.indexes["http://w"].hashes == set() and w.since == -1
    pool._apply(w, {**base, "snapshot": [1, 2, 4], "events": [], "next": 4})
    assert policy.indexes["http://w"].hashes == {1, 2, 4} and w.since == 4
