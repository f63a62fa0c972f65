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

Offline (``--offline N``, a run of its own): the first N requests of the offline workload (input and
output lengths uniform in 100-1024, benchmarks/offline.py) on dummy:deepseek-v2-lite through
``LLM.generate`` against transformers' ``generate`` in bf16 on the same GPU, each side credited with
the tokens it returned (benchmarks/results/deepseek_offline.json).

Run: python3 -m benchmarks.deepseek [--quick]   (writes benchmarks/results/deepseek_decode.json)
     python3 -m benchmarks.deepseek --offline 64 [--hf-batch 64]
"""

from __future__ import annotations

import argparse
import gc

import torch

from benchmarks.common import print_table, write_result
from benchmarks.kernels import graph_time_ms
from benchmarks.moe import bench_decode, set_routing
from benchmarks.roofline import measured_read_bw
from graphserve.config import EngineConfig
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.layers.forward_batch import contiguous_batch
from graphserve.layers.moe import FusedMoE
from graphserve.models.loader import load_model

COLS = ["model", "bs", "ctx", "routing", "experts_touched", "step_ms", "floor_ms", "ratio", "ratio_datasheet"]
LAYER_COLS = ["model", "layer", "kind", "bs", "ctx", "routing", "layer_ms", "floor_ms", "ratio"]


def bench_v2_lite(bw, sizes: list[int], ctx: int, routings: list[str]) -> list[dict]:
    """Whole V2-Lite decode steps, measured as every MoE model is (benchmarks/moe.py)."""
    return bench_decode("dummy:deepseek-v2-lite", sizes, ctx, routings, bw, loop_bs=[])


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
    bsz = cfg.block_size
    kv_caches = info.kv.allocate(max(sizes) * (-(-(ctx + 1) // bsz)) + 2, bsz, device, fill="random")
    backend = TritonAttentionBackend()
    rows = []
    with torch.inference_mode():
        for bs in sizes:
            batch = contiguous_batch([1] * bs, [ctx + 1] * bs, kv_caches, backend, vocab_size=info.vocab_size)
            hidden0 = torch.randn(bs, info.hidden_size, device=device, dtype=info.dtype)
            residual0 = torch.randn_like(hidden0)
            for idx in (0, 1):  # the dense layer, then the first MoE layer
                layer = model.model.layers[idx]
                hidden, residual = hidden0.clone(), residual0.clone()

                def step(layer=layer, hidden=hidden, residual=residual, residual0=residual0, batch=batch):
                    residual.copy_(residual0)  # the layer adds into its residual in place
                    layer(batch.positions, hidden, residual, batch)

                ms = graph_time_ms(step)
                nbytes = _layer_bytes(layer, bs * (ctx + 1) * info.kv.bytes_per_token_per_layer)
                rows.append({"model": name, "layer": idx, "kind": "moe" if layer.is_moe else "dense", "bs": bs,
                             "ctx": ctx, "routing": routing, "layer_ms": ms, "bytes": nbytes})
                print(f"{name} layer {idx} bs={bs}: {ms:.3f} ms")
    del model, loaded, kv_caches
    return rows


def bench_offline(num_requests: int, hf_batch: int) -> dict:
    from benchmarks.offline import run_graphserve, run_hf, workload

    name = "dummy:deepseek-v2-lite"
    reqs = workload(256, 0, 32000)[:num_requests]
    dt, toks, llm = run_graphserve(name, reqs, max_model_len=2048)
    hf_config = llm.engine.core.hf_config
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    hf_dt, credited, computed = run_hf(hf_config, reqs, hf_batch, torch.device("cuda"))
    ours, theirs = toks / dt, sum(credited) / hf_dt
    return {"model": name, "requests": len(reqs), "out_tokens": toks, "seconds": dt, "tok_s": ours,
            "hf_batch": hf_batch, "hf_out_tokens": sum(credited), "hf_computed_tokens": sum(computed),
            "hf_seconds": hf_dt, "hf_tok_s": theirs, "ratio_vs_hf": ours / theirs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="V2-Lite at batch 1 and 64 only, no V3 layers")
    p.add_argument("--bs", nargs="+", type=int, default=[1, 64, 256])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--routing", nargs="+", default=["uniform"], choices=["uniform", "router"])
    p.add_argument("--v3-bs", nargs="*", type=int, default=[1, 64])
    p.add_argument("--offline", type=int, default=0, help="run only the offline comparison on N requests")
    p.add_argument("--hf-batch", type=int, default=64)
    args = p.parse_args()
    if args.offline:
        row = bench_offline(args.offline, args.hf_batch)
        print_table([row], list(row))
        write_result("deepseek_offline", {"rows": [row]})
        return
    if args.quick:
        args.bs, args.v3_bs = [1, 64], []
    bw = measured_read_bw()
    print(bw.describe())
    rows = bench_v2_lite(bw, args.bs, args.ctx, args.routing)
    gc.collect()  # V2-Lite's 31 GB must be gone before V3-l4's 74 GB load
    torch.cuda.empty_cache()
    layers = bench_v3_layers(bw, args.v3_bs, args.ctx, args.routing[0]) if args.v3_bs else []
    for r in rows:  # every row against the best rate of the whole run
        r.update(bw.ratios(r["step_ms"], r["bytes"]))
    for r in layers:
        r.update(bw.ratios(r["layer_ms"], r["bytes"]))
    print()
    print_table(rows, COLS)
    if layers:
        print_table(layers, LAYER_COLS)
    write_result("deepseek_decode", {"read_bandwidth": bw.summary(), "rows": rows, "v3_layers": layers})


if __name__ == "__main__":
    main()
