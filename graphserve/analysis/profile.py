"""`graphserve profile`: where a decode step goes, per step, in ms and %: dense GEMMs, MoE, attention,
norms and elementwise, communication, sampling, other work, and gaps between kernels / host time,
with graph replay on and the same batch eager (engine/step_profiler.py does the measuring).

The shares are of wall time on each step's timeline: time during which kernels of several categories
overlap (programmatic dependent launch, several streams) is split evenly among them, so the shares add
up to 100% of the step's span; each category's summed kernel time is reported beside it as "busy".

    graphserve profile --model dummy:llama3-8b --batch-size 1,64 --steps 20 --output-dir prof
    graphserve profile --base-url http://127.0.0.1:30000 [--batch-size 8] --output-dir prof

With --model it starts an engine in this process and holds each batch size's requests in decode
itself. With --base-url it asks a server started with --enable-profile-endpoint (POST /v1/profile)
to profile its next steps under its current load, or, with --batch-size, under a load it drives.
Writes profile.json and profile.png into --output-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Mapping, Sequence
from typing import Any

from graphserve.engine.trace_categories import CATEGORIES, GAPS, LABELS
from graphserve.errors import BadRequestError, bad_field

MAX_STEPS = 1000
# Held requests per profiled batch: a server-driven profile holds each in a stream (and a thread) of its own.
MAX_BATCH_SIZE = 1024
# Tokens each held request may still generate: warm-ups, both phases, their drains, and room to spare.
TOKENS_PER_PROFILE_STEP = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("profile")
    g.add_argument("--base-url", default=None, help="a graphserve server started with --enable-profile-endpoint")
    g.add_argument("--model", default=None, help="start an engine in-process with this model instead")
    g.add_argument("--steps", type=int, default=20, help="decode steps to profile per phase")
    g.add_argument("--batch-size", default=None,
                   help="comma-separated batch sizes to hold in decode while profiling (default with --model: 1; "
                        "with --base-url: profile the server's current load)")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens of each held request")
    g.add_argument("--output-dir", default="profile", help="folder for profile.json and profile.png")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for a server's profile")
    from graphserve.config import add_engine_args

    add_engine_args(parser.add_argument_group("in-process engine (with --model)"))


def parse_batch_sizes(text: str | None) -> list[int]:
    if text is None:
        return []
    try:
        sizes = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise bad_field("batch_size", text, "must be comma-separated integers, e.g. 1,64") from None
    if not sizes or min(sizes) < 1 or max(sizes) > MAX_BATCH_SIZE:
        raise bad_field("batch_size", text, f"needs at least one size, each between 1 and {MAX_BATCH_SIZE}")
    return sizes


def check_steps(steps: int) -> None:
    if not 1 <= steps <= MAX_STEPS:
        raise bad_field("steps", steps, f"must be between 1 and {MAX_STEPS}")


def max_tokens_for(steps: int) -> int:
    from graphserve.engine.step_profiler import EAGER_WARMUP_STEPS

    return TOKENS_PER_PROFILE_STEP * (steps + 3 + EAGER_WARMUP_STEPS) + 32


# -- in-process -----------------------------------------------------------------------------------

def profile_in_process(core: Any, batch_size: int, steps: int, input_len: int, seed: int = 0) -> dict:
    """Hold ``batch_size`` requests in decode on ``core`` and profile ``steps`` of its decode steps."""
    from graphserve.engine.input_processor import InputProcessor
    from graphserve.engine.step_profiler import StepProfiler
    from graphserve.sampling_params import SamplingParams

    check_steps(steps)
    processor = InputProcessor(core.tokenizer, core.info, core.config, core.kv_blocks)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens_for(steps), ignore_eos=True, temperature=0.0)
    ids = [f"profile-{batch_size}-{i}" for i in range(batch_size)]
    vocab = core.info.vocab_size
    for rid in ids:
        core.add_request(processor.process(rid, [rng.randrange(3, vocab) for _ in range(input_len)], params))
    got = dict.fromkeys(ids, 0)
    try:
        while min(got.values()) < 2:  # every prompt prefilled and decoding: the batch is whole
            for out in core.step():
                got[out.request_id] = got.get(out.request_id, 0) + len(out.new_token_ids)
        if core.stats().running != batch_size:
            raise BadRequestError(f"batch_size={batch_size} is invalid: only {core.stats().running} requests run at "
                                  f"once here (raise --max-running-requests or the KV pool)", param="batch_size")
        done: list[dict] = []
        profiler = StepProfiler(core, steps, done.append)
        while profiler.active:
            if not core.has_unfinished_requests():
                raise BadRequestError(f"the held requests finished before {steps} steps were profiled",
                                      param="steps")
            profiler.iteration(core.step)
        result = done[0]
    finally:
        core.abort_requests(ids)
        while core.has_unfinished_requests():
            core.step()
    result["batch_size"] = batch_size
    return result


# -- through a server -----------------------------------------------------------------------------

def fetch_profile(base_url: str, steps: int, timeout_s: float) -> dict:
    """POST /v1/profile: the server profiles its next ``steps`` decode steps under its current load."""
    import httpx

    check_steps(steps)
    r = httpx.post(f"{base_url.rstrip('/')}/v1/profile", params={"steps": steps, "timeout": timeout_s},
                   timeout=timeout_s + 30)
    if r.status_code == 404:
        raise BadRequestError(f"{base_url} has no /v1/profile: start the server with --enable-profile-endpoint",
                              param="base_url")
    if r.status_code != 200:
        msg = (r.json().get("error") or {}).get("message") if "json" in r.headers.get("content-type", "") else r.text
        raise BadRequestError(f"{base_url}/v1/profile answered {r.status_code}: {msg}", param="base_url")
    return r.json()


def profile_server(base_url: str, steps: int, timeout_s: float, batch_size: int | None = None,
                   input_len: int = 128) -> dict:
    """The server's profile; with ``batch_size``, under ``batch_size`` streams this function holds open."""
    if batch_size is None:
        return fetch_profile(base_url, steps, timeout_s)
    from graphserve.analysis.profile_load import HeldStreams

    with HeldStreams(base_url, batch_size, input_len, max_tokens_for(steps) * 4) as held:
        held.wait_decoding(timeout_s)
        result = fetch_profile(base_url, steps, timeout_s)
    result["batch_size"] = batch_size
    return result


def profile_level(base_url: str, concurrency: int, steps: int, input_len: int, output_dir: str,
                  sweep_dir: str, timeout_s: float = 300.0) -> dict:
    """`sweep --profile`: after a level's load, the same number of requests held in decode and profiled,
    so the level's own measurements are not perturbed by the profile (its eager phase runs slower)."""
    from graphserve.errors import GraphserveError

    try:
        out = profile_server(base_url, steps, timeout_s, concurrency, input_len)
    except (GraphserveError, OSError) as exc:
        return {"error": f"no profile at C={concurrency}: {getattr(exc, 'message', None) or exc}"}
    out["png"] = os.path.relpath(write_profiles([out], output_dir)["png"], sweep_dir)
    return out


# -- output -----------------------------------------------------------------------------------------

WALL_TIME_NOTE = ("shares are of each step's wall time on its timeline (on the GPU from the previous step's last "
                  "kernel to its own last; on CPU its iteration); time during which kernels of several categories "
                  "overlap (programmatic dependent launch, several streams) is split evenly among them, so the "
                  "shares add up to 100%; busy ms sums each category's kernel time, overlaps counted once per "
                  "kernel")
SUMMED_NOTE = ("this profile predates wall-time attribution: its categories sum kernel durations, so time during "
               "which kernels overlapped is counted more than once")


def attribution_note(profile: Mapping[str, Any]) -> str:
    """What the shares of ``profile`` are: wall time, or (in files written before it was) summed kernel time."""
    phases = [p for p in profile.get("phases", []) if "error" not in p]
    return WALL_TIME_NOTE if all("busy_ms" in p for p in phases) else SUMMED_NOTE


def _span_ms(phase: Mapping[str, Any]) -> float:
    return phase.get("span_ms") or phase["step_ms"]


def profile_rows(profile: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Table of one profile: a row per category, its wall ms, its % of the step's span and its busy ms, per
    phase. Profiles written before busy time was kept show no busy values, and 0 for categories added since."""
    phases = [p for p in profile.get("phases", []) if "error" not in p]
    head = ["per step (wall time, overlaps split)"] + [f"{p['mode']} (batch {p['batch_size']}) {u}" for p in phases
                                                       for u in ("ms", "%", "busy ms")]

    def cells(p: Mapping[str, Any], ms: float, busy: float | None) -> tuple[str, str, str]:
        return f"{ms:.3f}", f"{100 * ms / _span_ms(p):.1f}", "" if busy is None else f"{busy:.3f}"

    rows = []
    for c in CATEGORIES:
        rows.append([LABELS[c]] + [x for p in phases for x in cells(
            p, p["categories_ms"].get(c, 0.0), None if c == GAPS else p.get("busy_ms", {}).get(c))])
    rows.append(["sum: the step's span"] + [x for p in phases for x in cells(
        p, sum(p["categories_ms"].values()), sum(p["busy_ms"].values()) if "busy_ms" in p else None)])
    if all("overlapped_ms" in p for p in phases):
        rows.append(["  of it 2+ kernels at once (split)"] + [x for p in phases
                                                              for x in cells(p, p["overlapped_ms"], None)])
    rows.append(["measured step time (mean)"] + [x for p in phases for x in cells(p, p["step_ms"], None)])
    if all("step_ms_median" in p for p in phases):  # profiles written before the median was kept lack it
        rows.append(["  median [min-max]"] + [x for p in phases for x in (
            f"{p['step_ms_median']:.3f}", "[{:.2f}-{:.2f}]".format(*p["step_ms_range"]), "")])
    return head, rows


def headline(phase: Mapping[str, Any], top: int = 4) -> str:
    """The phase's largest wall-time shares, in one line."""
    span = _span_ms(phase)
    cats = sorted(phase["categories_ms"].items(), key=lambda kv: -kv[1])[:top]
    shares = ", ".join(f"{LABELS[c]} {100 * v / span:.1f}%" for c, v in cats)
    return f"{phase['mode']} (batch {phase['batch_size']}): {shares} of {span:.3f} ms wall per step"


def format_profile(profile: Mapping[str, Any]) -> str:
    head, rows = profile_rows(profile)
    table = [head] + rows
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = [headline(p) for p in profile.get("phases", []) if "error" not in p]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
              for r in table]
    lines.append(attribution_note(profile))
    for p in profile.get("phases", []):
        if "error" in p:
            lines.append(f"{p['mode']}: {p['error']}")
            continue
        if p.get("attribution") == "eager":
            lines.append(f"{p['mode']}: kernel times attributed from the eager phase (see note)")
        top = ", ".join(f"{k['name'][:48]} {k['ms']:.3f}" for k in p.get("top_kernels", [])[:5])
        lines.append(f"{p['mode']} top kernels/ops (busy ms per step): {top}")
    lines += [f"note: {n}" for n in profile.get("notes", [])]
    return "\n".join(lines)


def plot_profiles(profiles: Sequence[Mapping[str, Any]], path: str) -> None:
    """One stacked bar per (batch size, phase): wall ms per category, the measured step time marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"B={p.get('batch_size', '?')} {ph['mode']}", ph) for p in profiles for ph in p.get("phases", [])
            if "error" not in ph]
    # tall enough for the legend's nine entries too, which a one-bar chart cut off at the top
    fig, ax = plt.subplots(figsize=(10, max(2.8, 1.2 + 0.55 * len(bars))))
    for y, (_, ph) in enumerate(bars):
        left = 0.0
        for k, c in enumerate(CATEGORIES):
            w = ph["categories_ms"].get(c, 0.0)
            ax.barh(y, w, left=left, color=f"C{k}", label=LABELS[c] if y == 0 else None)
            left += w
        ax.plot([ph["step_ms"]] * 2, [y - 0.4, y + 0.4], "k-", lw=2, label="measured step" if y == 0 else None)
    ax.set_yticks(range(len(bars)), [b for b, _ in bars])
    ax.invert_yaxis()
    ax.set_xlabel("wall ms per decode step (overlapped kernels' time split among their categories)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_profiles(profiles: list[dict], output_dir: str) -> dict[str, str]:
    os.makedirs(output_dir, exist_ok=True)
    paths = {"json": os.path.join(output_dir, "profile.json"), "png": os.path.join(output_dir, "profile.png")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump({"profiles": profiles}, f, indent=1)
    plot_profiles(profiles, paths["png"])
    return paths


def refuse_engine_flags(args: argparse.Namespace) -> None:
    """Engine flags configure the in-process engine of --model; against a server they would do nothing."""
    import dataclasses

    from graphserve.config import EngineConfig

    for f in dataclasses.fields(EngineConfig):
        if f.name in ("model", "seed") or not hasattr(args, f.name):
            continue
        default = None if f.name == "cuda_graph_bs" else f.default
        if getattr(args, f.name) != default:
            flag = "--" + f.name.replace("_", "-")
            raise bad_field(f.name, getattr(args, f.name), f"{flag} configures the engine of --model; the server at "
                            "--base-url keeps the flags it was started with")


def run(args: argparse.Namespace) -> int:
    check_steps(args.steps)
    if not args.timeout > 0:
        raise bad_field("timeout", args.timeout, "must be > 0 seconds")
    if args.input_len < 1:
        raise bad_field("input_len", args.input_len, "must be >= 1 prompt token")
    sizes = parse_batch_sizes(args.batch_size)
    if bool(args.base_url) == bool(args.model):
        raise bad_field("base_url", args.base_url, "give either --base-url URL or --model MODEL")
    if args.base_url:
        refuse_engine_flags(args)
    profiles = []
    if args.model:
        from graphserve.config import config_from_args
        from graphserve.engine.core import EngineCore

        core = EngineCore(config_from_args(args, args.model))
        for b in sizes or [1]:
            profiles.append(profile_in_process(core, b, args.steps, args.input_len, args.seed))
            print(f"== batch {b}\n{format_profile(profiles[-1])}\n", flush=True)
    else:
        for b in sizes or [None]:
            profiles.append(profile_server(args.base_url, args.steps, args.timeout, b, args.input_len))
            print(f"== batch {b or 'as served'}\n{format_profile(profiles[-1])}\n", flush=True)
    paths = write_profiles(profiles, args.output_dir)
    print("\n".join(f"wrote {p}" for p in paths.values()))
    return 0
