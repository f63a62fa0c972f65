"""The engine loop's idle spin: it sees a message as soon as it lands, and gives up after its time."""

from __future__ import annotations

import multiprocessing
import threading
import time

from graphserve.server.engine_loop import spin_until_message


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
