"""Programmatic dependent launch on and off: the same decode step captured both ways, timed in turns.

For each model and batch size: one model load, one KV cache, two CUDA-graph captures of the decode step
(kernels/pdl.py: ``pdl(False)`` and ``pdl(True)``), replayed alternately for ``--rounds`` rounds so clock and
thermal drift fall on both alike; each side's time is the median of its rounds. MoE models route uniformly
(``--moe-routing uniform``), so both sides touch the same experts. The floor is the bytes the step must read
(ModelDescription.decode_read_bytes, with the experts the replay actually touched) over the best read
bandwidth measured in this run (benchmarks/roofline.py).

Run: python3 -m benchmarks.pdl [--models dummy:qwen3-30b-a3b dummy:llama3-8b dummy:deepseek-v2-lite]
     [--fp8-models dummy:llama3-8b] [--bs 1 8] [--ctx 1024]
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.moe import experts_touched, set_routing
from benchmarks.roofline import measured_read_bw
from graphserve.config import EngineConfig
from graphserve.engine.graphs import GraphRunner
from graphserve.kernels.pdl import pdl, pdl_on
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.layers.forward_batch import contiguous_batch
from graphserve.models.loader import load_model

COLS = ["model", "quantization", "bs", "ctx", "off_ms", "on_ms", "speedup", "floor_ms", "ratio_off", "ratio_on"]


def bench_model(name: str, quantization: str, sizes: list[int], ctx: int, rounds: int, bw) -> list[dict]:
    device = torch.device("cuda")
    cfg = EngineConfig(model=name, device="cuda", quantization=quantization, max_model_len=ctx + 64)
    loaded = load_model(cfg, device)
    model, info, desc = loaded.model, loaded.info, loaded.info.description
    layers = set_routing(model, "uniform")
    bsz = cfg.block_size
    kv_caches = info.kv.allocate(max(sizes) * (-(-(ctx + 1) // bsz)) + 2, bsz, device, fill="random")
    backend = TritonAttentionBackend()
    rows = []
    with torch.inference_mode():
        graphs = {}
        for on in (False, True):
            with pdl(on):
                graphs[on] = GraphRunner(model, backend, kv_caches, sizes, (ctx + 64) // bsz + 1, cfg.max_model_len,
                                         device)  # fmt: skip
                graphs[on].capture()
        for bs in sizes:
            batch = contiguous_batch([1] * bs, [ctx + 1] * bs, kv_caches, backend, vocab_size=info.vocab_size)
            times: dict[bool, list[float]] = {False: [], True: []}
            tokens = {on: graphs[on].replay(batch).argmax(-1) for on in (False, True)}
            for _ in range(rounds):
                for on in (False, True):
                    step = lambda g=graphs[on], b=batch: g.replay(b).argmax(-1)  # noqa: E731
                    times[on].append(cuda_time_ms(step, warmup=2, iters=10))
            touched = experts_touched(layers) if layers else None
            nbytes = desc.decode_read_bytes(bs, bs * (ctx + 1), touched)
            off, on = statistics.median(times[False]), statistics.median(times[True])
            for ms in (off, on):
                bw.observe(f"{name} {quantization} decode bs={bs}", nbytes, ms)
            rows.append({"model": name, "quantization": quantization, "bs": bs, "ctx": ctx, "off_ms": off,
                         "on_ms": on, "speedup": off / on, "bytes": nbytes, "experts_touched": touched,
                         "same_tokens": bool(torch.equal(tokens[False], tokens[True])),
                         "off_rounds_ms": times[False], "on_rounds_ms": times[True]})
            print(f"{name} {quantization} bs={bs}: PDL off {off:.3f} ms, on {on:.3f} ms ({off / on:.3f}x)")
        del graphs
    del model, loaded, kv_caches
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["dummy:qwen3-30b-a3b", "dummy:llama3-8b", "dummy:deepseek-v2-lite"])
    p.add_argument("--fp8-models", nargs="*", default=["dummy:llama3-8b"], help="run again with --quantization fp8")
    p.add_argument("--bs", nargs="+", type=int, default=[1, 8])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds} is invalid: must be >= 1")
    if not pdl_on(torch.device("cuda")):
        p.error("this GPU, Triton or GRAPHSERVE_PDL setting cannot launch with PDL: nothing to compare")
    bw = measured_read_bw()
    print(bw.describe())
    rows = []
    for quantization, models in (("none", args.models), ("fp8", args.fp8_models)):
        for m in models:
            rows += bench_model(m, quantization, args.bs, args.ctx, args.rounds, bw)
    for r in rows:  # every row against the best rate of the whole run
        r["floor_ms"] = bw.floor_ms(r["bytes"])
        r["ratio_off"], r["ratio_on"] = r["off_ms"] / r["floor_ms"], r["on_ms"] / r["floor_ms"]
    print_table(rows, COLS)
    write_result("pdl", {"read_bandwidth": bw.summary(), "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
