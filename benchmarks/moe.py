"""Mixture-of-experts decode and prefill against their floors, and against a PyTorch loop over experts.

Decode: for each model, batch size and routing (the random router's own choice, "skewed", or
``--moe-routing uniform``), one decode step replayed from its CUDA graph, every sequence attending
over ``ctx`` cached tokens. The floor is the bytes the step must read — attention and dense
weights, the router gates, the lm_head, the batch's embedding rows, the experts the router
actually chose in that step (counted from the layers' own per-expert counts after the replay) and
the KV in context (``ModelDescription.decode_read_bytes``) — over the best read bandwidth measured
in the same run (benchmarks/roofline.py; a step that reads faster raises it).

Loop: the same batch with every MoE layer run as transformers' eager loop over experts
(kernels/moe_reference.experts_loop_reference), eager, against the fused path eager and replayed.

Prefill: 8 sequences of 2048 tokens, FLOPs counted for what is computed — every dense matmul,
the k routed experts per token, causal attention, and the lm_head for the 8 sampled rows only —
over the bf16 matmul peak measured in the same run.

Run: python3 -m benchmarks.moe [--models dummy:qwen3-30b-a3b dummy:mixtral-8x7b] [--bs 1 8 32 64 128 256]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.decode import make_batch, step_cost
from benchmarks.decode_setup import captured_graphs, context_kv_caches
from benchmarks.roofline import matmul_tflops, measured_read_bw
from graphserve.config import EngineConfig
from graphserve.engine.graphs import GraphRunner
from graphserve.kernels.moe_reference import experts_loop_reference
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.layers.forward_batch import contiguous_batch
from graphserve.layers.moe import FusedMoE
from graphserve.models.loader import load_model

COLS = ["model", "bs", "ctx", "routing", "experts_touched", "step_ms", "floor_ms", "ratio", "ratio_datasheet"]


def moe_layers(model: torch.nn.Module) -> list[FusedMoE]:
    """The model's routed-expert layers ([] for a dense model): whose counts ``experts_touched`` reads."""
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def set_routing(model: torch.nn.Module, routing: str) -> list[FusedMoE]:
    """Every MoE layer on round-robin routing ("uniform") or its own router (anything else, "skewed" in the
    tables); the layers."""
    layers = moe_layers(model)
    for m in layers:
        m.routing_override = "uniform" if routing == "uniform" else None
    return layers


def experts_touched(layers: list[FusedMoE]) -> list[int] | None:
    """The experts the last step routed to in each MoE layer, from each layer's counts (``decode_read_bytes`` prices
    them per layer: a checkpoint's ignore list may keep some layers' experts in the model dtype); None for a dense
    model (no layers), which ``step_cost`` and ``decode_read_bytes`` take as "no routed experts to count"."""
    if not layers:
        return None
    return [int((m.expert_counts > 0).sum().item()) for m in layers]


def touched_total(touched: list[int] | None) -> int | None:
    """The (layer, expert) pairs of ``experts_touched``, summed over the layers: what a result row records."""
    return None if touched is None else sum(touched)


@contextlib.contextmanager
def loop_experts(layers: list[FusedMoE]):
    """Every MoE layer runs transformers' eager loop over experts instead of the fused kernels."""

    def loop_forward(self, hidden, router_logits, valid=None):
        weights, ids = self.route(router_logits)
        return experts_loop_reference(hidden, self.w13_weight, self.w2_weight, weights, ids)

    def loop_forward_gate(self, hidden, gate, valid=None):
        return self.forward(hidden, gate(hidden), valid)

    def loop_forward_add_norm_gate(self, x, residual, norm, gate, valid=None):
        hidden, residual = norm(x, residual)
        return self.forward(hidden, gate(hidden), valid), hidden, residual

    for m in layers:
        m.forward = loop_forward.__get__(m)
        m.forward_gate = loop_forward_gate.__get__(m)
        m.forward_add_norm_gate = loop_forward_add_norm_gate.__get__(m)
    try:
        yield
    finally:
        for m in layers:
            del m.forward, m.forward_gate, m.forward_add_norm_gate


def _replay(graphs: GraphRunner, batch):
    return lambda: graphs.replay(batch).argmax(-1)


def _eager(model: torch.nn.Module, batch, rows: torch.Tensor | None = None):
    def step():
        hidden = model(batch.input_ids, batch.positions, batch)
        return model.compute_logits(hidden if rows is None else hidden[rows]).argmax(-1)
    return step


def attention_flops(info, tokens: int, context: int) -> int:
    """QK^T and PV for ``tokens`` queries each over ``context`` keys (the caller sums causal prefixes)."""
    return 4 * tokens * context * info.num_layers * info.num_heads * info.head_dim


def bench_decode(name: str, sizes: list[int], ctx: int, routings: list[str], bw, loop_bs: list[int]) -> list[dict]:
    device = torch.device("cuda")
    cfg = EngineConfig(model=name, device="cuda", max_model_len=ctx + 64)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    kv_caches = context_kv_caches(info, max(sizes), ctx, cfg.block_size, device)
    backend = TritonAttentionBackend()
    rows = []
    with torch.inference_mode():
        for routing in routings:
            # the routing mode is part of what a graph captures (a capture before the switch replays
            # the model's own routing under the "uniform" label): one capture per mode
            layers = set_routing(model, routing)
            graphs = captured_graphs(model, backend, kv_caches, sizes, ctx, cfg, device)
            for bs in sizes:
                batch = make_batch(bs, ctx, kv_caches, backend, info.vocab_size)
                ms = cuda_time_ms(_replay(graphs, batch), warmup=3, iters=20)
                touched = experts_touched(layers)  # the counts of the last replay: this batch's routing
                nbytes = step_cost(info, bs, ctx, touched)[0]  # as every decode benchmark counts a step
                bw.observe(f"{name} decode bs={bs} {routing}", nbytes, ms)
                row = {"model": name, "bs": bs, "ctx": ctx, "routing": routing, "experts_touched": touched_total(touched),
                       "step_ms": ms, "bytes": nbytes}
                if bs in loop_bs:
                    eager = _eager(model, batch)
                    row["fused_eager_ms"] = cuda_time_ms(eager, warmup=2, iters=5)
                    with loop_experts(layers):
                        row["loop_eager_ms"] = cuda_time_ms(eager, warmup=1, iters=3)
                    row["speedup_vs_loop"] = row["loop_eager_ms"] / ms
                rows.append(row)
                print(f"{name} bs={bs} {routing}: {ms:.3f} ms, {touched_total(touched)} experts touched")
            del graphs  # its pool goes back before the next mode's capture
    return rows


def bench_prefill(name: str, seqs: int, seq_len: int, peak: float) -> dict:
    device = torch.device("cuda")
    cfg = EngineConfig(model=name, device="cuda", max_model_len=seq_len + 16)
    loaded = load_model(cfg, device)
    model, info, desc = loaded.model, loaded.info, loaded.info.description
    bsz = cfg.block_size
    kv_caches = info.kv.allocate(seqs * (-(-seq_len // bsz)) + 2, bsz, device)
    batch = contiguous_batch([seq_len] * seqs, [seq_len] * seqs, kv_caches, TritonAttentionBackend(),
                             vocab_size=info.vocab_size)
    with torch.inference_mode():
        ms = cuda_time_ms(_eager(model, batch, batch.logits_indices), warmup=2, iters=5)
    tokens = seqs * seq_len
    # dense_params holds norms and gates too: norms are a rounding error next to the matmuls
    matmul = 2 * tokens * (desc.dense_params + desc.num_moe_layers * desc.top_k * desc.expert_params)
    flops = matmul + seqs * attention_flops(info, 1, seq_len * (seq_len + 1) // 2) + 2 * seqs * (desc.lm_head_params or desc.embed_params)
    return {"model": name, "seqs": seqs, "seq_len": seq_len, "ms": ms, "tflops": flops / ms / 1e9,
            "peak_tflops": peak, "fraction_of_peak": flops / ms / 1e9 / peak}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dummy:qwen3-30b-a3b", "dummy:mixtral-8x7b"])
    p.add_argument("--bs", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--routing", nargs="+", default=["skewed", "uniform"])
    p.add_argument("--loop-bs", nargs="*", type=int, default=[64])
    p.add_argument("--prefill", nargs="*", default=["dummy:qwen3-30b-a3b"], help="models for the 8x2048 prefill row")
    args = p.parse_args()
    bw, peak = measured_read_bw(), matmul_tflops()
    print(bw.describe(), f"; bf16 matmul peak {peak:.0f} TFLOP/s")
    rows = []
    for m in args.models:
        rows += bench_decode(m, args.bs, args.ctx, args.routing, bw, args.loop_bs)
        torch.cuda.empty_cache()
    for r in rows:  # every row against the best rate of the whole run
        r.update(bw.ratios(r["step_ms"], r["bytes"]))
    prefill = []
    for m in args.prefill:
        prefill.append(bench_prefill(m, 8, 2048, peak))
        torch.cuda.empty_cache()
    print()
    print_table(rows, COLS)
    loops = [r for r in rows if "loop_eager_ms" in r]
    if loops:
        print_table(loops, ["model", "bs", "routing", "step_ms", "fused_eager_ms", "loop_eager_ms", "speedup_vs_loop"])
    if prefill:
        print_table(prefill, ["model", "seqs", "seq_len", "ms", "tflops", "peak_tflops", "fraction_of_peak"])
    write_result("moe_decode", {"ceilings": {"read": bw.summary(), "matmul_tflops": peak}, "rows": rows,
                                "prefill": prefill})


if __name__ == "__main__":
    main()
