"""POST /v1/profile (only with --enable-profile-endpoint): profile the engine's next N decode steps.

The request waits until the engine has run them under whatever load the server has (the engine runs
no step without requests), then answers with the profile (engine/step_profiler.py). When no steps come
within ``timeout`` seconds the profile is cancelled and the caller gets a 503 that says why.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from graphserve.engine.messages import ProfileSteps
from graphserve.errors import InternalError, OverloadedError, ServiceUnavailableError, bad_field

MAX_STEPS = 1000
MAX_TIMEOUT_S = 3600.0


class ProfileBroker:
    """The server's side: one profile at a time, asked of the engine through its client."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._tokens = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}

    async def profile(self, steps: int, timeout_s: float) -> dict:
        if not 1 <= steps <= MAX_STEPS:
            raise bad_field("steps", steps, f"must be between 1 and {MAX_STEPS}")
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise bad_field("timeout", timeout_s, f"must be > 0 and <= {MAX_TIMEOUT_S:.0f} seconds")
        if self._waiting:
            raise OverloadedError("a profile is already running: wait for it", retry_after=timeout_s)
        loop = asyncio.get_running_loop()
        token = next(self._tokens)
        fut = loop.create_future()
        self._waiting[token] = fut
        self.engine.client.profile(ProfileSteps(token, steps))
        try:
            result = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            self.engine.client.profile(ProfileSteps(token, 0))
            raise ServiceUnavailableError(
                f"{steps} decode steps did not run within timeout={timeout_s:g} s: the profile needs load on the "
                f"server (send requests, or run `graphserve profile --batch-size B`, which holds B requests)",
                retry_after=1) from None
        finally:
            self._waiting.pop(token, None)
        if "error" in result and not result.get("phases"):
            if result.get("code") == 429:
                raise OverloadedError(result["error"], retry_after=timeout_s)
            raise InternalError(result["error"])
        return result

    def on_result(self, msg: ProfileSteps) -> None:
        """A client thread: the engine answered."""
        loop = self.engine._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._resolve, msg.token, msg.result)

    def _resolve(self, token: int, result: dict | None) -> None:
        fut = self._waiting.get(token)
        if fut is not None and not fut.done():
            fut.set_result(result or {"error": "the engine sent no profile"})
