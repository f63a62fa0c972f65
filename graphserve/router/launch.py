"""`graphserve router --worker URL [--worker URL ...] --port P`: one endpoint in front of `graphserve serve`
workers, sending each request to the worker that caches the longest prefix of it.

At start the router asks every worker (for up to ``--startup-timeout`` s) which model it serves; workers that
answer must agree, and the router loads that model's tokenizer (or ``--tokenizer``) to hash prompts as the
workers' caches do, and checks that each serves its prefix-cache events (`graphserve serve --kv-events`): one that
does not is refused by URL. A worker that is down at start is taken in when it comes up, if it serves the same
model and its cache events.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from urllib.parse import urlsplit

import httpx

from graphserve.engine.routing_policy import DEFAULT_BALANCE_THRESHOLD, RoutingPolicy
from graphserve.errors import ConfigError
from graphserve.server.serve_args import API_KEY_ENVS

logger = logging.getLogger("graphserve.router")

STRAGGLER_S = 10.0  # how long start-up waits for the other workers once one has answered


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", action="append", required=True, metavar="URL",
                        help="base URL of a `graphserve serve` worker (repeat for each), e.g. http://10.0.0.2:30000")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=30000, help="TCP port to listen on")
    parser.add_argument("--tokenizer", default=None,
                        help="model source whose tokenizer hashes prompts (default: the workers' model)")
    parser.add_argument("--api-key", default=None,
                        help="the workers' --api-key, sent on the router's own calls to them (default: "
                             "$VLLM_API_KEY or $GRAPHSERVE_API_KEY); a client's request carries its own key")
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between /health checks")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds to wait at start for a worker to say which model it serves")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a worker may take between two bytes of a response")
    parser.add_argument("--balance-threshold", type=int, default=DEFAULT_BALANCE_THRESHOLD,
                        help="requests in flight by which the workers holding a request's prefix may exceed the "
                             "least loaded worker before the request goes to the least loaded instead")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def check_args(args: argparse.Namespace) -> list[str]:
    """The worker URLs, normalized; a bad flag is refused naming it, its value and the limit."""
    urls: list[str] = []
    for url in args.worker:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"--worker={url!r} is invalid: must be an http:// or https:// URL with a host",
                              param="worker")
        url = url.rstrip("/")
        if url in urls:
            raise ConfigError(f"--worker={url!r} is given twice: each worker once", param="worker")
        urls.append(url)
    if args.balance_threshold < 0:
        raise ConfigError(f"--balance-threshold={args.balance_threshold} is invalid: must be >= 0",
                          param="balance_threshold")
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port={args.port} is invalid: must be in [1, 65535]", param="port")
    for flag in ("health_interval", "startup_timeout", "request_timeout"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')}={getattr(args, flag)} is invalid: must be > 0",
                              param=flag)
    return urls


async def worker_models(client: httpx.AsyncClient, urls: list[str], timeout: float,
                        headers: dict[str, str] | None = None) -> dict[str, str]:
    """The model each worker serves, for those that answer: all of them, or those that did by STRAGGLER_S after
    the first (the rest are taken in when they come up). None answering within ``timeout`` s is an error."""
    deadline = time.monotonic() + timeout
    first_answer: float | None = None
    models: dict[str, str] = {}
    while True:
        for url in urls:
            if url in models:
                continue
            try:
                resp = await client.get(url + "/get_model_info", timeout=5.0, headers=headers)
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                models[url] = resp.json()["model_path"]
                first_answer = first_answer or time.monotonic()
        now = time.monotonic()
        if len(models) == len(urls) or (first_answer is not None and now > first_answer + STRAGGLER_S):
            return models
        if now > deadline:
            raise ConfigError(f"--worker: none of {urls} answered /get_model_info within --startup-timeout="
                              f"{timeout:g} s", param="worker")
        await asyncio.sleep(0.5)


async def check_kv_events(client: httpx.AsyncClient, urls: list[str], headers: dict[str, str] | None = None) -> None:
    """Every worker that answered at start serves its prefix-cache events: one started without --kv-events is
    refused by URL, since the router could only send it requests by load, blind to the prefixes it caches."""
    from graphserve.router.workers import no_events_reason

    for url in urls:
        try:
            resp = await client.get(url + "/v1/cache_events", params={"since": -1, "timeout": 0}, timeout=5.0,
                                    headers=headers)
        except httpx.HTTPError:
            continue  # gone since it answered: when it is back, its events loop refuses it if it must
        if resp.status_code == 404:
            raise ConfigError(no_events_reason(url, resp), param="worker")


def check_models(models: dict[str, str]) -> str:
    """The one model the workers serve; workers that disagree are refused naming both."""
    (first_url, first), *rest = models.items()
    for url, model in rest:
        if model != first:
            raise ConfigError(f"--worker {first_url} serves model={first!r} but --worker {url} serves "
                              f"model={model!r}: every worker must serve the same model", param="worker")
    return first


async def serve(args: argparse.Namespace, urls: list[str]) -> None:
    import uvicorn

    from graphserve.models.loader import load_tokenizer
    from graphserve.router.app import create_app
    from graphserve.router.tokens import PromptTokens
    from graphserve.router.workers import WorkerPool

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(args.request_timeout, connect=5.0)
    key = args.api_key or next((os.environ[e] for e in API_KEY_ENVS if os.environ.get(e)), None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # no default key on this client: it carries clients' requests, each with the key its client sent
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        models = await worker_models(client, urls, args.startup_timeout, headers)
        model = check_models(models)
        await check_kv_events(client, list(models), headers)
        tokenizer = await asyncio.to_thread(load_tokenizer, args.tokenizer or model)
        policy = RoutingPolicy(balance_threshold=args.balance_threshold)
        pool = WorkerPool(urls, model, client, policy, args.health_interval, headers)
        pool.start()
        app = create_app(pool, PromptTokens(tokenizer))
        logger.info("routing for model %s over %d worker(s): %s", model, len(urls), ", ".join(urls))
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                               access_log=False))
        try:
            await server.serve()
        finally:
            await pool.stop()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    urls = check_args(args)
    asyncio.run(serve(args, urls))
    return 0
