"""One request's path through a real server, stage by stage, with the hand-offs between threads counted.

An HTTP completion runs through a server whose engine is on a thread (the client whose whole path is in this
process): the handler hands the request to the engine client, the engine's serve loop admits it and steps the
core, which finishes it; the output processor formats it on the output thread; the loop pushes it into the
request's stream, which the handler reads. Each stage is recorded with the thread it ran on. The path is the
one written below, with three hand-offs (loop -> engine thread -> output thread -> loop): a new hop, or a stage
that moves to another thread, fails here and must be argued for. (The engine-process client adds the engine
process's sender thread and the front-end's pipe reader: five.)
"""

from __future__ import annotations

import threading

import httpx
import pytest

from graphserve.config import EngineConfig
from graphserve.engine.core import EngineCore
from graphserve.engine.core_driver import CoreDriver
from graphserve.engine.output_processor import OutputProcessor
from graphserve.engine.thread_client import ThreadClient
from graphserve.server.frontend import Frontend
from graphserve.server.launch import ServerThread
from graphserve.server.output_pump import OutputPump
from graphserve.server.request_stream import RequestStream

STAGES = [  # (stage, the method that marks it)
    ("HTTP handler -> engine", Frontend, "add_request"),
    ("engine client", ThreadClient, "add"),
    ("serve loop", CoreDriver, "iterate"),
    ("core", EngineCore, "step"),
    ("to the output thread", OutputPump, "push"),
    ("output processor", OutputProcessor, "process"),
    ("to the streams", Frontend, "_deliver"),
    ("stream", RequestStream, "push"),
]
PATH = [(name, where) for (name, _, _), where in zip(STAGES, ["loop", "loop", "engine", "engine", "engine", "output",
                                                              "loop", "loop"])]
HAND_OFFS = 3


@pytest.fixture
def traced(monkeypatch):
    """Record (stage, thread) for every marked call while ``on`` is set."""
    seen: list[tuple[str, str]] = []
    on = threading.Event()
    for name, cls, attr in STAGES:
        real = getattr(cls, attr)

        def marked(*args, _real=real, _name=name, **kwargs):
            if on.is_set():
                seen.append((_name, threading.current_thread().name))
            return _real(*args, **kwargs)

        monkeypatch.setattr(cls, attr, marked)
    return seen, on


def test_a_request_crosses_the_stages_in_order_with_three_hand_offs(traced):
    seen, on = traced
    config = EngineConfig(model="builtin:tiny-llama", max_model_len=256, num_kv_tokens=4096)
    with ServerThread(config, served_model_name="t") as srv:
        loop_thread = srv._thread.name
        on.set()
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": "t", "prompt": "x", "max_tokens": 1},
                       timeout=120)
        on.clear()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    threads = {loop_thread: "loop", "graphserve-engine": "engine", "graphserve-output": "output"}
    # the path up to the stream's first push: idle steps of the serve loop before the request arrived are not on it
    end = next(i for i, (name, _) in enumerate(seen) if name == "stream")
    start = max(i for i, (name, _) in enumerate(seen[:end]) if name == STAGES[0][0])
    path = [(name, threads.get(thread, thread)) for name, thread in seen[start : end + 1]]
    assert path == PATH
    hand_offs = sum(a[1] != b[1] for a, b in zip(path, path[1:]))
    assert hand_offs == HAND_OFFS
