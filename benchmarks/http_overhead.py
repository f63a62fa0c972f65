"""What the HTTP server costs: the same workload through `LLM.generate` and through /v1/completions.

Workload: ``--num-prompts`` random token-id prompts of ``--input-len`` tokens, ``--output-len`` greedy tokens
each with ignore_eos, so both paths generate exactly the same tokens. The HTTP side is the every-event client
(a connection per request, every SSE event parsed as it arrives, as SGLang's bench_serving reads), spread over
one client process per 64 streams so the client is never the limit, against a `graphserve serve` subprocess.
Each ratio is HTTP output tok/s over offline output tok/s at the same concurrency: 1.0 means the server adds
nothing (target >= 0.9). The offline engine runs with the running batch capped at that concurrency.

Each model's HTTP side runs once per ``--api-server-count`` given (e.g. ``--api-server-count 1 4``: one HTTP
front-end process, then four sharing the engine), against the same offline baseline.

Per model and server it also measures, on the freshly started server:
- ready-warm: TTFT p99 of the first 32 requests after /health turned 200 vs the next 256 (mixed prompt lengths
  and sampling knobs; target <= 2x);
- idle TTFT: a 256-token prompt over HTTP vs the engine's own time for that prefill, its prefill step's
  step_ms (target <= 1.2x + 2 ms).

Each throughput row also carries the engine's own view of the run, from its step records over the run's wall
window (offline: the engine's telemetry; HTTP: the server's ``--step-log``): ``steps``, ``busy`` (summed
step_ms over the wall time: below 1 the engine sat idle, waiting for work), ``mean_batch`` and ``full_after_s``
(when the running batch first reached the concurrency). Side by side they say whether an HTTP shortfall is the
engine waiting on the server, or the engine running a different schedule (e.g. a slower admission ramp).

``--engine-cpus 0`` gives the engines a CPU of their own: the offline one runs there, the server's too
(GRAPHSERVE_ENGINE_CPUS), its front-ends and the client processes on the other CPUs. Against a run without it, it
says whether the server's prefill and mixed steps, whose eager launches wait on the host, lose time to a core
shared with the front-end and clients (the ``other_launch_ms`` of each row's step timelines).

Run: python3 -m benchmarks.http_overhead [--models dummy:qwen3-0.6b dummy:llama3-8b] [--api-server-count 1 4]
     [--quick] [--engine-cpus 0]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import gc
import json
import math
import multiprocessing
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from benchmarks.common import PrefillProbe, print_table, write_result
from benchmarks.http_server import client_worker, one_request, server, set_start_barrier
from graphserve import LLM, SamplingParams
from graphserve.config import add_engine_args, config_from_args

STREAMS_PER_CLIENT = 64


def workload(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(input_len)] for _ in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_timeline(records: list[dict[str, Any]], start: float, end: float, concurrency: int) -> dict[str, Any]:
    """The engine's steps whose end falls in [start, end] (wall clock): count, summed step time over the wall
    time, mean batch, and seconds from ``start`` until the running batch first reached ``concurrency``; then the
    decode-only steps apart (count, mean step_ms, mean batch) and the seconds of the others (prefill, mixed): the
    mean step of all holds both, and the two sides prefill in different chunks (offline admits a whole wave at
    once, the server its requests as they arrive). Of the others also their mean step_ms, prefill tokens, and
    the host's share of a step (schedule_ms + launch_ms, telemetry.py): an eager step whose launch takes about its
    whole step_ms waited on the host, so a server whose such steps launch slower than offline's lost host time
    (the engine's CPU, or a core shared with the front-end and clients), one that launches as fast lost it on
    the device."""
    steps = [r for r in records if start <= r["time"] <= end]
    wall = max(end - start, 1e-9)
    full = next((r["time"] - start for r in steps if r["batch_size"] >= concurrency), None)
    decode = [r for r in steps if r.get("kind") == "decode"]
    other = [r for r in steps if r.get("kind") != "decode"]

    def mean(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in rs) if rs else 0.0
    return {"steps": len(steps), "busy": sum(r["step_ms"] for r in steps) / 1000 / wall,
            "mean_batch": statistics.fmean(r["batch_size"] for r in steps) if steps else 0.0,
            "mean_step_ms": statistics.fmean(r["step_ms"] for r in steps) if steps else 0.0,
            "full_after_s": full, "decode_steps": len(decode),
            "decode_step_ms": statistics.fmean(r["step_ms"] for r in decode) if decode else 0.0,
            "decode_batch": statistics.fmean(r["batch_size"] for r in decode) if decode else 0.0,
            "other_s": sum(r["step_ms"] for r in other) / 1000, "other_steps": len(other),
            "other_step_ms": mean(other, "step_ms"), "other_prefill_tokens": mean(other, "prefill_tokens"),
            "other_schedule_ms": mean(other, "schedule_ms"), "other_launch_ms": mean(other, "launch_ms"),
            "other_gc_ms": mean(other, "gc_ms")}


def read_step_log(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_offline(model: str, engine_args: str, args: argparse.Namespace) -> dict[str, Any]:
    """Offline output tok/s per concurrency, the engine's prefill time for a 256-token prompt, the prompts."""
    from graphserve.engine.gc_clock import freeze_heap
    from graphserve.engine.warmup import warm_up

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = config_from_args(parser.parse_args(shlex.split(engine_args)), model)
    kwargs = {k: v for k, v in vars(config).items() if k != "model"}
    llm = LLM(model, **kwargs)
    warm_up(llm.engine.core)  # the server warms up before ready: so does the baseline
    freeze_heap()  # and then freezes its heap (engine/serve_loop.py); unfrozen below, before the LLM goes
    vocab = llm.engine.info.vocab_size
    prompts: list[Any] = workload(args.num_prompts, args.input_len, vocab)
    if args.prompts_as == "text":
        # as SGLang's bench_serving, guidellm and `vllm bench serve` send random ids: decoded to text, which the
        # server tokenizes again; both sides then run the prompts as text, so they run the same tokens
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.decode(p) for p in prompts]
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {"prompts": prompts, "tok_s": {}, "steps": {}}
    for c in args.levels:
        llm.engine.core.scheduler.max_running = c  # the same running-batch cap the HTTP clients produce
        telemetry = llm.engine.core.telemetry
        before = telemetry.last_step()  # step ids count from 1
        sync()
        t0, wall0 = time.perf_counter(), time.time()
        outs = llm.generate(inputs, params, use_tqdm=False)
        sync()
        seconds = time.perf_counter() - t0
        out["tok_s"][c] = sum(len(o.token_ids) for o in outs) / seconds
        # the run's steps from the engine's telemetry ring, read after the timing; a ring that has dropped the
        # run's first step would give a timeline missing its start
        records = [dataclasses.asdict(r) for r in telemetry.records() if r.step > before]
        if not records or records[0]["step"] != before + 1:
            raise RuntimeError(f"the telemetry ring no longer holds step {before + 1}, the first of the C={c} run: "
                               "run fewer --num-prompts per level")
        out["steps"][c] = step_timeline(records, wall0, wall0 + seconds, c)
        out.setdefault("tokens", sum(len(o.token_ids) for o in outs))
        # the prompt length the engine ran: the asked input_len when text round-trips through the tokenizer
        out.setdefault("prompt_tokens_mean", statistics.mean(len(o.prompt_token_ids) for o in outs))
    # The engine's own prefill time is its prefill step's step_ms (median of 7, the first dropped): a whole
    # LLM.generate call also holds request set-up and output handling, and its best-of-N read far apart
    # between runs on the H200.
    probe, timed = workload(1, 256, vocab, seed=7)[0], PrefillProbe(llm)
    walls, steps = zip(*(timed([(t + i) % (vocab - 20) + 10 for t in probe])  # distinct: no prefix-cache hit
                         for i in range(8)))
    out["prefill_256_ms"] = statistics.median(steps[1:])
    out["generate_256_ms"] = statistics.median(walls[1:])
    out["vocab"] = vocab
    gc.unfreeze()  # frozen cyclic garbage is never freed: the engine's memory would stay held
    del llm, timed  # the probe holds the engine too
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the server needs the memory back
    return out


def http_throughput(base_url: str, prompts: list[Any], output_len: int, concurrency: int,
                    stream: bool) -> tuple[float, int, int, float, float, float]:
    """(output tok/s, tokens, events, wall start, wall end, seconds between the first and the last client process
    starting) with ``concurrency`` streams spread over client processes."""
    procs = max(1, math.ceil(concurrency / STREAMS_PER_CLIENT))
    shares = [prompts[i::procs] for i in range(procs)]
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(procs)  # every client process starts sending at the same moment
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx, initializer=set_start_barrier,
                                                initargs=(barrier,)) as pool:
        futs = [pool.submit(client_worker, base_url, share, output_len, concurrency // procs, stream)
                for share in shares]
        results = [f.result() for f in futs]
    start, end = min(r[0] for r in results), max(r[1] for r in results)
    tokens = sum(r[2] for r in results)
    events = sum(r[3] for r in results)
    return tokens / (end - start), tokens, events, start, end, max(r[0] for r in results) - start


def ready_warm(base_url: str, vocab: int, args: argparse.Namespace) -> dict[str, float]:
    """TTFT p99 of the first 32 requests after ready vs the next 256: varied lengths and sampling knobs."""
    rng = random.Random(3)
    knobs = [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 1},
             {"temperature": 0.7, "presence_penalty": 0.5, "frequency_penalty": 0.3}, {"logprobs": 3},
             {"temperature": 1.0, "min_p": 0.05, "n": 2}]

    async def run() -> list[float]:
        import aiohttp

        sem = asyncio.Semaphore(8)
        ttfts: list[float] = []
        async with aiohttp.ClientSession() as session:
            async def one(i: int) -> None:
                top = args.ready_max_input
                n_in = rng.choice([rng.randrange(1, top // 16), rng.randrange(top // 16, top // 3),
                                   rng.randrange(top // 3, top)])
                prompt = [rng.randrange(10, vocab - 10) for _ in range(n_in)]
                async with sem:
                    ttft, _, _ = await one_request(session, base_url, prompt, 16, True, knobs[i % len(knobs)])
                ttfts.append(ttft)

            first = args.ready_first
            for wave in (range(first), range(first, first + args.ready_next)):
                await asyncio.gather(*(one(i) for i in wave))  # the second wave starts after the first
        return ttfts

    t = asyncio.run(run())
    first, rest = sorted(t[:args.ready_first]), sorted(t[args.ready_first:])
    p99 = lambda xs: xs[min(len(xs) - 1, int(0.99 * len(xs)))]  # noqa: E731
    return {"first32_p99_ms": 1000 * p99(first), "next256_p99_ms": 1000 * p99(rest),
            "ratio": p99(first) / p99(rest)}


def server_sums(base_url: str) -> dict[str, float]:
    """The /metrics sums and counts the idle-TTFT breakdown needs (summed over front-ends by the server)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def idle_ttft(base_url: str, vocab: int) -> dict[str, float]:
    """A lone 256-token prompt, one token out, on an idle server: the client's median TTFT (ms), and where the
    time of the measured requests went on average, from the server's own histograms (the engine stamps the
    first scheduling on the same monotonic clock): HTTP in and out (client TTFT - server TTFT), front-end to
    engine (queue time), the engine's steps, and the way back (server TTFT - queue - steps)."""
    async def run(prompts: list[list[int]]) -> list[float]:
        import aiohttp

        out = []
        async with aiohttp.ClientSession() as session:
            for prompt in prompts:
                ttft, _, _ = await one_request(session, base_url, prompt, 1, True, {})
                out.append(ttft)
        return out

    asyncio.run(run([workload(1, 256, vocab, seed=100 + i)[0] for i in range(2)]))  # connection and path warm
    before = server_sums(base_url)
    start = time.time()
    times = asyncio.run(run([workload(1, 256, vocab, seed=102 + i)[0] for i in range(8)]))
    end = time.time()
    after = server_sums(base_url)

    def mean_ms(name: str, per: str) -> float:
        return 1000 * (after.get(name, 0) - before.get(name, 0)) / max(1.0, after.get(per, 0) - before.get(per, 0))

    p = "graphserve:"
    server = mean_ms(p + "time_to_first_token_seconds_sum", p + "time_to_first_token_seconds_count")
    queue = mean_ms(p + "request_queue_time_seconds_sum", p + "request_queue_time_seconds_count")
    steps = mean_ms(p + "step_duration_seconds_sum", p + "time_to_first_token_seconds_count")
    client = 1000 * statistics.median(times)
    return {"client_ttft_ms": client, "http_ms": 1000 * statistics.mean(times) - server, "server_ttft_ms": server,
            "to_engine_ms": queue, "engine_steps_ms": steps, "back_ms": server - queue - steps,
            "window": [start, end]}


def bench_model(model: str, args: argparse.Namespace, log_dir: str) -> tuple[list[dict], list[dict]]:
    """Offline, then one server per ``--api-server-count``, its step log in ``log_dir``. With ``--engine-cpus``
    the offline engine runs on those CPUs, and so does the server's engine (GRAPHSERVE_ENGINE_CPUS), its
    front-ends and the clients on the others."""
    from graphserve.engine import cpu_affinity

    engine_args = f"{args.engine_args} --max-running-requests {max(args.concurrency)}".strip()
    allowed = os.sched_getaffinity(0)
    cpus = cpu_affinity.parse_cpus(args.engine_cpus) if args.engine_cpus else None
    env = None
    threads = torch.get_num_threads()
    if cpus is not None:
        cpu_affinity.set_process_cpus(cpus)
        torch.set_num_threads(min(threads, len(cpus)))  # as the server's engine process sizes them
        env = {**os.environ, cpu_affinity.ENV: args.engine_cpus}
    try:
        off = run_offline(model, engine_args, args)
    finally:
        cpu_affinity.set_process_cpus(allowed)  # a server starts from every CPU, and keeps its engine's for it
        torch.set_num_threads(threads)
    try:
        return bench_servers(model, engine_args, off, args, log_dir, env, allowed - cpus if cpus else None)
    finally:
        cpu_affinity.set_process_cpus(allowed)


def bench_servers(model: str, engine_args: str, off: dict[str, Any], args: argparse.Namespace, log_dir: str,
                  env: dict[str, str] | None, client_cpus: set[int] | None) -> tuple[list[dict], list[dict]]:
    """Each server's runs; ``client_cpus``: where this process and the client processes it spawns run while a
    server is up (None: anywhere)."""
    from graphserve.engine.cpu_affinity import set_process_cpus

    allowed = os.sched_getaffinity(0)
    rows, extras = [], []
    for count in args.api_server_count:
        extra: dict[str, Any] = {"model": model, "api_server_count": count,
                                 "offline_prefill_256_ms": off["prefill_256_ms"],
                                 "offline_generate_256_ms": off["generate_256_ms"]}
        step_log = os.path.join(log_dir, f"{model.replace(':', '_').replace('/', '_')}_api{count}_steps.jsonl")
        server_args = ("--api-server-count", str(count), "--step-log", step_log)
        with server(model, engine_args, server_args, env) as base_url:
            if client_cpus is not None:
                set_process_cpus(client_cpus)
            if not args.skip_ready_warm:
                extra["ready_warm"] = ready_warm(base_url, off["vocab"], args)
            extra["idle"] = idle_ttft(base_url, off["vocab"])
            idle_window = extra["idle"].pop("window")
            extra["idle_ttft_ms"] = extra["idle"]["client_ttft_ms"]
            extra["idle_ttft_target_ms"] = 1.2 * off["prefill_256_ms"] + 2.0
            windows = []  # (row, start, end): each run's steps come from the step log once all have run
            for c in args.levels:
                for stream in (True, False):
                    tok_s, tokens, events, start, end, spread = http_throughput(base_url, off["prompts"],
                                                                                args.output_len, c, stream)
                    if tokens != off["tokens"]:
                        raise RuntimeError(f"HTTP generated {tokens} tokens, offline {off['tokens']}")
                    rows.append({"model": model, "concurrency": c, "mode": "stream" if stream else "non-stream",
                                 "client": "every-event", "ratio": tok_s / off["tok_s"][c], "http_tok_s": tok_s,
                                 "offline_tok_s": off["tok_s"][c], "api_server_count": count,
                                 "prompts_as": args.prompts_as, "prompt_tokens_mean": off["prompt_tokens_mean"],
                                 "events_per_token": events / tokens, "client_start_spread_s": spread,
                                 "offline_steps": off["steps"][c]})
                    windows.append((rows[-1], start, end))
            # the step log, read once the runs are over: each measured idle prefill's step (its host launch and
            # collector time inside it), and each throughput run's timeline
            records = read_step_log(step_log)
            t0, t1 = idle_window
            extra["idle_steps"] = [{k: r.get(k, 0.0) for k in ("step_ms", "launch_ms", "gc_ms")}
                                   for r in records if t0 <= r["time"] <= t1 and r["prefill_tokens"]]
            for row, start, end in windows:
                row["http_steps"] = step_timeline(records, start, end, row["concurrency"])
        set_process_cpus(allowed)  # the next server starts from every CPU
        extras.append(extra)
    return rows, extras


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["dummy:qwen3-0.6b", "dummy:llama3-8b"])
    p.add_argument("--engine-args", default="", help="engine flags for both paths, e.g. '--max-model-len 2048'")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--ready-first", type=int, default=32, help="requests right after ready")
    p.add_argument("--ready-next", type=int, default=256, help="requests after those, the steady reference")
    p.add_argument("--ready-max-input", type=int, default=1500, help="longest prompt of the ready-warm requests")
    p.add_argument("--api-server-count", type=int, nargs="+", default=[1],
                   help="HTTP front-end processes of the server; several values run one server each")
    p.add_argument("--prompts-as", choices=("ids", "text"), default="ids",
                   help="send the random-id prompts as ids, or decoded to text as text-based clients do")
    p.add_argument("--result-name", default="http_overhead", help="benchmarks/results/NAME.json")
    p.add_argument("--skip-ready-warm", action="store_true", help="skip the first-32-after-ready measurement")
    p.add_argument("--latency-only", action="store_true", help="only ready-warm and idle TTFT, no throughput rows")
    p.add_argument("--quick", action="store_true", help="256 prompts of 128 in / 128 out")
    p.add_argument("--engine-cpus", default=None,
                   help="CPUs for the engine alone, as taskset -c lists them (e.g. 0): the offline engine runs there, "
                        "the server's engine too (GRAPHSERVE_ENGINE_CPUS), its front-ends and the clients elsewhere")
    p.add_argument("--step-log-dir", default=None, help="keep each server's --step-log here (default: a temp dir)")
    args = p.parse_args()
    for count in args.api_server_count:
        if count < 1:
            p.error(f"--api-server-count {count} is invalid: must be >= 1")
    for name in ("num_prompts", "input_len", "output_len", "ready_first", "ready_next"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: must be >= 1")
    if min(args.concurrency) < 1:
        p.error(f"--concurrency {args.concurrency} is invalid: every level must be >= 1")
    if args.ready_max_input < 32:  # the ready-warm prompts draw from three ranges cut at 1/16 and 1/3 of it
        p.error(f"--ready-max-input {args.ready_max_input} is invalid: must be >= 32")
    if args.engine_cpus:
        from graphserve.engine.cpu_affinity import parse_cpus
        from graphserve.errors import ConfigError

        try:
            cpus, allowed = parse_cpus(args.engine_cpus), os.sched_getaffinity(0)
        except ConfigError as exc:
            p.error(exc.message)
        if not cpus < allowed:
            p.error(f"--engine-cpus {args.engine_cpus} is invalid: must be some, not all, of the CPUs this process may "
                    f"use ({sorted(allowed)})")
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 256, 128, 128
    # the throughput levels run, offline and over HTTP; --concurrency still sets the engine's running cap
    args.levels = [] if args.latency_only else args.concurrency
    rows, extras = [], []
    with tempfile.TemporaryDirectory(prefix="http_overhead_") as scratch:
        log_dir = args.step_log_dir or scratch
        os.makedirs(log_dir, exist_ok=True)
        for model in args.models:
            r, e = bench_model(model, args, log_dir)
            rows += r
            extras += e
    print(f"input_len={args.input_len} output_len={args.output_len} prompts={args.num_prompts}")
    if rows:
        print_table(rows, ["model", "api_server_count", "concurrency", "mode", "client", "http_tok_s",
                           "offline_tok_s", "events_per_token", "ratio"])
    for r in rows:
        h, o = r["http_steps"], r["offline_steps"]
        print(f"{r['model']} api_server_count={r['api_server_count']} C={r['concurrency']} {r['mode']}: steps "
              f"http/offline {h['steps']}/{o['steps']}, busy {h['busy']:.2f}/{o['busy']:.2f}, mean batch "
              f"{h['mean_batch']:.1f}/{o['mean_batch']:.1f}, mean step {h['mean_step_ms']:.2f}/{o['mean_step_ms']:.2f} ms, "
              f"full after {h['full_after_s']}/{o['full_after_s']} s; decode steps {h['decode_steps']}/"
              f"{o['decode_steps']} of {h['decode_step_ms']:.2f}/{o['decode_step_ms']:.2f} ms at batch "
              f"{h['decode_batch']:.1f}/{o['decode_batch']:.1f}, other steps {h['other_s']:.2f}/{o['other_s']:.2f} s "
              f"({h['other_steps']}/{o['other_steps']} of {h['other_step_ms']:.1f}/{o['other_step_ms']:.1f} ms, "
              f"{h['other_prefill_tokens']:.0f}/{o['other_prefill_tokens']:.0f} prefill tokens, schedule+launch "
              f"{h['other_schedule_ms'] + h['other_launch_ms']:.1f}/{o['other_schedule_ms'] + o['other_launch_ms']:.1f}"
              " ms); "
              "client processes started within "
              f"{r['client_start_spread_s'] * 1000:.0f} ms")
    for e in extras:
        line = (f"{e['model']} api_server_count={e['api_server_count']}: idle TTFT {e['idle_ttft_ms']:.1f} ms "
                f"(target {e['idle_ttft_target_ms']:.1f} ms = 1.2 x prefill {e['offline_prefill_256_ms']:.1f} ms + 2); "
                "mean path: " + ", ".join(f"{k} {v:.2f}" for k, v in e["idle"].items() if k != "client_ttft_ms"))
        steps = e["idle_steps"]
        line += ("; lone prefill steps (step log, step/launch) "
                 + ", ".join(f"{x['step_ms']:.1f}/{x['launch_ms']:.1f}" for x in steps)
                 + f" ms, collector {sum(x['gc_ms'] for x in steps):.1f} ms in all")
        rw = e.get("ready_warm")
        if rw is not None:
            line += (f"; after ready: first-32 TTFT p99 {rw['first32_p99_ms']:.1f} ms vs next-256 "
                     f"{rw['next256_p99_ms']:.1f} ms (ratio {rw['ratio']:.2f})")
        print(line)
    path = write_result(args.result_name, {
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "engine_args": args.engine_args, "engine_cpus": args.engine_cpus, "rows": rows, "latency": extras,
    })
    print(f"wrote {path}")
    print(json.dumps({"min_ratio": min((r["ratio"] for r in rows), default=None)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
