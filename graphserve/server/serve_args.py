"""The flags of `graphserve serve`, and the checks that turn its HTTP ones into options.

Each bound is checked once, here, before anything starts: a bad value exits with an error that names the
flag, its value and the limit.
"""

from __future__ import annotations

import argparse
import os

from graphserve import env
from graphserve.config import add_engine_args
from graphserve.errors import ConfigError
from graphserve.server.grammar_work import MAX_GRAMMAR_BUILDS_PER_CLIENT
from graphserve.server.guards import GuardOptions
from graphserve.structured.constraint import MAX_SCHEMA_DEPTH, MAX_SCHEMA_DEPTH_FLAG, MAX_SPEC_CHARS

API_KEY_ENVS = ("VLLM_API_KEY", "GRAPHSERVE_API_KEY")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in --help, unless its help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default is None or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsHelpFormatter
    parser.add_argument("model", help="HF folder, builtin:NAME or dummy:PRESET")
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=30000, help="TCP port to listen on")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="names clients use in the model field (default: MODEL; for builtin: and dummy: "
                             "models, their tokenizer folder, which benchmark tools load)")
    parser.add_argument("--step-log", default=None, metavar="FILE", help="append every step record as JSONL")
    parser.add_argument("--step-log-max-mb", type=float, default=100.0,
                        help="rotate --step-log to FILE.1 (one backup kept) when it grows past this size")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                             f"(default: ${API_KEY_ENVS[0]} or ${API_KEY_ENVS[1]})")
    parser.add_argument("--max-request-body-mb", type=float, default=32.0,
                        help="bodies above this size get 413 before they are read")
    parser.add_argument("--request-read-timeout", type=float, default=30.0,
                        help="seconds a request head, and then its body, may take to arrive (else 408 and close)")
    parser.add_argument("--max-connections", type=int, default=4096,
                        help="open connections past this bound get 503 and are closed")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM/SIGINT")
    parser.add_argument("--engine-death-grace", type=float, default=5.0, metavar="SECONDS",
                        help="after the engine process dies, exit non-zero within SECONDS (time for in-flight "
                             "requests' error events to reach their clients)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="the least severe log lines printed")
    parser.add_argument("--stream-interval", type=int, default=1, metavar="TOKENS",
                        help="stream an event every TOKENS tokens per request (a client that falls behind gets "
                             "several tokens per event anyway)")
    parser.add_argument("--stream-stall-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="abort a request whose client has not read its output for SECONDS, freeing its KV")
    parser.add_argument("--enable-profile-endpoint", action="store_true",
                        help="serve POST /v1/profile, which profiles the next decode steps (graphserve profile)")
    parser.add_argument("--engine-in-process", action="store_true",
                        help="run the engine on a thread of the server process instead of its own process")
    parser.add_argument("--max-schema-depth", type=int, default=MAX_SCHEMA_DEPTH,
                        help="a response_format / guided / tool schema nesting deeper (JSON levels) gets 400")
    parser.add_argument("--max-schema-chars", type=int, default=MAX_SPEC_CHARS,
                        help="a schema, regex or grammar longer than this gets 400")
    parser.add_argument("--max-grammar-builds-per-client", type=int, default=MAX_GRAMMAR_BUILDS_PER_CLIENT,
                        help="requests of one client (API key, else address) whose new grammar is being built "
                             "at once; past this, 429")
    parser.add_argument("--strict-api", action="store_true",
                        help="refuse unknown fields on the OpenAI routes with 400 (by default they are ignored, "
                             "warned about once per name, and listed in the X-Graphserve-Ignored-Fields header)")
    parser.add_argument("--api-server-count", default="1", metavar="N",
                        help="HTTP front-end processes sharing the one engine process (each its own event loop "
                             "and GIL; the kernel spreads connections over them); 'auto' takes a quarter of the "
                             "CPU cores, at most 4")


def guard_options(args: argparse.Namespace) -> GuardOptions:
    bounds = (("--max-request-body-mb", args.max_request_body_mb),
              ("--request-read-timeout", args.request_read_timeout), ("--max-connections", args.max_connections))
    for flag, value in bounds:
        if not value > 0:
            raise ConfigError(f"{flag}={value} is invalid: must be > 0", param=flag)
    # getattr: a Namespace built by hand (not by the parser) may lack the grammar flags; their defaults hold
    depth = getattr(args, "max_schema_depth", MAX_SCHEMA_DEPTH)
    chars = getattr(args, "max_schema_chars", MAX_SPEC_CHARS)
    builds = getattr(args, "max_grammar_builds_per_client", MAX_GRAMMAR_BUILDS_PER_CLIENT)
    if not 1 <= depth <= MAX_SCHEMA_DEPTH_FLAG:
        raise ConfigError(f"--max-schema-depth={depth} is invalid: must be between 1 and {MAX_SCHEMA_DEPTH_FLAG}",
                          param="--max-schema-depth")
    for flag, value in (("--max-schema-chars", chars), ("--max-grammar-builds-per-client", builds)):
        if value < 1:
            raise ConfigError(f"{flag}={value} is invalid: must be >= 1", param=flag)
    key = args.api_key or os.environ.get("VLLM_API_KEY") or env.get("GRAPHSERVE_API_KEY") or None
    return GuardOptions(api_key=key, max_body_bytes=int(args.max_request_body_mb * 1024 * 1024),
                        read_timeout_s=args.request_read_timeout, max_connections=args.max_connections,
                        max_schema_depth=depth, max_schema_chars=chars, max_grammar_builds_per_client=builds)


def api_server_count(value: str, engine_in_process: bool = False) -> int:
    """--api-server-count: a positive integer up to the CPU count, or 'auto'."""
    cpus = os.cpu_count() or 1
    if value == "auto":
        # each front-end is a busy core under load; the rest stay for the engine's threads and the OS
        return max(1, min(4, cpus // 4))
    try:
        count = int(value)
    except ValueError:
        raise ConfigError(f"--api-server-count={value!r} is invalid: must be an integer or 'auto'",
                          param="api_server_count") from None
    if not 1 <= count <= cpus:
        raise ConfigError(f"--api-server-count={count} is invalid: must be between 1 and the {cpus} CPU cores "
                          "of this machine", param="api_server_count")
    if count > 1 and engine_in_process:
        raise ConfigError(f"--api-server-count={count} is invalid with --engine-in-process: several front-ends "
                          "share an engine process, not a thread of one of them", param="api_server_count")
    return count
