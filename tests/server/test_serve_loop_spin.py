"""The engine loop's idle spin: it sees a message as soon as it lands, gives up after its time, and runs
after a step only when the engine is on a GPU."""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from test_server_hops import OneTokenCore  # noqa: E402

from graphserve import SamplingParams  # noqa: E402
from graphserve.engine import output_router, serve_loop  # noqa: E402
from graphserve.engine.core_driver import CoreDriver  # noqa: E402
from graphserve.engine.messages import AddRequests, Shutdown, StepBatch  # noqa: E402
from graphserve.engine.request import EngineRequest  # noqa: E402
from graphserve.engine.serve_loop import spin_until_message  # noqa: E402


def test_spin_returns_when_a_message_lands_and_gives_up_on_an_empty_queue():
    inbox = multiprocessing.get_context("spawn").Queue()
    t0 = time.monotonic()
    assert spin_until_message(inbox, 0.05) is False
    assert time.monotonic() - t0 >= 0.05
    threading.Timer(0.05, inbox.put, args=("hello",)).start()
    t0 = time.monotonic()
    assert spin_until_message(inbox, 5.0) is True
    assert time.monotonic() - t0 < 2.0
    assert inbox.get(timeout=1) == "hello"


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_serve_spins_after_a_step_only_on_cuda(monkeypatch, device):
    spins: list[float] = []
    monkeypatch.setattr(serve_loop, "spin_until_message", lambda inbox, seconds: spins.append(seconds) or False)
    ctx = multiprocessing.get_context("spawn")
    inbox, queued = ctx.Queue(), ctx.Value("q", 0)
    reader, writer = ctx.Pipe(duplex=False)
    sender = output_router.Sender(writer)
    core = OneTokenCore()
    core.device = torch.device(device)  # the fake stays on the host: only the loop's choice reads this
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    inbox.put(AddRequests([EngineRequest("a#0.0", [1, 2, 3], params, time.monotonic())], frontend=0))
    queued.value = 1
    engine = threading.Thread(target=serve_loop.serve, args=(core, CoreDriver(core), inbox, [sender], [], queued),
                              daemon=True)
    engine.start()
    assert reader.poll(10) and isinstance(reader.recv(), StepBatch)  # the step ran
    inbox.put(Shutdown())
    engine.join(10)
    sender.close()
    assert not engine.is_alive()
    assert spins == ([serve_loop.IDLE_SPIN_S] if device == "cuda" else [])
