"""`graphserve doctor LOGFILE`: read a graphserve, SGLang or vLLM server log and say what went
wrong and which flag to turn.

It reads the step lines (graphserve and SGLang share ``Decode batch, #running-req: ...``; vLLM
prints ``Avg generation throughput: ... Running: N reqs``), CUDA-graph capture lines and the
server-args dump, PyTorch OOM messages and preemption warnings (graphserve's when DeepSeek-V4's latent pages, not
KV blocks, ran out, and the pages' usage on its step line), graphserve's start-up
calibration of decode batches above the largest captured size, and its warnings of kernels compiled
after ready; NCCL's INFO lines (``NCCL_DEBUG=INFO``), ``nvidia-smi topo -m`` pasted into the log and
graphserve's all-reduce topology and table (distributed/allreduce_choice.py), to name an all-reduce over PCIe
as the bottleneck. A clean log gives no findings.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from graphserve.analysis.scaling import fit_step_time
from graphserve.errors import BadRequestError

NUM = r"([0-9]+(?:\.[0-9]+)?)"
DECODE = re.compile(r"Decode batch[.,]")
PREFILL = re.compile(r"Prefill batch[.,(]")
VLLM_STATS = re.compile(r"Avg generation throughput: " + NUM + r" tokens/s.*?Running: (\d+) reqs.*?Waiting: (\d+) reqs")
FIELD = {
    "running": re.compile(r"#running-req: (\d+)"),
    "usage": re.compile(r"(?<!swa )token usage: " + NUM),
    "graph": re.compile(r"cuda graph: (True|False)"),
    "gen": re.compile(r"gen throughput \(token/s\): " + NUM),
    "queue": re.compile(r"#queue-req: (\d+)"),
}
VLLM_KV = re.compile(r"(?:GPU )?KV cache usage: " + NUM + "%")
VLLM_PREEMPTIONS = re.compile(r"Preemptions: (\d+)")
CAPTURE_BS = re.compile(r"Capture cuda graph[^\[]*?\bbs \[([0-9, ]+)\]", re.I)
CAPTURE_SIZES = re.compile(r"cudagraph_capture_sizes['\"]?[=:] ?\[([0-9, ]+)\]")
MAX_BS = re.compile(r"(?:cuda_graph_max_bs|--cuda-graph-max-bs|max_cudagraph_capture_size|max_capture_size)['\"]?[ =:]+(\d+)")
OOM = re.compile(r"(?:CUDA out of memory|OutOfMemoryError).*?Tried to allocate " + NUM + r" (GiB|MiB|KiB)")
OOM_FREE = re.compile(r"of which " + NUM + r" (GiB|MiB|KiB) is free")
PREEMPT = re.compile(r"is preempted by PreemptionMode|Decode out of memory happened|#retracted_req|retract(?:ed)? \d+ req",
                     re.I)
# engine/core.py's line when latent pages (DeepSeek-V4), not KV blocks, ran out; and the step line's page fields
PAGE_PREEMPT = re.compile(r"preempted (\d+) request\(s\) for want of latent pages")
PAGE_USAGE = re.compile(r"latent page usage: " + NUM)
CAPTURE_FAIL = re.compile(r"capture (?:cuda|CUDA) graph failed|CUDA graph capture failed|failed to capture (?:cuda|CUDA)",
                          re.I)
UNIT = {"GiB": 1.0, "MiB": 1 / 1024, "KiB": 1 / 1024**2}
# Lines only graphserve prints (server/launch.py, engine/core.py, engine/memory.py): its step line is SGLang's.
GRAPHSERVE_MARKS = re.compile(r"\] serving \S+ on http://|engine ready: model=\S+ device=|"
                              r"memory plan: [0-9.]+ GiB per GPU × --mem-fraction-static")
# engine/startup.py's calibration line (OversizeCalibration.log_line)
OVERSIZE_COSTS = re.compile(r"decode batches above (\d+) \(up to --max-running-requests (\d+)\) run as ([a-z-]+): "
                            r"split-graph " + NUM + r" ms, eager " + NUM + r" ms, full graph " + NUM + r" ms at batch (\d+)")
# engine/compile_watch.py's warning: a Triton kernel compiled after the server said ready
LATE_COMPILE = re.compile(r"kernel (\S+) compiled after ready")
# The ranks and the links of their all-reduce: SGLang's/vLLM's args dump or graphserve's ready line; NCCL's
# INFO lines; nvidia-smi's matrix rows; graphserve's own all-reduce block
TP_SIZE = re.compile(r"\btp_size=(\d+)|tensor_parallel_size=(\d+)|engine ready: .*\btp=(\d+)|nRanks (\d+)")
NCCL_HOST_PATH = re.compile(r"NCCL INFO (?:Channel \S+ : .* via SHM|Could not enable P2P)|NCCL_P2P_DISABLE=1")
NCCL_NVLINK = re.compile(r"NCCL INFO .*(?:NVLS|NVLink|via P2P/.*NVL)")
TOPO_ROW = re.compile(r"^\s*(?:\S+\s+)?GPU(\d+)\s+((?:X|NV\d+|PIX|PXB|PHB|NODE|SYS)(?:\s+(?:X|NV\d+|PIX|PXB|PHB|NODE|SYS))+)")
GS_TOPOLOGY = re.compile(r"all-reduce topology: ([a-z-]+)")
GS_ALLREDUCE_ROW = re.compile(r"all-reduce +(\d+ [KM]iB): (.*) -> (\w+)")
GRAPHS_DID_NOT_HELP = 1.05  # graphs on within 5% of graphs off: launch overhead is not what bounds the step
FULL_GRAPH_MIN_GAIN = 1.05  # below this the split path costs too little to be worth a larger graph pool


@dataclass
class Finding:
    kind: str
    severity: str  # "error" | "warning"
    title: str
    explanation: str
    flags: list[str]
    evidence: list[tuple[int, str]] = field(default_factory=list)  # (1-based line number, line text)


@dataclass
class StepLine:
    line_no: int
    text: str
    running: int
    gen_tok_s: float | None
    graph: bool | None
    queue: int | None
    usage: float | None


def _evidence(items: list[StepLine] | list[tuple[int, str]], limit: int = 5) -> list[tuple[int, str]]:
    pairs = [(s.line_no, s.text) if isinstance(s, StepLine) else s for s in items]
    return pairs[:limit] if len(pairs) <= limit else pairs[: limit - 1] + [pairs[-1]]


def detect_format(lines: list[str]) -> str:
    text = "\n".join(lines[:2000])
    if GRAPHSERVE_MARKS.search(text):
        return "graphserve"
    if "Avg generation throughput" in text or "vllm" in text.lower():
        return "vllm"
    if "graphserve" in text.lower():
        return "graphserve"
    if "Decode batch" in text or "sglang" in text.lower() or "ServerArgs" in text:
        return "sglang"
    return "unknown"


def parse_steps(lines: list[str]) -> list[StepLine]:
    steps = []
    for i, line in enumerate(lines, 1):
        if DECODE.search(line):
            f = {k: rx.search(line) for k, rx in FIELD.items()}
            if not f["running"]:
                continue
            steps.append(StepLine(i, line.rstrip(), int(f["running"].group(1)),
                                  float(f["gen"].group(1)) if f["gen"] else None,
                                  f["graph"].group(1) == "True" if f["graph"] else None,
                                  int(f["queue"].group(1)) if f["queue"] else None,
                                  float(f["usage"].group(1)) if f["usage"] else None))
        elif m := VLLM_STATS.search(line):
            kv = VLLM_KV.search(line)
            steps.append(StepLine(i, line.rstrip(), int(m.group(2)), float(m.group(1)), None, int(m.group(3)),
                                  float(kv.group(1)) / 100.0 if kv else None))
    return steps


def _largest_captured(lines: list[str]) -> tuple[int | None, tuple[int, str] | None]:
    best, where = None, None
    for i, line in enumerate(lines, 1):
        m = CAPTURE_BS.search(line) or CAPTURE_SIZES.search(line)
        if m:
            sizes = [int(x) for x in m.group(1).replace(" ", "").split(",") if x]
            if sizes:
                best, where = max(sizes), (i, line.rstrip())
        elif best is None and (m := MAX_BS.search(line)):
            best, where = int(m.group(1)), (i, line.rstrip())
    return best, where


def _eager_oversize(steps: list[StepLine], lines: list[str]) -> tuple[Finding | None, int | None]:
    largest, where = _largest_captured(lines)
    if largest is None:  # infer it: the biggest batch that did replay a graph
        graphed = [s.running for s in steps if s.graph]
        largest = max(graphed) if graphed else None
    if largest is None:
        return None, None
    bad = [s for s in steps if s.graph is False and s.running > largest]
    if not bad:
        return None, largest
    peak = max(s.running for s in bad)
    ev = ([where] if where else []) + _evidence(bad, 4)
    return Finding(
        "eager_oversize", "warning", f"{len(bad)} decode batches above the largest captured size {largest} ran eagerly",
        f"Batches of up to {peak} running requests left the CUDA-graph path (cuda graph: False). Eager steps are "
        f"slower and allocate activations that were not planned when the KV pool was sized, which is how an OOM "
        f"follows.", [f"--cuda-graph-max-bs {peak}", f"--max-running-requests {largest}"], ev), largest


def _oom(lines: list[str], eager: Finding | None, largest: int | None) -> list[Finding]:
    out = []
    for i, line in enumerate(lines, 1):
        m = OOM.search(line)
        if not m or CAPTURE_FAIL.search(line):  # a failed capture is reported as such, with its flags
            continue
        asked = float(m.group(1)) * UNIT[m.group(2)]
        free_m = OOM_FREE.search(line)
        free = float(free_m.group(1)) * UNIT[free_m.group(2)] if free_m else None
        head = f"CUDA out of memory: asked {asked:.2f} GiB" + (f" with {free:.2f} GiB free" if free is not None else "")
        if eager is not None:
            cause = (f"It follows decode batches above the largest captured size ({largest}) that ran eagerly: "
                     f"their activations were never reserved in the memory plan.")
            flags = eager.flags + ["--mem-fraction-static (lower it to leave room outside the static pool)"]
            ev = [(i, line.rstrip())] + eager.evidence[-2:]
        else:
            cause = "Something allocated more than the static pool left free (activations, a larger batch or chunk)."
            flags = ["--mem-fraction-static (lower it)", "--max-running-requests (lower it)",
                     "--chunked-prefill-size (lower it)"]
            ev = [(i, line.rstrip())]
        out.append(Finding("oom", "error", head, cause, flags, ev))
    return out


def _plateau(steps: list[StepLine]) -> Finding | None:
    pts = [s for s in steps if s.gen_tok_s and s.gen_tok_s > 0 and s.running > 0]
    if len({s.running for s in pts}) < 4:
        return None
    # Each running request gets one token per decode step, so step_ms = N · 1000 / (gen tok/s).
    fit = fit_step_time([s.running for s in pts], [s.running * 1000.0 / s.gen_tok_s for s in pts])
    n_max = max(s.running for s in pts)
    if fit.b_ms <= 0 or fit.n_at_90pct is None or fit.n_at_90pct >= n_max or fit.r2 < 0.8:
        return None
    lo = min(pts, key=lambda s: s.running)
    hi = max(pts, key=lambda s: s.running)
    return Finding(
        "throughput_plateau", "warning",
        f"throughput is flat while running requests grow: step ≈ {fit.a_ms:.0f} + {fit.b_ms:.1f}·N ms",
        f"From {lo.running} to {hi.running} running requests gen throughput went {lo.gen_tok_s:.1f} → "
        f"{hi.gen_tok_s:.1f} tok/s. Every extra request adds {fit.b_ms:.1f} ms to each step, so throughput cannot "
        f"pass {fit.asymptote_tok_s:.1f} tok/s and is at 90% of that by N ≈ {fit.n_at_90pct:.0f}. The per-request "
        f"cost dominates: more concurrency or CUDA graphs will not help; profile the per-request kernels "
        f"(attention over KV, MoE routing) or the communication.",
        ["--max-running-requests (more than ~" f"{max(1, round(fit.n_at_90pct))} only adds latency)"],
        _evidence([lo, hi]))


def _kv_and_queue(steps: list[StepLine], lines: list[str]) -> list[Finding]:
    out = []
    full = [s for s in steps if s.usage is not None and s.usage >= 0.95]
    if full:
        out.append(Finding("kv_full", "warning", f"KV pool full on {len(full)} step lines (token usage ≥ 0.95)",
                           "New requests wait and running ones get preempted when the KV pool has no free blocks.",
                           ["--mem-fraction-static (raise it)", "--max-running-requests (lower it)", "--tp (raise it)"],
                           _evidence(full)))
    pre = [(i, ln.rstrip()) for i, ln in enumerate(lines, 1) if PREEMPT.search(ln)]
    counted = [(s.line_no, s.text, int(m.group(1))) for s in steps if (m := VLLM_PREEMPTIONS.search(s.text))]
    pre += [(i, t) for i, t, n in counted if n > 0]
    if pre:
        storm = len(pre) >= 10
        out.append(Finding("preemption", "error" if storm else "warning",
                           f"{len(pre)} preemption {'lines (a preemption storm)' if storm else 'lines'}",
                           "Requests were evicted from the KV pool and must recompute their prefill: the pool is too "
                           "small for the running set.",
                           ["--mem-fraction-static (raise it)", "--max-running-requests (lower it)", "--tp (raise it)"],
                           _evidence(sorted(pre))))
    queued = [s for s in steps if s.queue is not None]
    if len(queued) >= 4:
        half = len(queued) // 2
        first = sum(s.queue for s in queued[:half]) / half
        second = sum(s.queue for s in queued[half:]) / (len(queued) - half)
        if queued[-1].queue >= 8 and second >= 2 * max(first, 1.0):
            out.append(Finding("queue_growing", "warning",
                               f"waiting queue grows: {queued[0].queue} → {queued[-1].queue} requests",
                               "Requests arrive faster than the server finishes them; latency grows without bound.",
                               ["--max-running-requests (raise it if KV allows)", "lower the request rate"],
                               _evidence([queued[0], queued[-1]])))
    return out


def _latent_pages(lines: list[str]) -> Finding | None:
    """Latent pages (DeepSeek-V4's window latents, a resource beside the KV blocks) ran out: preemptions for them
    while blocks were free, or step lines with nearly every page held by running windows."""
    pre = [(i, ln.rstrip()) for i, ln in enumerate(lines, 1) if PAGE_PREEMPT.search(ln)]
    full = [(i, ln.rstrip()) for i, ln in enumerate(lines, 1)
            if DECODE.search(ln) and (m := PAGE_USAGE.search(ln)) and float(m.group(1)) >= 0.95]
    if not pre and not full:
        return None
    title = (f"{len(pre)} preemption lines for want of latent pages, not KV blocks" if pre
             else f"latent pages full on {len(full)} step lines (latent page usage ≥ 0.95)")
    return Finding("latent_pages_short", "error" if len(pre) >= 10 else "warning", title,
                   "The running requests' windows hold every latent page while KV blocks are free: the pages, sized "
                   "for the windows of --max-running-requests at --chunked-prefill-size (twice over, for cached "
                   "prefixes), are what the pool lacks, not blocks.",
                   ["--max-running-requests (set it to the concurrency served: the pages are sized for it)",
                    "--chunked-prefill-size (lower it)", "--kv-cache-gb / --mem-fraction-static (raise it)"],
                   _evidence(sorted(pre + full)))


def _oversize_costs(steps: list[StepLine], lines: list[str]) -> Finding | None:
    """graphserve measured at start-up how much faster a graph captured at the running size would be."""
    hit = next(((i, ln.rstrip(), m) for i, ln in enumerate(lines, 1) if (m := OVERSIZE_COSTS.search(ln))), None)
    if hit is None:
        return None
    line_no, text, m = hit
    largest, rows, mode = int(m.group(1)), int(m.group(2)), m.group(3)
    split_ms, eager_ms, full_ms = float(m.group(4)), float(m.group(5)), float(m.group(6))
    chosen_ms = min(split_ms, eager_ms)
    gain = chosen_ms / full_ms if full_ms > 0 else 0.0
    if gain < FULL_GRAPH_MIN_GAIN:
        return None
    above = [s for s in steps if s.running > largest]
    seen = (f"{len(above)} step lines ran above {largest} requests (up to {max(s.running for s in above)})."
            if above else f"No step line in this log ran above {largest} requests yet; under more load they will.")
    return Finding(
        "oversize_full_graph", "warning",
        f"decode batches above {largest} run {gain:.2f}× slower than a graph captured at {rows}",
        f"At start-up a batch of {rows} took {chosen_ms:.2f} ms as {mode} against {full_ms:.2f} ms replayed from a "
        f"graph captured at that size: each step above {largest} requests costs {gain:.2f}× what it would with "
        f"--cuda-graph-max-bs {rows}. {seen} The larger graph pool is planned like the others (graphserve plan "
        f"shows its memory).", [f"--cuda-graph-max-bs {rows}"], [(line_no, text)] + _evidence(above, 3))


def _capture_failures(lines: list[str]) -> Finding | None:
    bad = [(i, ln.rstrip()) for i, ln in enumerate(lines, 1) if CAPTURE_FAIL.search(ln)]
    if not bad:
        return None
    asked = next((m for _, ln in bad if (m := OOM.search(ln))), None)
    title = "CUDA graph capture failed" + (f" asking {asked.group(1)} {asked.group(2)}" if asked else "")
    return Finding("capture_failed", "error", title,
                   "Capture usually fails for lack of memory for the largest batch sizes.",
                   ["--mem-fraction-static (lower it)", "--cuda-graph-max-bs (lower it)"], _evidence(bad))


def _late_compiles(lines: list[str]) -> Finding | None:
    late = [(i, ln.rstrip(), m.group(1)) for i, ln in enumerate(lines, 1) if (m := LATE_COMPILE.search(ln))]
    if not late:
        return None
    kernels = sorted({k for _, _, k in late})
    return Finding("late_compile", "warning",
                   f"{len(late)} kernel compile(s) after ready ({', '.join(kernels)})",
                   "The requests that met these shapes waited for Triton's compiler (hundreds of ms each), "
                   "and a TTFT percentile measured over them reads high. Each line names the arguments that "
                   "set the shape apart: the warm-up does not reach it, which is a bug to report with these "
                   "lines. No flag changes it.",
                   [], _evidence([(i, t) for i, t, _ in late]))


def _tp_size(lines: list[str]) -> tuple[int, tuple[int, str] | None]:
    best, where = 1, None
    for i, line in enumerate(lines, 1):
        if (m := TP_SIZE.search(line)) and (n := int(next(g for g in m.groups() if g))) > best:
            best, where = n, (i, line.rstrip())
    return best, where


def _links(lines: list[str]) -> tuple[str | None, list[tuple[int, str]]]:
    """"pcie" (peer-to-peer or through host memory), "nvlink" or None, and the lines that say so."""
    pcie: list[tuple[int, str]] = []
    for i, line in enumerate(lines, 1):
        text = line.rstrip()
        if NCCL_NVLINK.search(line) or ((m := GS_TOPOLOGY.search(line)) and m.group(1) == "nvlink"):
            return "nvlink", [(i, text)]
        if (m := TOPO_ROW.search(line)) and any(c.startswith("NV") for c in m.group(2).split()):
            return "nvlink", [(i, text)]
        if NCCL_HOST_PATH.search(line) or TOPO_ROW.search(line) or \
                ((m := GS_TOPOLOGY.search(line)) and m.group(1).startswith(("pcie", "no-peer"))):
            pcie.append((i, text))
    return ("pcie", pcie) if pcie else (None, [])


def _pcie_all_reduce(steps: list[StepLine], lines: list[str]) -> Finding | None:
    tp, tp_line = _tp_size(lines)
    kind, link_lines = _links(lines)
    if tp < 2 or kind != "pcie":
        return None
    host = any(NCCL_HOST_PATH.search(t) for _, t in link_lines)
    how = "NCCL through host memory (no peer-to-peer)" if host else "PCIe, no NVLink"
    on = [s for s in steps if s.graph is True and s.gen_tok_s]
    off = [s for s in steps if s.graph is False and s.gen_tok_s]
    graphs = ""
    ev = ([tp_line] if tp_line else []) + link_lines[:3]
    if on and off:
        on_tok, off_tok = (sum(s.gen_tok_s or 0.0 for s in x) / len(x) for x in (on, off))
        if on_tok <= off_tok * GRAPHS_DID_NOT_HELP:
            graphs = (f" CUDA graphs did not help ({off_tok:.0f} tok/s without, {on_tok:.0f} tok/s with): kernel "
                      "launches are not what bounds the step.")
            ev += [(off[0].line_no, off[0].text), (on[0].line_no, on[0].text)]
    rows = [(i, ln.rstrip()) for i, ln in enumerate(lines, 1) if GS_ALLREDUCE_ROW.search(ln)]
    if rows:
        ev.append(rows[0])
    return Finding(
        "allreduce_pcie", "warning",
        f"decode is bound by the all-reduce over PCIe: {tp} ranks, {how}",
        f"Each decode step all-reduces the hidden state about twice per layer across all {tp} GPUs. Decode's "
        f"messages are a few KB, so each all-reduce costs its latency, which over PCIe is several times NVLink's "
        f"(a published PCIe measurement at 4 KB: NCCL 19 µs, a one-shot push 4 µs){' and more again when every message is staged through host memory' if host else ''}.{graphs} "
        f"Fewer ranks per all-reduce, or fewer all-reduces per step, is what moves throughput.",
        [f"--tp (lower it, {tp} → {max(1, tp // 2)}, and run --dp replicas for the remaining GPUs)",
         "--ep / --ep-size (experts placed whole: one all-reduce per MoE layer instead of a split one)",
         "GRAPHSERVE_ALLREDUCE=oneshot|twoshot (graphserve: A/B the peer-memory paths against the measured choice)",
         "peer-to-peer between the GPUs (BIOS/hypervisor ACS and IOMMU settings), so NCCL stops going through host "
         "memory" if host else "NCCL_P2P_LEVEL (check that NCCL uses PCIe peer-to-peer)"],
        ev)


def diagnose_lines(lines: list[str]) -> list[Finding]:
    steps = parse_steps(lines)
    eager, largest = _eager_oversize(steps, lines)
    findings: list[Finding] = []
    findings += _oom(lines, eager, largest)
    if eager:
        findings.append(eager)
    if cap := _capture_failures(lines):
        findings.append(cap)
    if late := _late_compiles(lines):
        findings.append(late)
    if costs := _oversize_costs(steps, lines):
        findings.append(costs)
    findings += _kv_and_queue(steps, lines)
    if pages := _latent_pages(lines):
        findings.append(pages)
    if plat := _plateau(steps):
        findings.append(plat)
    if pcie := _pcie_all_reduce(steps, lines):
        findings.append(pcie)
    return findings


def diagnose(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise BadRequestError(f"LOGFILE={path!r} is not a readable file", param="logfile")
    lines = p.read_text(errors="replace").splitlines()
    return {"log": path, "format": detect_format(lines), "lines": len(lines),
            "findings": [asdict(f) for f in diagnose_lines(lines)]}


def format_report(rep: dict) -> str:
    out = [f"{rep['log']}: {rep['format']} log, {rep['lines']} lines, {len(rep['findings'])} findings"]
    if not rep["findings"]:
        out.append("no problems found")
    for f in rep["findings"]:
        change = f"\n  change: {', '.join(f['flags'])}" if f["flags"] else ""
        out.append(f"\n[{f['severity']}] {f['title']}\n  {f['explanation']}{change}")
        out += [f"  line {n}: {t}" for n, t in f["evidence"]]
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logfile", help="server log of graphserve, SGLang or vLLM")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    rep = diagnose(args.logfile)
    print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    return 1 if any(f["severity"] == "error" for f in rep["findings"]) else 0
