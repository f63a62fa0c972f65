"""`graphserve bench`: the load generator. Flags follow SGLang's bench_serving / vLLM's
benchmark_serving where they exist, so a command line moves between the tools unchanged."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import sys
from typing import Any

import numpy as np

from graphserve.bench.backends import BACKENDS, CLIENTS
from graphserve.bench.datasets import build_requests, load_tokenizer
from graphserve.bench.runner import BenchSettings, run_benchmark
from graphserve.errors import GraphserveError, bad_field


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the load goes, what it looks like: shared by bench and sweep."""
    g = parser.add_argument_group("target")
    g.add_argument("--base-url", default=None, help="server to load, e.g. http://127.0.0.1:30000")
    g.add_argument("--model", default=None, help="start graphserve in-process with this model instead of --base-url")
    g.add_argument("--backend", choices=BACKENDS, default="openai")
    g.add_argument("--client", choices=CLIENTS, default="lines",
                   help="every-event: a connection per request, every SSE event parsed as it arrives "
                        "(as SGLang's bench_serving reads); lines: pooled connections, line reader")
    g.add_argument("--served-model-name", default=None, help="model name in OpenAI bodies (default: GET /v1/models)")
    g.add_argument("--metrics-url", default=None, help="Prometheus endpoint (default: BASE_URL/metrics)")
    d = parser.add_argument_group("dataset")
    d.add_argument("--dataset-name", choices=("random", "random-ids", "sharegpt"), default="random")
    d.add_argument("--dataset-path", default=None, help="local ShareGPT JSON file")
    d.add_argument("--sharegpt-output-len", type=int, default=None, help="override ShareGPT reply lengths")
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--length-rule", choices=("sglang", "vllm"), default="sglang",
                   help="sglang: lengths in [len*r, len]; vllm: [len*(1-r), len*(1+r)]")
    d.add_argument("--tokenizer", default=None, help="HF folder, builtin:NAME or dummy:NAME (exact prompt lengths)")
    d.add_argument("--random-ids-as", choices=("ids", "text"), default="ids",
                   help="send random-ids prompts as token ids, or decoded to text as SGLang's bench_serving does "
                        "(the server re-tokenizes them; needs --tokenizer)")
    r = parser.add_argument_group("requests")
    r.add_argument("--warmup-requests", type=int, default=1)
    r.add_argument("--disable-stream", action="store_true")
    r.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", default=None,
                   help="generate the full requested length (default on for random datasets)")
    r.add_argument("--disable-ignore-eos", dest="ignore_eos", action="store_false")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--disable-tqdm", action="store_true")
    e = parser.add_argument_group("in-process server (with --model)")
    from graphserve.config import add_engine_args

    add_engine_args(e)  # brings --seed too, shared with the prompt sampler and the arrival process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    g = parser.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals; inf = burst")
    g.add_argument("--max-concurrency", type=int, default=None)
    o = parser.add_argument_group("output")
    o.add_argument("--output-file", default=None, help="result JSON (JSONL line with --append)")
    o.add_argument("--append", action="store_true", help="append one JSON line to --output-file")


def environment() -> dict:
    import aiohttp

    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "aiohttp": aiohttp.__version__, "hostname": platform.node(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def check_load_args(args: argparse.Namespace) -> None:
    """Refuse load-shape flags that would silently mean something else (0 concurrency = unlimited,
    a negative warm-up eating the measured prompts, a negative rate turned into a burst)."""
    checks = [
        ("num_prompts", lambda v: v >= 1, "must be >= 1"),
        ("num_prompts_per_level", lambda v: v >= 1, "must be >= 1"),
        ("warmup_requests", lambda v: v >= 0, "must be >= 0"),
        ("max_concurrency", lambda v: v is None or v >= 1, "must be >= 1 (omit it for no limit)"),
        ("request_rate", lambda v: v > 0, "must be > 0 requests/s (inf sends all at once)"),
        ("server_timeout", lambda v: v > 0, "must be > 0 seconds"),
    ]
    for name, ok, limit in checks:
        if hasattr(args, name) and not ok(getattr(args, name)):
            raise bad_field(name, getattr(args, name), limit)
    if args.random_ids_as == "text" and (args.dataset_name != "random-ids" or args.tokenizer is None):
        raise bad_field("random_ids_as", "text", "needs --dataset-name random-ids and a --tokenizer to decode with")


def settings_from_args(args: argparse.Namespace, base_url: str, **overrides: Any) -> BenchSettings:
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name != "sharegpt"
    s = BenchSettings(
        base_url=base_url, backend=args.backend, model=args.served_model_name, stream=not args.disable_stream,
        ignore_eos=ignore_eos, temperature=args.temperature,
        request_rate=getattr(args, "request_rate", math.inf), max_concurrency=getattr(args, "max_concurrency", None),
        warmup_requests=args.warmup_requests, seed=args.seed,
        metrics_url=args.metrics_url or base_url.rstrip("/") + "/metrics", disable_tqdm=args.disable_tqdm,
        client=getattr(args, "client", "lines"),
    )
    for k, v in overrides.items():
        setattr(s, k, v)
    return s


def discover_model(base_url: str, backend: str) -> str | None:
    """The first id of GET /v1/models, as both reference tools do; None for a server without it."""
    if backend == "native":
        return None
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=5) as resp:
            data = json.loads(resp.read()).get("data") or []
            return data[0]["id"] if data else None
    except (OSError, ValueError, KeyError):
        return None


@contextlib.contextmanager
def target_server(args: argparse.Namespace):
    """Yield the base URL: --base-url as given, or an in-process graphserve for --model."""
    if args.base_url and args.model:
        raise bad_field("model", args.model, "give either --base-url or --model, not both")
    if args.base_url:
        yield args.base_url
        return
    if not args.model:
        raise bad_field("base_url", None, "give --base-url URL or --model MODEL")
    from graphserve.config import config_from_args
    from graphserve.server.launch import ServerThread

    with ServerThread(config_from_args(args, args.model)) as server:
        yield server.base_url


def result_json(args: argparse.Namespace, out: dict, s: BenchSettings) -> dict:
    settings = dict(out["settings"])
    settings["request_rate"] = "inf" if math.isinf(settings["request_rate"]) else settings["request_rate"]
    config = {**settings, "dataset_name": args.dataset_name, "dataset_path": args.dataset_path,
              "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
              "random_range_ratio": args.random_range_ratio, "length_rule": args.length_rule,
              "tokenizer": args.tokenizer, "num_prompts": len(out["records"]), "model_source": args.model}
    return {"config": config, "environment": environment(), "summary": out["summary"],
            "requests": [r.to_dict() for r in out["records"]], "server_metrics": out["server_metrics"],
            "client_health": out["client_health"]}


def bench_once(args: argparse.Namespace, base_url: str, num_prompts: int, tokenizer: Any = None,
               **overrides: Any) -> dict:
    s = settings_from_args(args, base_url, **overrides)
    if s.model is None:
        s.model = discover_model(base_url, s.backend)
    rng = np.random.default_rng(args.seed)
    requests = build_requests(args, num_prompts + s.warmup_requests, rng, tokenizer)
    # Warm-up prompts are distinct from the measured ones, so a prefix cache gains nothing from them.
    warmup, measured = requests[: s.warmup_requests], requests[s.warmup_requests:]
    out = run_benchmark(s, measured, tokenizer, warmup=warmup)
    return result_json(args, out, s)


def format_summary(res: dict) -> str:
    s = res["summary"]
    lines = [f"{'completed / failed':<28}{s['completed']} / {s['failed']}  {s['failure_reasons'] or ''}",
             f"{'duration (s)':<28}{s['duration_s']:.2f}",
             f"{'request throughput (req/s)':<28}{s['request_throughput']:.2f}",
             f"{'output throughput (tok/s)':<28}{s['output_throughput']:.2f}",
             f"{'total throughput (tok/s)':<28}{s['total_token_throughput']:.2f}",
             f"{'achieved concurrency':<28}{s['achieved_concurrency']:.2f}"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        st = s.get(key)
        if st:
            lines.append(f"{key + ' mean/median/p99':<28}{st['mean']:.2f} / {st['median']:.2f} / {st['p99']:.2f}")
    lines += [f"WARNING: {w}" for w in s.get("warnings", [])]
    return "\n".join(lines)


def write_result(res: dict, path: str, append: bool) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if append:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(res) + "\n")
    else:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)


def run(args: argparse.Namespace) -> int:
    try:
        check_load_args(args)
        tokenizer = load_tokenizer(args.tokenizer)
        with target_server(args) as base_url:
            res = bench_once(args, base_url, args.num_prompts, tokenizer)
    except GraphserveError as e:
        print(f"graphserve bench: {e.message}", file=sys.stderr)
        return 2
    print(format_summary(res))
    if args.output_file:
        write_result(res, args.output_file, args.append)
    return 0 if res["summary"]["completed"] else 1
