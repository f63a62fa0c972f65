"""`graphserve ...` entry point. Each subcommand lives in its own module, which exposes
``add_arguments(parser)`` and ``run(args) -> int``; only the chosen one is imported."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": ("graphserve.server.serve_command", "start the OpenAI-compatible HTTP server"),
    "router": ("graphserve.router.launch", "route requests over `serve` workers by their cached prefixes"),
    "bench": ("graphserve.bench.client", "run a load generator against a server"),
    "sweep": ("graphserve.bench.sweep", "concurrency sweep + scaling fit + report folder"),
    "report": ("graphserve.analysis.report", "Markdown/HTML report and plots from result files"),
    "compare": ("graphserve.analysis.compare", "A/B comparison with bootstrap confidence intervals"),
    "plan": ("graphserve.analysis.plan", "GPU memory plan for a model and config"),
    "doctor": ("graphserve.analysis.doctor", "diagnose a graphserve, SGLang or vLLM server log"),
    "profile": ("graphserve.analysis.profile", "where a decode step goes: graph replay and eager, per category"),
    "demo": ("graphserve.demo", "the embedded default, end to end on CPU"),
    "tune": ("graphserve.tuning.cli", "measure this card's kernel tables into the per-user cache"),
}


# bench and sweep take the engine's flags for the server they start in-process with --model; against
# --base-url or --server-cmd that server has its flags elsewhere, so these would be silently ignored.
IN_PROCESS_SERVER_COMMANDS = ("bench", "sweep")
SHARED_WITH_CLIENT = {"seed"}  # also seeds the prompt sampler and the arrival process: meaningful alone


def _engine_flags_given(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The engine flags present in ``argv`` (argparse's unique-prefix abbreviations resolved)."""
    import dataclasses

    from graphserve.config import EngineConfig

    dests = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"} - SHARED_WITH_CLIENT
    actions = [a for a in parser._actions if a.option_strings]
    given = []
    for token in argv:
        if not token.startswith("--"):
            continue
        word = token.split("=", 1)[0]
        exact = [a for a in actions if word in a.option_strings]
        match = exact or [a for a in actions if any(o.startswith(word) for o in a.option_strings)]
        if len(match) == 1 and match[0].dest in dests and word not in given:
            given.append(word)
    return given


def check_flags(name: str, parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """Refuse flags that would run but do nothing, by name; the one place such a refusal is lifted."""
    from graphserve.errors import ConfigError

    if name in IN_PROCESS_SERVER_COMMANDS and not getattr(args, "model", None):
        given = _engine_flags_given(parser, argv)
        if given:
            raise ConfigError(
                f"{', '.join(given)} configure{'s' if len(given) == 1 else ''} the server `graphserve {name}` starts "
                f"with --model; without --model {'it' if len(given) == 1 else 'they'} would be ignored (set the "
                f"server's flags where it is started: its own command line or --server-cmd)",
                param=given[0].lstrip("-").replace("-", "_"))
    # --tp/--ep run (graphserve/distributed): a degree that does not split the model, or needs more GPUs than
    # are visible, is refused by models/parallel_check.check_parallel, which `serve` runs before it binds its
    # port and every engine runs before it spawns a rank


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
        check_flags(name, parser, args, argv[1:])
        return int(module.run(args) or 0)
    except GraphserveError as e:  # a bad flag or input: its message names the field, value and limit
        print(f"graphserve {name}: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
