"""A simulated continuous-batching server for the load generator's tests.

One global loop steps every a + b·N ms (N = requests in the step, plus ``--break-ms`` when N exceeds
``--break-at``) and gives every request in the step one token. It speaks /v1/completions,
/v1/chat/completions and /generate (streamed or not), and serves /health, /v1/models, /metrics and
/v1/telemetry like graphserve. With ``--die-above C`` it logs an out-of-memory crash and exits when
more than C requests are in one step, as the eager fallback above the captured sizes once did.

    python tests/support/fake_server.py --port P --a-ms 20 --b-ms 2 [--break-at 8 --break-ms 15] [--die-above C]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import time
from dataclasses import asdict

from aiohttp import web

from graphserve.engine.telemetry import StepRecord


class Slot:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.emitted = 0
        self.queue: asyncio.Queue = asyncio.Queue()


class Sim:
    def __init__(self, args: argparse.Namespace):
        self.a, self.b = args.a_ms, args.b_ms
        self.break_at, self.break_ms, self.die_above = args.break_at, args.break_ms, args.die_above
        self.max_bs, self.log_interval = args.cuda_graph_max_bs, args.log_interval
        self.active: list[Slot] = []
        self.wake = asyncio.Event()
        self.step = 0
        self.records: collections.deque = collections.deque(maxlen=20000)
        self.prompt_tokens = self.generation_tokens = 0
        self.step_sum_s = 0.0

    def step_ms(self, n: int) -> float:
        jump = self.break_ms if self.break_at and n > self.break_at else 0.0
        return self.a + self.b * n + jump

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            if not self.active:
                self.wake.clear()
                await self.wake.wait()
                start = loop.time()
            batch = list(self.active)
            n = len(batch)
            graph = n <= self.max_bs
            if self.die_above and n > self.die_above:
                print(f"Decode batch, #running-req: {n}, #token: {n * 64}, token usage: 0.97, cuda graph: {graph}, "
                      f"gen throughput (token/s): 0.00, #queue-req: 0", flush=True)
                print(f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.94 GiB. GPU 0 has a total "
                      f"capacity of 139.81 GiB of which 2.80 GiB is free. (decode batch {n} > cuda-graph-max-bs "
                      f"{self.max_bs}, eager fallback)", flush=True)
                os._exit(1)
            # Steps run on a deadline clock: the time spent handing out tokens belongs to the step, so
            # the period is a + b·N however busy the event loop is (as long as it keeps up).
            deadline = start + self.step_ms(n) / 1000.0
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            now = loop.time()
            ms = (now - start) * 1000.0
            start = deadline if now - deadline < 0.010 else now
            self.step += 1
            self.step_sum_s += ms / 1000.0
            self.generation_tokens += n
            for slot in batch:
                slot.emitted += 1
                done = slot.emitted >= slot.max_tokens
                slot.queue.put_nowait((slot.emitted, done))
                if done and slot in self.active:
                    self.active.remove(slot)
            self.records.append(StepRecord(
                step=self.step, time=time.time(), kind="decode", batch_size=n, padded_size=n, graph=graph,
                mode="graph" if graph else "eager", num_tokens=n, prefill_tokens=0, decode_tokens=n, step_ms=ms,
                running=len(self.active), waiting=0, kv_usage=min(1.0, len(self.active) / 256)))
            if self.step % self.log_interval == 0:
                print(f"Decode batch, #running-req: {n}, #token: {n * 64}, token usage: {n / 256:.2f}, "
                      f"cuda graph: {graph}, gen throughput (token/s): {n / (ms / 1000.0):.2f}, #queue-req: 0",
                      flush=True)

    def add(self, max_tokens: int, prompt_tokens: int) -> Slot:
        slot = Slot(max(1, max_tokens))
        self.prompt_tokens += prompt_tokens
        self.active.append(slot)
        self.wake.set()
        return slot

    def drop(self, slot: Slot) -> None:
        if slot in self.active:
            self.active.remove(slot)


def _prompt_tokens(body: dict, kind: str) -> int:
    if kind == "native":
        return len(body["input_ids"]) if "input_ids" in body else len(str(body.get("text", "")).split())
    if kind == "chat":
        return sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
    p = body.get("prompt", "")
    return len(p) if isinstance(p, list) else len(str(p).split())


def _sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


def make_handler(sim: Sim, kind: str):
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if kind == "native":
            sp = body.get("sampling_params") or {}
            max_tokens, stream = int(sp.get("max_new_tokens", 16)), bool(body.get("stream", False))
        else:
            max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
            stream = bool(body.get("stream", False))
        ptoks = _prompt_tokens(body, kind)
        slot = sim.add(max_tokens, ptoks)
        text = ""
        try:
            if not stream:
                done = False
                while not done:
                    k, done = await slot.queue.get()
                    text += f" w{k}"
                return web.json_response(_final(kind, text, ptoks, slot.emitted))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            done = False
            while not done:
                k, done = await slot.queue.get()
                piece = f" w{k}"
                text += piece
                await resp.write(_sse(_chunk(kind, piece, text, ptoks, k, "length" if done else None)))
            if kind != "native" and (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": ptoks, "completion_tokens": slot.emitted,
                         "total_tokens": ptoks + slot.emitted}
                await resp.write(_sse({"id": "x", "choices": [], "usage": usage}))
            await resp.write(_sse("[DONE]"))
            return resp
        finally:
            sim.drop(slot)

    return handle


def _chunk(kind: str, piece: str, text: str, ptoks: int, k: int, finish: str | None) -> dict:
    if kind == "native":
        return {"text": text, "meta_info": {"prompt_tokens": ptoks, "completion_tokens": k, "finish_reason":
                                            {"type": finish} if finish else None}}
    if kind == "chat":
        return {"id": "x", "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": finish}]}
    return {"id": "x", "choices": [{"index": 0, "text": piece, "finish_reason": finish}]}


def _final(kind: str, text: str, ptoks: int, n: int) -> dict:
    usage = {"prompt_tokens": ptoks, "completion_tokens": n, "total_tokens": ptoks + n}
    if kind == "native":
        return {"text": text, "meta_info": {"prompt_tokens": ptoks, "completion_tokens": n,
                                            "finish_reason": {"type": "length"}}}
    if kind == "chat":
        return {"id": "x", "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                        "finish_reason": "length"}], "usage": usage}
    return {"id": "x", "choices": [{"index": 0, "text": text, "finish_reason": "length"}], "usage": usage}


def build_app(sim: Sim) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def metrics(_: web.Request) -> web.Response:
        n = len(sim.active)
        text = (f"# TYPE graphserve:num_running_reqs gauge\ngraphserve:num_running_reqs {n}\n"
                f"# TYPE graphserve:num_queue_reqs gauge\ngraphserve:num_queue_reqs 0\n"
                f"# TYPE graphserve:token_usage gauge\ngraphserve:token_usage {n / 256}\n"
                f"# TYPE graphserve:prompt_tokens counter\ngraphserve:prompt_tokens_total {sim.prompt_tokens}\n"
                f"# TYPE graphserve:generation_tokens counter\n"
                f"graphserve:generation_tokens_total {sim.generation_tokens}\n"
                f"# TYPE graphserve:step_time_seconds summary\n"
                f"graphserve:step_time_seconds_sum {sim.step_sum_s}\ngraphserve:step_time_seconds_count {sim.step}\n")
        return web.Response(text=text, content_type="text/plain")

    async def telemetry(request: web.Request) -> web.Response:
        since = int(request.query.get("since", 0))
        return web.json_response({"records": [asdict(r) for r in list(sim.records) if r.step > since]})

    async def start_loop(app: web.Application) -> None:
        app["loop_task"] = asyncio.create_task(sim.run())

    app = web.Application()
    app.on_startup.append(start_loop)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/telemetry", telemetry)
    app.router.add_post("/v1/completions", make_handler(sim, "openai"))
    app.router.add_post("/v1/chat/completions", make_handler(sim, "chat"))
    app.router.add_post("/generate", make_handler(sim, "native"))
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--a-ms", type=float, default=20.0)
    p.add_argument("--b-ms", type=float, default=2.0)
    p.add_argument("--break-at", type=int, default=0)
    p.add_argument("--break-ms", type=float, default=0.0)
    p.add_argument("--die-above", type=int, default=0)
    p.add_argument("--cuda-graph-max-bs", type=int, default=256)
    p.add_argument("--log-interval", type=int, default=20)
    args = p.parse_args()
    print(f"fake server on {args.host}:{args.port}: step = {args.a_ms} + {args.b_ms}*N ms", flush=True)
    web.run_app(build_app(Sim(args)), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()


class FakeServer:
    """Test helper: ``with FakeServer("--b-ms", "2") as url:`` runs this file as a subprocess."""

    def __init__(self, *extra: str):
        self.extra = extra
        self.proc = None

    def __enter__(self) -> str:
        import socket
        import subprocess
        import sys
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, __file__, "--port", str(port), *self.extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    return url
            except OSError:
                time.sleep(0.05)
        self.proc.kill()
        raise RuntimeError("fake server did not start")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)
