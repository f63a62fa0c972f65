"""What folding a launch into its neighbour saves at decode sizes, timed as the engine runs: CUDA graphs.

Two fusions, each against the two launches it replaces, per call (one model layer's worth):
- decode attention with the split partials merged inside the split kernel, against the split kernel
  followed by the merge kernel (Qwen3-30B-A3B's 32/4 heads and Llama-3-8B's 32/8, head_dim 128,
  context 1024 in a block table sized for 1088 tokens as benchmarks.step_breakdown sizes it, and
  for 8192);
- the MoE layer's post-attention residual add + RMSNorm inside the router gate + top-k launch,
  against kernels/norm's fused add + RMSNorm followed by the gate launch (the four MoE presets'
  router shapes, 1 to 8 rows).
A graph holds ``LAYERS`` back-to-back calls on distinct buffers (48 layers of gate weights stay in
L2 here, as they would not in a real step among the experts' weights; both sides see the same).
``saved_us`` is the time per layer that the fusion removes (negative: the fusion is slower there).

Run on a GPU: python3 -m benchmarks.launches [--quick]   (writes benchmarks/results/launches.json)
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from graphserve.kernels.common import sm_count
from graphserve.kernels.decode_attention import choose_num_splits, counters_numel, decode_attention, workspace_numel
from graphserve.kernels.moe_gate import moe_add_norm_gate_softmax_topk, moe_gate_softmax_topk
from graphserve.kernels.norm import fused_add_rms_norm

DT = torch.bfloat16
LAYERS = 48
PAGE = 16
ATTENTION = {"qwen3-30b-a3b": (32, 4, 128), "llama3-8b": (32, 8, 128)}  # query heads, kv heads, head_dim
# router shapes: experts, hidden, top_k, renormalise
ROUTERS = {"qwen3-30b-a3b": (128, 2048, 8, True), "mixtral-8x7b": (8, 4096, 2, True),
           "olmoe-1b-7b": (64, 2048, 8, False), "qwen1.5-moe-a2.7b": (60, 2048, 4, False)}
COLS = ["fusion", "model", "shape", "separate_us", "fused_us", "saved_us"]


def per_call_us(calls) -> float:
    """GPU time per call of a CUDA graph that runs ``calls`` (one closure per layer) back to back."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # compile and settle allocations outside the capture
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for fn in calls:
            fn()
    return 1e3 * cuda_time_ms(graph.replay, warmup=3, iters=20) / len(calls)


def bench_attention(model: str, batch: int, ctx: int, capacity: int) -> dict:
    hq, hkv, d = ATTENTION[model]
    blocks = -(-ctx // PAGE)
    width = -(-capacity // PAGE) + 1
    cache = torch.randn(2, batch * blocks + 1, PAGE, hkv, d, device="cuda", dtype=DT)
    tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    tables[:, :blocks] = (torch.randperm(batch * blocks, device="cuda").int() + 1).view(batch, blocks)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    sms = sm_count(cache.device)
    ws = torch.empty(workspace_numel(hq, hkv, d, sms), device="cuda")
    counters = torch.zeros(max(1, counters_numel(hkv, sms)), dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, hq, d, device="cuda", dtype=DT) for _ in range(LAYERS)]
    outs = [torch.empty_like(q) for q in qs]

    def calls(fused: bool):
        return [lambda q=q, o=o: decode_attention(q, cache, tables, lens, d**-0.5, out=o, workspace=ws,
                                                  counters=counters, fused_merge=fused)
                for q, o in zip(qs, outs)]  # fmt: skip

    splits = choose_num_splits(batch, hkv, width * PAGE, sms)
    return _row("attention merge", model, f"bs{batch} ctx{ctx} cap{capacity} splits{splits}",
                per_call_us(calls(False)), per_call_us(calls(True)))  # fmt: skip


def bench_router(model: str, t: int) -> dict:
    e, h, k, renorm = ROUTERS[model]
    xs = [torch.randn(t, h, device="cuda", dtype=DT) for _ in range(LAYERS)]
    residuals = [torch.randn(t, h, device="cuda", dtype=DT) for _ in range(LAYERS)]
    norm_ws = [(1 + 0.1 * torch.randn(h, device="cuda")).to(DT) for _ in range(LAYERS)]
    gates = [(torch.randn(e, h, device="cuda") * h**-0.5).to(DT) for _ in range(LAYERS)]
    counters = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(LAYERS)]
    layers = list(zip(xs, residuals, norm_ws, gates, counters))

    def separate(x, r, nw, g, c):
        normed, _ = fused_add_rms_norm(x, r, nw, 1e-6)
        return moe_gate_softmax_topk(normed, g, k, renorm, c)

    def fused(x, r, nw, g, c):
        return moe_add_norm_gate_softmax_topk(x, r, nw, 1e-6, g, k, renorm, c)

    return _row("add+norm into gate", model, f"T{t} E{e} H{h}",
                per_call_us([lambda a=a: separate(*a) for a in layers]),
                per_call_us([lambda a=a: fused(*a) for a in layers]))  # fmt: skip


def _row(fusion: str, model: str, shape: str, separate_us: float, fused_us: float) -> dict:
    row = {"fusion": fusion, "model": model, "shape": shape, "separate_us": separate_us, "fused_us": fused_us,
           "saved_us": separate_us - fused_us}  # fmt: skip
    print_table([row], COLS)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="batch 1 and 4 attention, 1 and 8 router rows")
    args = p.parse_args()
    batches, rows_t = ([1, 4], [1, 8]) if args.quick else ([1, 4, 16, 32], [1, 2, 4, 8])
    rows = []
    with torch.inference_mode():
        for model in ATTENTION:
            for batch in batches:
                rows.append(bench_attention(model, batch, 1024, 1088))
            rows.append(bench_attention(model, 1, 1024, 8192))
        for model in ROUTERS:
            for t in rows_t:
                rows.append(bench_router(model, t))
    print()
    print_table(rows, COLS)
    write_result("launches", {"layers": LAYERS, "rows": rows})


if __name__ == "__main__":
    main()
