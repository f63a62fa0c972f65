"""The path of a request between a front-end and the engine loop wakes on events, never on a poll.

Every hop of an idle server's request runs here for real (front-end queue -> engine loop -> its sender thread
-> pipe -> the front-end's reader thread -> output thread -> event loop), around a core that answers each
request with one token. The engine loop's idle poll is set to a minute: a hop that waited for a poll, or a
sleep, would take that long, while event-driven hops take milliseconds even on a loaded machine. Two
front-ends share the engine: each gets its own requests back, and only its own.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from graphserve.config import EngineConfig
from graphserve.engine import output_router, serve_loop
from graphserve.engine.core_driver import CoreDriver
from graphserve.engine.messages import Shutdown, StepBatch
from graphserve.engine.output_processor import OutputProcessor
from graphserve.engine.process_client import EngineChannel, ProcessClient
from graphserve.engine.request import CoreOutput, EngineRequest
from graphserve.models.loader import load_tokenizer
from graphserve.sampling_params import SamplingParams
from graphserve.server.output_pump import OutputPump

POLL_S = 60.0
HOP_BOUND_S = 5.0  # far below POLL_S, far above any thread wake-up


class OneTokenCore:
    """Each request gets token 42 and finishes at the step after it is added."""

    def __init__(self) -> None:
        self.requests: list[EngineRequest] = []
        self.device = torch.device("cpu")  # as EngineCore's: the engine loop spins on its queue only on cuda
        # a prefix cache that never changes: the serve loop drains its events every iteration
        self.block_manager = SimpleNamespace(take_events=list, record_events=lambda: None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, req: EngineRequest) -> None:
        self.requests.append(req)

    def abort_requests(self, ids: list[str]) -> None:
        self.requests = [r for r in self.requests if r.request_id not in ids]

    def step(self) -> list[CoreOutput]:
        out = [CoreOutput(r.request_id, 0, [42], finish_reason="length", first_scheduled_time=time.monotonic())
               for r in self.requests]
        self.requests = []
        return out

    def stats(self) -> Any:
        return SimpleNamespace(waiting=0)


@pytest.fixture
def tokenizer():
    return load_tokenizer("builtin:tiny-llama")


def test_request_path_is_event_driven_for_each_front_end(monkeypatch, tokenizer):
    monkeypatch.setattr(serve_loop, "_IDLE_POLL_S", POLL_S)
    ctx = multiprocessing.get_context("spawn")
    inbox, queued, ready = ctx.Queue(), ctx.Value("q", 0), ctx.Value("i", 0)
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    senders = [output_router.Sender(w, i) for i, (_, w) in enumerate(pipes)]
    core = OneTokenCore()
    engine = threading.Thread(target=serve_loop.serve, args=(core, CoreDriver(core), inbox, senders, [], queued),
                              daemon=True)
    engine.start()
    loop = asyncio.new_event_loop()
    got: list[asyncio.Queue] = []
    links = []
    for i, (r, _) in enumerate(pipes):
        processor = OutputProcessor(tokenizer)
        arrived: asyncio.Queue = asyncio.Queue()
        got.append(arrived)

        def deliver(deltas: list, _failed: dict, arrived: asyncio.Queue = arrived) -> None:
            for d in deltas:
                arrived.put_nowait((time.monotonic(), d))

        pump = OutputPump(processor, loop, deliver)

        def on_message(msg: Any, pump: OutputPump = pump) -> None:
            if isinstance(msg, StepBatch):
                pump.push(msg.outputs, msg.failed)

        link = ProcessClient(EngineConfig(), on_message, lambda code: None,
                             channel=EngineChannel(inbox, r, i, queued, ready, 2))
        link.start()
        links.append((link, processor, pump))

    async def round_trip(frontend: int, serial: int) -> float:
        link, processor, _ = links[frontend]
        engine_id = f"req-{serial}#{frontend}.{serial}"
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        processor.add(engine_id, [1, 2, 3], params)
        with queued.get_lock():  # the front-end's reservation (Frontend._reserve)
            queued.value += params.n
        sent = time.monotonic()
        link.add([EngineRequest(engine_id, [1, 2, 3], params, sent)])
        when, delta = await asyncio.wait_for(got[frontend].get(), POLL_S / 2)
        assert delta.request_id == engine_id and delta.finished
        assert delta.choices[0].token_ids == [42]
        return when - sent

    async def scenario() -> list[float]:
        took = []
        for serial in range(6):
            await asyncio.sleep(0.2)  # idle: the engine loop is blocked on its queue again
            took.append(await round_trip(serial % 2, serial))
        assert all(q.empty() for q in got)  # no front-end received another's request
        return took

    try:
        took = loop.run_until_complete(scenario())
    finally:
        inbox.put(Shutdown())
        engine.join(10)
        for sender in senders:
            sender.close()
        for _, _, pump in links:
            pump.stop()
        loop.close()
    assert not engine.is_alive()
    assert max(took) < HOP_BOUND_S, took
    assert queued.value == 0  # the engine took every reserved sequence off the shared count
