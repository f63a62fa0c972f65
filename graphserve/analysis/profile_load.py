"""Load for `graphserve profile` through a server: a batch of streams held open in decode while the
server profiles its steps."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from graphserve.errors import ServiceUnavailableError


class HeldStreams:
    """``batch_size`` streamed /generate requests with ignore_eos, each replaced when it finishes, closed (so
    aborted) on exit."""

    def __init__(self, base_url: str, batch_size: int, input_len: int, max_tokens: int, seed: int = 0):
        self.url = base_url.rstrip("/") + "/generate"
        rng = random.Random(seed)
        # Small ids exist in every vocabulary; the content of the prompt does not matter to a step's cost.
        self.bodies = [{"input_ids": [rng.randrange(5, 200) for _ in range(input_len)], "stream": True,
                        "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}}
                       for _ in range(batch_size)]
        self.chunks = [0] * batch_size
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._hold, args=(i,), daemon=True) for i in range(batch_size)]

    def _hold(self, i: int) -> None:
        """Keep stream ``i`` decoding until exit: a request that reaches its token limit before the profile has
        its steps (a fast server, a small model) is replaced at once, so the profile never waits on no load."""
        import httpx

        try:
            while not self._stop.is_set():
                with httpx.stream("POST", self.url, json=self.bodies[i], timeout=None) as r:
                    if r.status_code != 200:
                        self.errors.append(f"HTTP {r.status_code}: {r.read()[:200]!r}")
                        return
                    for line in r.iter_lines():
                        if line.startswith("data:") and "[DONE]" not in line:
                            self.chunks[i] += 1
                        if self._stop.is_set():
                            return  # leaving the stream closes it: the server aborts the request
        except Exception as exc:  # noqa: BLE001 - reported by wait_decoding
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def wait_decoding(self, timeout_s: float) -> None:
        """Until every stream has had two chunks: all prompts prefilled, the whole batch in decode."""
        deadline = time.monotonic() + timeout_s
        while min(self.chunks) < 2:
            if self.errors:
                raise ServiceUnavailableError(f"a held request failed: {self.errors[0]}")
            if time.monotonic() > deadline:
                raise ServiceUnavailableError(f"only {sum(c >= 2 for c in self.chunks)} of {len(self.chunks)} held "
                                              f"requests were decoding after {timeout_s:.0f} s")
            time.sleep(0.02)

    def __enter__(self) -> HeldStreams:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
