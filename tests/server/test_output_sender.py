"""The engine's sender to a front-end's pipe: written by the step loop while the pipe has room, by its thread
(batches merged, order kept) while the front-end is behind, and never blocking the caller either way."""

from __future__ import annotations

import copy
import multiprocessing
import random
import threading

from graphserve.engine.messages import ProfileSteps, StepBatch
from graphserve.engine.output_router import Sender
from graphserve.engine.step_outputs import StepOutputs
from graphserve.engine.telemetry import EngineStats


def _stats(step: int) -> EngineStats:
    return EngineStats(running=step, waiting=0, kv_usage=0.5, prefix_cache_hit_rate=0.0, num_preemptions=0,
                       prompt_tokens_total=step, generation_tokens_total=step)


def _batch(rng: random.Random, step: int, rows: int) -> StepBatch:
    flat = StepOutputs()
    for r in range(rows):
        flat.request_ids.append(f"req-{rng.randrange(10**9)}#{step}.{r}")
        flat.indices.append(rng.randrange(4))
        flat.token_ids.append(rng.randrange(150000))
    flat.finishes[rows - 1] = ("length", None)
    flat.logprobs[0] = (rng.uniform(-5.0, 0.0), [(rng.randrange(150000), rng.uniform(-9.0, 0.0))])
    return StepBatch(flat, {f"failed-{step}": "boom"}, _stats(step), [], [])


def _pipe():
    return multiprocessing.get_context("spawn").Pipe(duplex=False)


def _columns(batches: list[StepBatch]) -> tuple[list, list, list, dict, dict, dict]:
    """Every batch's rows as one StepOutputs would hold them, merged in order (as StepBatch.merge does)."""
    merged = StepOutputs()
    failed: dict[str, str] = {}
    for b in batches:
        merged.extend(b.outputs)
        failed.update(b.failed)
    return merged.request_ids, merged.indices, merged.token_ids, merged.finishes, merged.logprobs, failed


def test_batches_and_messages_arrive_whole_and_in_order_while_the_front_end_keeps_up():
    rng = random.Random(0)
    reader, writer = _pipe()
    sender = Sender(writer)
    got = []
    for step in range(20):
        batch = _batch(rng, step, rows=rng.randrange(1, 80))
        sender.put(batch)
        received = reader.recv()  # Connection.recv reads what the sender framed
        assert isinstance(received, StepBatch)
        assert _columns([received]) == _columns([batch])
        assert received.stats == batch.stats
        got.append(received)
    sender.send_message(ProfileSteps(token=7, steps=3, result={"ok": True}))
    answer = reader.recv()
    assert isinstance(answer, ProfileSteps) and (answer.token, answer.result) == (7, {"ok": True})
    sender.close()
    assert not sender.broken


def test_a_front_end_that_stops_reading_never_blocks_the_step_loop_and_loses_nothing():
    rng = random.Random(1)
    reader, writer = _pipe()
    sender = Sender(writer)
    # each batch pickles to tens of KiB: the pipe (64 KiB on Linux) fills within a few puts
    batches = [_batch(rng, step, rows=2000) for step in range(12)]
    done = threading.Event()

    def step_loop() -> None:
        for step, batch in enumerate(batches):
            sender.put(copy.deepcopy(batch))  # a pending batch merges later ones in place, as the loop's own do
            if step == 5:
                sender.send_message(ProfileSteps(token=1, steps=2))  # queued behind the batches put so far
        done.set()

    loop = threading.Thread(target=step_loop, daemon=True)
    loop.start()
    assert done.wait(30), "the sender blocked its caller on a full pipe"
    received = []
    while len(received) < 2 or not isinstance(received[-1], StepBatch) or \
            received[-1].stats.running != len(batches) - 1:
        assert reader.poll(30), "the sender stopped before the last batch"
        received.append(reader.recv())
    profile_at = [i for i, m in enumerate(received) if isinstance(m, ProfileSteps)]
    assert len(profile_at) == 1
    before, after = received[:profile_at[0]], received[profile_at[0] + 1:]
    # merged batches: the rows of the first six puts come before the message, the others after it
    assert _columns(before) == _columns(batches[:6])
    assert _columns(after) == _columns(batches[6:])
    assert len(received) - 1 < len(batches), "batches put while the thread wrote were not merged"
    assert not reader.poll(0.05)
    sender.close()


def test_a_front_end_that_is_gone_marks_the_sender_broken_without_raising():
    rng = random.Random(2)
    reader, writer = _pipe()
    sender = Sender(writer)
    sender.put(_batch(rng, 0, rows=3))
    assert isinstance(reader.recv(), StepBatch)
    reader.close()
    for step in range(1, 4):
        sender.put(_batch(rng, step, rows=3))
    assert sender.broken
    sender.send_message(ProfileSteps(token=2, steps=1))  # dropped, as a gone front-end's messages are
    sender.close()
