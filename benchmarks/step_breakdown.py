"""Where a decode step's time goes, per kernel family, against the floor.

Profiles one eager decode step with torch.profiler (CUDA activity; launched without programmatic
dependent launch, whose early-started kernels would count their wait for the previous kernel as
their own time), sums device time per kernel family (matmuls, attention, norm, rotary, KV write,
SiLU·mul, activation quantization, the greedy sample's argmax, other), and compares the sum with the time of
the same step from its CUDA graph (captured as the engine runs it) followed by the sampler's greedy argmax
(kernels/argmax.py), as benchmarks.decode and benchmarks.fp8 time a step: step − kernel sum is the time the
GPU sits between kernels, negative where PDL overlaps neighbours. The replay alone is shown beside it. Each family's bytes
floor is shown beside it where it is a pure read of weights or KV (None where it is not), at the best read rate of the
run: the probes' (run again after the work), or a family's or the whole step's own where it read faster. A MoE model's
weights are those of the experts the profiled step's router chose (its own counts), as benchmarks.moe and
benchmarks.fp8 count them.

The captured step is also profiled as it replays (``boundaries``): its kernels in launch order, with PDL as the engine
captures it, and at each kernel boundary the time from one kernel's end to the next one's start, summed over the
step's layers per pair of kernel names. A positive sum is time the GPU held no kernel of the step; a negative one is
overlap (a kernel launched early waits inside itself, so its time in the replay counts that wait: ``graph_ms`` beside
the eager ``ms`` of each kernel).

Run: python3 -m benchmarks.step_breakdown [--model dummy:llama3-8b] [--bs 1] [--ctx 512]
     [--quantization fp8] [--kv-cache-dtype fp8_e4m3]
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.decode import make_batch
from benchmarks.moe import experts_touched, moe_layers, touched_total
from benchmarks.roofline import measured_read_bw
from graphserve.config import EngineConfig
from graphserve.engine.graphs import GraphRunner
from graphserve.kernels.argmax import greedy_argmax
from graphserve.kernels.pdl import pdl
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.models.loader import load_model

FAMILIES = [("sampling (argmax)", ("argmax",)), ("attention", ("decode", "extend", "_attn")), ("qk_norm_rope_kv", ("qk_norm_rope",)),
            ("kv_write", ("kv_write",)), ("norm", ("rms_norm",)),
            ("rotary", ("rotary",)), ("silu_mul", ("silu",)), ("activation quant", ("quant_kernel",)),
            # the FP4 streaming matmuls, split-K's second pass and the FP4->e4m3 widening before an FP8 matmul
            ("matmul", ("gemm", "gemv", "w8a8", "sm90", "cutlass", "nvjet", "fp4_stream", "split_sum", "fp4_to_fp8")),
            ("copy/other", ("",))]


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "copy/other"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:llama3-8b")
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--quantization", default="none", help="as graphserve serve --quantization (e.g. fp8)")
    p.add_argument("--kv-cache-dtype", default="auto", help="as graphserve serve --kv-cache-dtype (e.g. fp8_e4m3)")
    args = p.parse_args()
    device = torch.device("cuda")
    cfg = EngineConfig(model=args.model, device="cuda", max_model_len=args.ctx + 64,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    routed = moe_layers(model)  # the model's own router; [] for a dense model
    num_blocks = args.bs * (args.ctx // cfg.block_size + 2) + 2
    kv = info.kv.allocate(num_blocks, cfg.block_size, device, fill="random")
    backend = TritonAttentionBackend()
    batch = make_batch(args.bs, args.ctx, kv, backend)
    # the profiled eager step carries the real-row count as a captured step does (MoE models build
    # their padding-row mask from it), so it launches the kernels that the replay runs
    batch.num_valid_tokens = torch.tensor(args.bs, device=device)
    graphs = GraphRunner(model, backend, kv, [args.bs], cfg.max_model_len // cfg.block_size + 1, cfg.max_model_len, device)
    read = measured_read_bw()
    with torch.inference_mode():
        graphs.capture()
        replay_ms = cuda_time_ms(lambda: graphs.replay(batch), warmup=5, iters=50)
        # the step as benchmarks.decode / benchmarks.fp8 time it: the replay and the greedy sample after it
        step_ms = cuda_time_ms(lambda: greedy_argmax(graphs.replay(batch)), warmup=5, iters=50)
        # the eager step launches without PDL: a kernel launched early waits inside itself for the one
        # before, and the profiler would count that wait as the kernel's own time
        with pdl(False):
            for _ in range(3):
                greedy_argmax(model.compute_logits(model.forward(batch.input_ids, batch.positions, batch)))
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                greedy_argmax(model.compute_logits(model.forward(batch.input_ids, batch.positions, batch)))
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as replayed:
            greedy_argmax(graphs.replay(batch))
            torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0.0, 0])
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            for table, key in ((per, family(evt.name)), (by_name, evt.name[:90])):
                table[key][0] += evt.device_time_total / 1e3
                table[key][1] += 1
    # what attention must read: every cached byte, or a sparse/windowed model's own count (description.kv_read_bytes)
    kv_bytes = info.description.kv_read_bytes(args.bs, args.bs * args.ctx)
    # a MoE step reads the experts its router chose: the profiled step's own counts (it ran last)
    touched = experts_touched(routed)
    weights = info.description.decode_read_bytes(args.bs, args.bs * args.ctx, touched) - kv_bytes
    # a sparse or compressed model's cache is read by more than its attention kernels (the indexer scores every key,
    # the compressor its checkpoints): their bytes price the step, not the attention family alone
    d = info.description
    dense_attention = d.kv_read_per_seq is None and not d.attn_topk
    rows = family_rows(per, step_ms, replay_ms, weights, kv_bytes, read, attention_owns_kv=dense_attention)
    print_table(rows, ["family", "kernels", "ms", "floor_ms"])
    # each kernel by name: how many launches a step makes and their mean time (what fusion would remove)
    kernels = [{"kernel": k, "launches": v[1], "ms": v[0], "us_each": 1e3 * v[0] / v[1]}
               for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])]
    print_table(kernels, ["kernel", "launches", "ms", "us_each"])
    boundaries, in_graph = replay_boundaries(replayed)
    for k in kernels:
        k["graph_ms"] = in_graph.get(k["kernel"])
    print_table(boundaries[:12], ["boundary", "count", "gap_ms", "idle_ms", "overlap_ms"])
    variant = "".join(f"_{v}" for v in (args.quantization, args.kv_cache_dtype) if v not in ("none", "auto"))
    write_result(f"step_breakdown_{args.model.split(':')[-1]}{variant}_bs{args.bs}_ctx{args.ctx}",
                 {"model": args.model, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
                  "bs": args.bs, "ctx": args.ctx, "experts_touched": touched_total(touched), "read": read.summary(), "rows": rows,
                  "kernels": kernels, "boundaries": boundaries})


def family_rows(per: dict[str, list], step_ms: float, replay_ms: float, weights: float, kv_bytes: float,
                read, attention_owns_kv: bool = True) -> list[dict]:
    """One row per kernel family (``per``: family -> [ms, launches] of the profiled eager step), then the gap between
    kernels, the step (graph replay + argmax, ``step_ms``) and the replay alone. ``floor_ms`` where the family is a
    pure read: the weights for the matmuls, the KV for attention, both for the step; None where no floor is known.

    The floors come last, at the best read rate of the run (``read``: benchmarks.roofline.ReadBandwidth): first the
    rates this run's own work reached (each read family's bytes over its time, the whole step's over the step's),
    then the probes once more, so a GPU that clocked up after the first probes does not leave the floors generous.
    ``attention_owns_kv`` False (other kernels read part of the cache): attention gets no floor of its own."""
    owned = (("matmul", weights),) + ((("attention", kv_bytes),) if attention_owns_kv else ())
    for fam, nbytes in owned:
        if fam in per:
            read.observe(f"{fam} kernels, profiled", nbytes, per[fam][0])
    read.observe("decode step (graph replay + argmax)", weights + kv_bytes, step_ms)
    read.observe("decode step (graph replay)", weights + kv_bytes, replay_ms)
    read.probe_again()
    floors = {fam: read.floor_ms(nbytes) for fam, nbytes in owned}
    rows = [{"family": k, "kernels": v[1], "ms": v[0], "floor_ms": floors.get(k)} for k, v in sorted(per.items())]
    kernel_sum = sum(r["ms"] for r in rows)
    launches = sum(v[1] for v in per.values())
    step_floor = read.floor_ms(weights + kv_bytes)
    rows.append({"family": "between kernels (step - sum)", "kernels": 0, "ms": step_ms - kernel_sum, "floor_ms": None})
    rows.append({"family": "step: graph replay + argmax", "kernels": launches, "ms": step_ms, "floor_ms": step_floor})
    rows.append({"family": "graph replay alone", "kernels": launches - per.get("sampling (argmax)", [0.0, 0])[1],
                 "ms": replay_ms, "floor_ms": step_floor})
    return rows


def replay_boundaries(prof) -> tuple[list[dict], dict[str, float]]:
    """The profiled replay's kernels in start order: per (kernel, next kernel) pair of names, how often the step
    crosses that boundary and the sum of next start - this end over those crossings (``gap_ms``), split into its
    positive part (``idle_ms``: no kernel of the step running) and negative part (``overlap_ms``); and each kernel
    name's summed time in the replay. Empty where the profiler saw no kernel inside the graph."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:90]) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    pairs = collections.defaultdict(lambda: [0, 0.0, 0.0])
    in_graph = collections.defaultdict(float)
    for start, end, name in spans:
        in_graph[name] += (end - start) / 1e3
    for (_, end, name), (start, _, after) in zip(spans, spans[1:]):
        gap = (start - end) / 1e3
        entry = pairs[f"{name[:40]} -> {after[:40]}"]
        entry[0] += 1
        entry[1 if gap > 0 else 2] += gap
    rows = [{"boundary": k, "count": c, "gap_ms": idle + over, "idle_ms": idle, "overlap_ms": over}
            for k, (c, idle, over) in pairs.items()]
    return sorted(rows, key=lambda r: -r["idle_ms"]), dict(in_graph)


if __name__ == "__main__":
    main()
