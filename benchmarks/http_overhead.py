"""What the HTTP server costs: the same workload through `LLM.generate` and through /v1/completions.

Workload: ``--num-prompts`` random token-id prompts of ``--input-len`` tokens, ``--output-len`` greedy
tokens each with ignore_eos, so both paths generate exactly the same number of tokens. The HTTP side is a
plain asyncio client keeping ``--concurrency`` streamed requests in flight against a `graphserve serve`
subprocess (its own interpreter, as in production) or, with ``--in-process``, a ServerThread. It runs streamed and
non-streamed requests; each ratio is HTTP output tok/s over offline output tok/s: 1.0 means the server adds
nothing.

Run: python3 -m benchmarks.http_overhead [--model dummy:qwen3-0.6b] [--engine-args "--max-model-len 2048"]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import torch

from benchmarks.common import print_table, write_result
from graphserve import LLM, SamplingParams
from graphserve.config import EngineConfig, add_engine_args, config_from_args


def workload(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(input_len)] for _ in range(n)]


def engine_config(model: str, engine_args: str, concurrency: int) -> tuple[EngineConfig, str]:
    """The config both paths use, and its flags for the server. The running batch is capped at the client's
    concurrency (unless given), so LLM.generate cannot batch wider than HTTP and the ratio compares like with like."""
    if "--max-running-requests" not in engine_args:
        engine_args = f"{engine_args} --max-running-requests {concurrency}".strip()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(shlex.split(engine_args)), model), engine_args


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_offline(config: EngineConfig, args: argparse.Namespace) -> tuple[float, int, list[list[int]]]:
    """(seconds, output tokens, the prompts) of LLM.generate over the whole workload."""
    kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "model"}
    llm = LLM(config.model, **kwargs)
    prompts = workload(args.num_prompts, args.input_len, llm.engine.info.vocab_size)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
    sync()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the server needs the memory back
    return seconds, tokens, prompts


async def one_request(client: httpx.AsyncClient, prompt: list[int], output_len: int, stream: bool) -> int:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    if not stream:
        resp = await client.post("/v1/completions", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()["usage"]["completion_tokens"]
    body.update(stream=True, stream_options={"include_usage": True})
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"stream failed: {event['error']}")
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return tokens


async def run_client(base_url: str, prompts: list[list[int]], output_len: int, concurrency: int,
                     stream: bool) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as client:
        await asyncio.gather(*(one_request(client, p, output_len, stream) for p in prompts[:4]))  # warm-up
        sem = asyncio.Semaphore(concurrency)

        async def bounded(p: list[int]) -> int:
            async with sem:
                return await one_request(client, p, output_len, stream)

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(bounded(p) for p in prompts))
        return time.perf_counter() - t0, sum(counts)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server(config: EngineConfig, args: argparse.Namespace) -> Iterator[str]:
    """The base URL of a server with the same engine config: a subprocess, or a thread with --in-process."""
    if args.in_process:
        from graphserve.server.launch import ServerThread

        with ServerThread(config) as srv:
            yield srv.base_url
        return
    port = free_port()
    cmd = [sys.executable, "-m", "graphserve.cli", "serve", config.model, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *shlex.split(args.engine_args)]
    proc = subprocess.Popen(cmd)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in 900 s")
            time.sleep(0.2)
        yield base_url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--engine-args", default="", help="engine flags for both paths, e.g. '--max-model-len 2048'")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--in-process", action="store_true", help="serve from a thread of this process")
    args = p.parse_args()
    config, args.engine_args = engine_config(args.model, args.engine_args, args.concurrency)

    off_s, off_tokens, prompts = run_offline(config, args)
    http: dict[str, tuple[float, int]] = {}
    with server(config, args) as base_url:
        for stream in (True, False):
            name = "stream" if stream else "non-stream"
            http[name] = asyncio.run(run_client(base_url, prompts, args.output_len, args.concurrency, stream))
            if http[name][1] != off_tokens:
                raise RuntimeError(f"HTTP {name} generated {http[name][1]} tokens, offline {off_tokens}")
    off_tps = off_tokens / off_s
    rows = [{"path": "LLM.generate", "requests": len(prompts), "out tokens": off_tokens, "seconds": off_s,
             "out tok/s": off_tps, "ratio": 1.0}]
    for name, (seconds, tokens) in http.items():
        rows.append({"path": f"HTTP {name} c={args.concurrency}", "requests": len(prompts), "out tokens": tokens,
                     "seconds": seconds, "out tok/s": tokens / seconds, "ratio": tokens / seconds / off_tps})
    print(f"model={args.model} input_len={args.input_len} output_len={args.output_len} "
          f"server={'thread' if args.in_process else 'subprocess'}")
    print_table(rows, ["path", "requests", "out tokens", "seconds", "out tok/s", "ratio"])
    path = write_result("http_overhead", {
        "model": args.model, "engine_args": args.engine_args, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency,
        "server": "thread" if args.in_process else "subprocess",
        "offline": {"seconds": off_s, "output_tokens": off_tokens, "output_tok_s": off_tps},
        **{f"http_{name.replace('-', '_')}": {"seconds": sec, "output_tokens": tok, "output_tok_s": tok / sec,
                                              "ratio_to_offline": tok / sec / off_tps}
           for name, (sec, tok) in http.items()},
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
