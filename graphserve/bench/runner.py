"""The asynchronous load loop: Poisson (or burst) arrivals, a concurrency cap, one streamed HTTP
request per prompt, timestamps on every output chunk; plus warm-up, scraping and self-monitoring."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import numpy as np

from graphserve.bench.backends import ENDPOINTS, ChunkParser, build_payload, iter_sse_data
from graphserve.bench.datasets import BenchRequest
from graphserve.bench.health import ClientHealth
from graphserve.bench.metrics import RequestRecord, build_record, failed_record, summarize
from graphserve.bench.scrape import MetricsScraper


@dataclass
class BenchSettings:
    base_url: str
    backend: str = "openai"
    model: str | None = None  # the served model name sent in OpenAI bodies
    stream: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    request_rate: float = math.inf
    max_concurrency: int | None = None
    warmup_requests: int = 1
    seed: int = 0
    metrics_url: str | None = None
    disable_tqdm: bool = True
    timeout_s: float = 6 * 3600.0
    client: str = "lines"  # see backends.CLIENTS


async def send_request(session: aiohttp.ClientSession, s: BenchSettings, req: BenchRequest, t0: float,
                       tokenizer: Any = None) -> RequestRecord:
    url = s.base_url.rstrip("/") + ENDPOINTS[s.backend]
    payload = build_payload(s.backend, req, model=s.model, stream=s.stream, ignore_eos=s.ignore_eos,
                            temperature=s.temperature, tokenizer=tokenizer)
    parser = ChunkParser(s.backend)
    chunk_times: list[float] = []
    chunk_tokens: list[int | None] = []
    texts: list[str] = []
    prompt_tokens = completion_tokens = None
    clock = time.perf_counter
    start = clock() - t0
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                return failed_record(start, clock() - t0, f"http {resp.status}: {body}", s.stream)
            if s.stream:
                last_cum = 0
                async for data in _events(resp.content, s.client):
                    if data == b"[DONE]":
                        break
                    now = clock() - t0
                    obj = json.loads(data)
                    if "error" in obj:
                        return failed_record(start, now, f"stream error: {str(obj['error'])[:300]}", s.stream)
                    info = parser.parse(obj)
                    prompt_tokens = info.prompt_tokens if info.prompt_tokens is not None else prompt_tokens
                    cum = info.completion_tokens
                    grew = cum is not None and cum > last_cum and not info.usage_only
                    if info.new_text or grew:
                        chunk_times.append(now)
                        chunk_tokens.append(cum - last_cum if grew else None)
                        texts.append(info.new_text)
                    if cum is not None:
                        completion_tokens, last_cum = cum, max(last_cum, cum)
            else:
                info = parser.parse(await resp.json(content_type=None))
                texts.append(info.new_text)
                prompt_tokens, completion_tokens = info.prompt_tokens, info.completion_tokens
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return failed_record(start, clock() - t0, f"{type(e).__name__}: {str(e)[:200]}", s.stream)
    end = clock() - t0
    source = "server"
    if completion_tokens is None:
        if tokenizer is not None:
            completion_tokens, source = len(tokenizer.encode("".join(texts), add_special_tokens=False)), "tokenizer"
        elif s.stream:
            completion_tokens, source = len(chunk_times), "chunks"
    return build_record(start, end, chunk_times, chunk_tokens, completion_tokens, stream=s.stream,
                        input_tokens=prompt_tokens if prompt_tokens is not None else req.input_len,
                        output_tokens_source=source, requested_tokens=req.output_len)


async def _events(content: Any, client: str):
    if client == "every-event":
        async for data in iter_sse_data(content):
            yield data
        return
    async for line in content:
        if line.startswith(b"data:"):
            yield line[5:].strip()


def _progress(total: int, disable: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=disable, desc="requests", unit="req")


async def _run(s: BenchSettings, requests: list[BenchRequest], tokenizer: Any, warmup: list[BenchRequest]) -> dict:
    # every-event: a fresh connection per request, as bench_serving's session per request does
    connector = aiohttp.TCPConnector(limit=0, force_close=s.client == "every-event")
    timeout = aiohttp.ClientTimeout(total=s.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # Warm-up: short requests, one at a time, outside the measured window.
        warm_errors = []
        for req in warmup:
            short = BenchRequest(req.prompt, req.input_len, min(req.output_len, 16))
            rec = await send_request(session, s, short, time.perf_counter(), tokenizer)
            if not rec.ok:
                warm_errors.append(rec.error)
        t0 = time.perf_counter()
        scraper = MetricsScraper(session, s.metrics_url, t0)
        await scraper.start()
        health = ClientHealth()
        health.start()
        bar = _progress(len(requests), s.disable_tqdm)
        sem = asyncio.Semaphore(s.max_concurrency) if s.max_concurrency else None
        rng = np.random.default_rng(s.seed)

        async def one(req: BenchRequest) -> RequestRecord:
            if sem is None:
                rec = await send_request(session, s, req, t0, tokenizer)
            else:
                async with sem:
                    rec = await send_request(session, s, req, t0, tokenizer)
            bar.update(1)
            return rec

        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(s.request_rate) and s.request_rate > 0:
                await asyncio.sleep(float(rng.exponential(1.0 / s.request_rate)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
        client_health = await health.stop()
        server_metrics = await scraper.stop()
    summary = summarize(records, duration)
    summary["warnings"] = list(client_health["warnings"])
    if warm_errors:
        summary["warnings"].append(f"{len(warm_errors)} warm-up request(s) failed: {warm_errors[0]}")
    return {"settings": asdict(s), "summary": summary, "records": records,
            "server_metrics": server_metrics, "client_health": client_health}


def run_benchmark(s: BenchSettings, requests: list[BenchRequest], tokenizer: Any = None,
                  warmup: list[BenchRequest] | None = None) -> dict:
    """Run one benchmark to completion (after ``warmup`` requests, sent one at a time and not
    measured); returns settings, summary, records (RequestRecord objects), server_metrics, client_health."""
    return asyncio.run(_run(s, requests, tokenizer, warmup or []))
