"""`graphserve ...` entry point. Each subcommand lives in its own module, which exposes
``add_arguments(parser)`` and ``run(args) -> int``; only the chosen one is imported."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": ("graphserve.server.launch", "start the OpenAI-compatible HTTP server"),
    "bench": ("graphserve.bench.client", "run a load generator against a server"),
    "sweep": ("graphserve.bench.sweep", "concurrency sweep + scaling fit + report folder"),
    "report": ("graphserve.analysis.report", "Markdown/HTML report and plots from result files"),
    "compare": ("graphserve.analysis.compare", "A/B comparison with bootstrap confidence intervals"),
    "plan": ("graphserve.analysis.plan", "GPU memory plan for a model and config"),
    "doctor": ("graphserve.analysis.doctor", "diagnose a graphserve, SGLang or vLLM server log"),
    "profile": ("graphserve.analysis.profile", "where a decode step goes: graph replay and eager, per category"),
    "demo": ("graphserve.demo", "the embedded default, end to end on CPU"),
}


def _usage() -> str:
    lines = ["usage: graphserve COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"graphserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"graphserve {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    from graphserve.errors import GraphserveError

    try:
        return int(module.run(args) or 0)
    except GraphserveError as e:  # a bad flag or input: its message names the field, value and limit
        print(f"graphserve {name}: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
