"""DeepSeek decode against its floor: dummy:deepseek-v2-lite whole steps, dummy:deepseek-v3-l4 per layer.

V2-Lite: one decode step replayed from its CUDA graph at batch 1, 64, 256, every sequence attending
over ``ctx`` cached tokens, routing uniform (``--routing router`` adds the random router's own
choice). Floor, as for the other MoE models (benchmarks/moe.py): the bytes the step must read —
dense weights (MLA projections, the dense first layer, router gates, shared experts), the lm_head,
the batch's embedding rows, the routed experts actually touched in that step (the layers' own
per-expert counts) and the latent KV in context (``ModelDescription.decode_read_bytes``) — over the
best read bandwidth measured in the same run.

V3-l4: DeepSeek-V3's first dense layer and first MoE layer at their real sizes, each replayed alone
from a CUDA graph at batch 1 and 64; floor: the layer's weights read (the MoE layer's gate, shared
expert and touched experts only) plus its latent KV.

Routing ``uniform`` is the issue's floor case; it overrides the router, so each MoE layer runs the
gate projection, the post-attention norm and the round-robin ids as separate launches. ``router``
runs the model's own routing, which at one row is V2-Lite's fused add + norm + gate launch.

Offline (``--offline N``, a run of its own): benchmarks/offline.py's measurement on dummy:deepseek-v2-lite,
credited as it credits: graphserve alone on the first N requests of the offline workload (input and
output lengths uniform in 100-1024), then both graphserve and transformers' ``generate`` (bf16, same
GPU) on one declared subset — the first ``--hf-requests`` requests, outputs cut to
``--hf-max-output-len`` — each side credited with the tokens it produced
(benchmarks/results/deepseek_offline.json).

Run: python3 -m benchmarks.deepseek [--quick] [--routing uniform router]   (deepseek_decode.json)
     python3 -m benchmarks.deepseek --offline 64 --hf-requests 16 --hf-max-output-len 128
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks.common import print_table, write_result
from benchmarks.decode import make_batch
from benchmarks.decode_setup import context_kv_caches
from benchmarks.kernels import graph_time_ms
from benchmarks.moe import bench_decode, set_routing
from benchmarks.roofline import measured_read_bw
from graphserve.config import EngineConfig
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.layers.moe import FusedMoE
from graphserve.models.loader import load_model

COLS = ["model", "bs", "ctx", "routing", "experts_touched", "step_ms", "floor_ms", "ratio", "ratio_datasheet"]
LAYER_COLS = ["model", "layer", "kind", "bs", "ctx", "routing", "layer_ms", "floor_ms", "ratio"]
V2_LITE = "dummy:deepseek-v2-lite"


def bench_v2_lite(bw, sizes: list[int], ctx: int, routings: list[str]) -> list[dict]:
    """Whole V2-Lite decode steps, measured as every MoE model is (benchmarks/moe.py)."""
    return bench_decode(V2_LITE, sizes, ctx, routings, bw, loop_bs=[])


def _layer_bytes(layer: torch.nn.Module, kv_bytes: int) -> int:
    """Weights one decode step of this layer reads (routed experts: only those touched) plus its KV."""
    total = kv_bytes
    for m in layer.modules():
        if isinstance(m, FusedMoE):
            per_expert = (m.w13_weight[0].numel() + m.w2_weight[0].numel()) * m.w13_weight.element_size()
            total += int((m.expert_counts > 0).sum().item()) * per_expert
    experts = {id(p) for m in layer.modules() if isinstance(m, FusedMoE) for p in (m.w13_weight, m.w2_weight)}
    return total + sum(p.numel() * p.element_size() for p in layer.parameters() if id(p) not in experts)


def bench_v3_layers(bw, sizes: list[int], ctx: int, routing: str) -> list[dict]:
    name = "dummy:deepseek-v3-l4"
    device = torch.device("cuda")
    cfg = EngineConfig(model=name, device="cuda", max_model_len=ctx + 64)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    set_routing(model, routing)
    kv_caches = context_kv_caches(info, max(sizes), ctx, cfg.block_size, device)
    backend = TritonAttentionBackend()
    rows = []
    with torch.inference_mode():
        for bs in sizes:
            batch = make_batch(bs, ctx, kv_caches, backend, info.vocab_size)
            hidden0 = torch.randn(bs, info.hidden_size, device=device, dtype=info.dtype)
            residual0 = torch.randn_like(hidden0)
            for idx in (0, 1):  # the dense layer, then the first MoE layer
                layer = model.model.layers[idx]
                hidden, residual = hidden0.clone(), residual0.clone()

                def step(layer=layer, hidden=hidden, residual=residual, residual0=residual0, batch=batch):
                    residual.copy_(residual0)  # the layer adds into its residual in place
                    layer(batch.positions, hidden, residual, batch)

                ms = graph_time_ms(step)
                # the cached tokens, as benchmarks.decode.step_cost counts them: the new token's K and V are made in the step
                nbytes = _layer_bytes(layer, bs * ctx * info.kv.bytes_per_token_per_layer)
                rows.append({"model": name, "layer": idx, "kind": "moe" if layer.is_moe else "dense", "bs": bs,
                             "ctx": ctx, "routing": routing, "layer_ms": ms, "bytes": nbytes})
                print(f"{name} layer {idx} bs={bs}: {ms:.3f} ms")
    del model, loaded, kv_caches
    return rows


def bench_offline(num_requests: int, hf_requests: int, hf_max_output_len: int, hf_batch: int | None) -> dict:
    from benchmarks.offline import hf_subset, measure_model, workload

    reqs = workload(256, 0, 32000)[:num_requests]
    subset = hf_subset(reqs, hf_requests, hf_max_output_len)
    return measure_model(V2_LITE, reqs, subset, hf_batch or len(subset), torch.device("cuda"))


def _write(bw, rows: list[dict], layers: list[dict]) -> None:
    """Every row against the best rate of the run so far; written after each part, so a later part that
    fails or runs out of time leaves the earlier rows on disk. A layer that read faster than the probes
    raises the floor first, so no row can beat it."""
    for r in layers:
        bw.observe(f"{r['model']} layer {r['layer']} bs={r['bs']} {r['routing']}", r["bytes"], r["layer_ms"])
    for r in rows:
        r.update(bw.ratios(r["step_ms"], r["bytes"]))
    for r in layers:
        r.update(bw.ratios(r["layer_ms"], r["bytes"]))
    write_result("deepseek_decode", {"read_bandwidth": bw.summary(), "rows": rows, "v3_layers": layers})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="V2-Lite at batch 1 and 64 only, no V3 layers")
    p.add_argument("--bs", nargs="+", type=int, default=[1, 64, 256])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--routing", nargs="+", default=["uniform"], choices=["uniform", "router"])
    p.add_argument("--v3-bs", nargs="*", type=int, default=[1, 64])
    p.add_argument("--offline", type=int, default=0, help="run only the offline comparison: graphserve on N requests")
    p.add_argument("--hf-requests", type=int, default=16, help="the subset both sides run: its first N requests")
    p.add_argument("--hf-max-output-len", type=int, default=128, help="the subset's outputs cut to this length")
    p.add_argument("--hf-batch", type=int, default=None, help="HF rows per generate call (default: the subset)")
    args = p.parse_args()
    start = time.perf_counter()
    if args.offline:
        if not 1 <= args.offline <= 256:
            p.error(f"--offline={args.offline} must be in 1..256, the offline workload's requests")
        row = bench_offline(args.offline, min(args.hf_requests, args.offline), args.hf_max_output_len, args.hf_batch)
        print_table([row], ["model", "requests", "tok_s", "hf_requests", "hf_max_output_len", "subset_tok_s",
                            "hf_tok_s", "ratio_vs_hf"])  # fmt: skip
        write_result("deepseek_offline", {"rows": [row]})
        print(f"offline comparison: {time.perf_counter() - start:.0f} s")
        return
    if args.quick:
        args.bs, args.v3_bs = [1, 64], []
    bw = measured_read_bw()
    print(bw.describe())
    rows = bench_v2_lite(bw, args.bs, args.ctx, args.routing)
    _write(bw, rows, [])
    print(f"V2-Lite decode: {time.perf_counter() - start:.0f} s")
    gc.collect()  # V2-Lite's 31 GB must be gone before V3-l4's 74 GB load
    torch.cuda.empty_cache()
    layers = bench_v3_layers(bw, args.v3_bs, args.ctx, args.routing[0]) if args.v3_bs else []
    _write(bw, rows, layers)
    print(f"V2-Lite decode and V3-l4 layers: {time.perf_counter() - start:.0f} s\n")
    print_table(rows, COLS)
    if layers:
        print_table(layers, LAYER_COLS)


if __name__ == "__main__":
    main()
