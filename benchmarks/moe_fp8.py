"""FP8 routed experts: ``dummy:qwen3-30b-a3b --quantization fp8`` decode against its FP8 floor and
against the bf16 model of the same seed, and the grouped GEMM's W8A16 / W8A8 modes side by side.

Decode: one CUDA-graph step per batch size (1, 64) and routing (the random router's own choice,
"skewed", and round-robin "uniform"), every sequence over ``ctx`` cached tokens. The floor is the
bytes the step must read (ModelDescription.decode_read_bytes: FP8 attention projections and the
experts actually routed to in that step, each with its fp32 block scales, bf16 embedding rows,
lm_head and router gates, and the KV in context) over the best read bandwidth measured in this
run (benchmarks/roofline.py probes and the steps themselves). The bf16 model runs the same steps.

Kernels: the experts of one Qwen3-30B-A3B layer at T tokens (top-8 of 128, random routing), each timed as a
CUDA graph of back-to-back calls (benchmarks/kernels.graph_time_ms), bf16 weights vs fp8 weights in W8A16 and
in W8A8, and as the layer runs them (``layer_ms``: the W8A8 rule from ``W8A8_MIN_ROWS_PER_EXPERT`` pairs per
expert, or the tuned table's tiles quantizing inside the GEMM; ``picked`` names the mode of each step,
kernels/moe_fused.quantized_steps).

Rows go to benchmarks/results/fp8_decode.json as {"model","bs","ctx","step_ms","floor_ms","ratio",
"bf16_step_ms"} beside the rows already there (benchmarks/fp8.py writes the dense ones: run it
first), and everything this run measured to benchmarks/results/moe_fp8.json.

``--quant-out``: only the experts of one layer at 32, 64 and 128 tokens, W8A8, for a few gate_up tiles: down's
input quantized by gate_up's epilogue (128-wide tiles) or by a launch (benchmarks/results/moe_fp8_quant_out.json).

Run: python3 -m benchmarks.moe_fp8 [--quick]      (about 2 minutes on an H200; --quick: uniform only, no kernel table)
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time_ms, merge_rows, print_table, write_result
from benchmarks.decode import make_batch, step_cost
from benchmarks.decode_setup import captured_graphs, context_kv_caches, release_gpu_memory
from benchmarks.kernels import graph_time_ms
from benchmarks.moe import experts_touched, set_routing, touched_total
from benchmarks.moe_tune import _Bucket as TuneBucket
from benchmarks.moe_tune import _weights as tune_weights
from benchmarks.roofline import measured_read_bw
from graphserve.config import EngineConfig
from graphserve.kernels import moe_fused
from graphserve.kernels.argmax import greedy_argmax
from graphserve.kernels.moe_config import GemmTile, moe_tiles
from graphserve.kernels.moe_fused import fused_experts, quantized_steps
from graphserve.kernels.moe_routing import moe_softmax_topk
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.layers.quant.fp8_moe import quantize_stack
from graphserve.models.loader import load_model

MODEL = "dummy:qwen3-30b-a3b"
COLS = ["model", "bs", "ctx", "routing", "experts_touched", "step_ms", "floor_ms", "ratio", "bf16_step_ms", "vs_bf16"]


def decode_steps(quantization: str, sizes: list[int], ctx: int, routings: list[str], bw) -> dict:
    """{(bs, routing): (step ms, bytes to read, experts touched)} for one load of the model."""
    device = torch.device("cuda")
    cfg = EngineConfig(model=MODEL, device="cuda", quantization=quantization, max_model_len=ctx + 64)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    kv_caches = context_kv_caches(info, max(sizes), ctx, cfg.block_size, device)
    backend = TritonAttentionBackend()
    out = {}
    with torch.inference_mode():
        for routing in routings:
            # the routing mode is part of what a graph captures: one capture per mode
            layers = set_routing(model, routing)
            graphs = captured_graphs(model, backend, kv_caches, sizes, ctx, cfg, device)
            for bs in sizes:
                batch = make_batch(bs, ctx, kv_caches, backend, info.vocab_size)
                ms = cuda_time_ms(lambda g=graphs, b=batch: greedy_argmax(g.replay(b)), warmup=3, iters=20)
                per_layer = experts_touched(layers)  # the last replay's routing
                nbytes = step_cost(info, bs, ctx, per_layer)[0]  # as benchmarks.fp8 counts a step
                touched = touched_total(per_layer)
                bw.observe(f"{MODEL} {quantization} decode bs={bs} {routing}", nbytes, ms)
                out[bs, routing] = (ms, nbytes, touched)
                print(f"{MODEL} --quantization {quantization} bs={bs} {routing}: {ms:.3f} ms, {touched} experts, "
                      f"{nbytes / 1e9:.2f} GB to read")
            del graphs
    del model, loaded, kv_caches
    release_gpu_memory()
    return out


def kernel_rows(tokens: list[int], e: int = 128, h: int = 2048, i: int = 768, k: int = 8) -> list[dict]:
    """One layer's experts on the grouped GEMM path: bf16 weights, fp8 W8A16 and fp8 W8A8."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5).to(torch.bfloat16)
    qg, sg = quantize_stack(w13[:, :i], (128, 128))
    qu, su = quantize_stack(w13[:, i:], (128, 128))
    q2, s2 = quantize_stack(w2, (128, 128))
    q13, s13, s2 = torch.cat([qg, qu], 1), torch.cat([sg, su], 1).contiguous(), s2.contiguous()
    rows = []
    for t in tokens:
        x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
        w, ids = moe_softmax_topk(torch.randn(t, e, device="cuda", generator=gen), k, True)

        def fp8(w8a8: bool | None, x=x, w=w, ids=ids):
            return fused_experts(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, weight_block=(128, 128),
                                 path="gemm", w8a8=w8a8)  # fmt: skip

        # what the layer runs here: the W8A8 rule, or the tuned table's tiles quantizing inside the GEMM
        quantized = quantized_steps(t, k, q13, q2, s13, s2, (128, 128), path="gemm")
        picked = "+".join(("a8" if q else "w8a16") for q in quantized) if quantized[0] != quantized[1] else (
            "w8a8" if quantized[0] else "w8a16")
        # each a CUDA graph of back-to-back calls, as a decode step runs them: timed from the host, the small
        # batches' launches would be what is measured
        row = {"tokens": t, "pairs": t * k, "bf16_ms": graph_time_ms(lambda x=x, w=w, ids=ids: fused_experts(
            x, w13, w2, w, ids, path="gemm")), "w8a16_ms": graph_time_ms(lambda f=fp8: f(False)),
            "w8a8_ms": graph_time_ms(lambda f=fp8: f(True)), "layer_ms": graph_time_ms(lambda f=fp8: f(None)),
            "picked": picked}  # fmt: skip
        rows.append(row)
    return rows


QUANT_OUT_GATE_UP = [GemmTile(16, 32, 128, 1, 4, 4), GemmTile(16, 128, 128, 1, 4, 3), GemmTile(16, 128, 128, 1, 4, 4),
                     GemmTile(16, 128, 128, 1, 8, 3), GemmTile(16, 128, 128, 1, 8, 4)]  # fmt: skip


def quant_out_rows(tokens: list[int], e: int = 128, h: int = 2048, i: int = 768, k: int = 8) -> list[dict]:
    """One Qwen3-30B-A3B layer's W8A8 experts at T tokens for a few gate_up tiles beside the table's down tile:
    each 128-wide tile (one of down's activation groups) with gate_up's epilogue quantizing down's input
    (``QUANT_OUT``, kernels/moe_fused.quant_out_group) and with the quantization launch instead; the 32-wide one
    can only launch. Timed as benchmarks/moe_tune.py times its tiles (CUDA graphs, two weight copies)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [tune_weights(e, h, i, torch.bfloat16, True, gen) for _ in range(2)]
    table = moe_tiles(e, i, h, torch.float8_e4m3fn, torch.device("cuda"))
    rule = moe_fused.quant_out_group
    rows = []
    for t in tokens:
        bucket = TuneBucket(sets, t, e, h, k, torch.bfloat16, gen)
        down = table.gemm_tiles(t * k)[1]
        for gate_up in QUANT_OUT_GATE_UP:
            for epilogue in (True, False) if gate_up.block_n == 128 else (False,):
                moe_fused.quant_out_group = rule if epilogue else (lambda *a: False)
                try:
                    us = bucket.ms(path="gemm", w8a8=True, gemm_tiles=(gate_up, down)) * 1e3
                finally:
                    moe_fused.quant_out_group = rule
                row = {"tokens": t, "pairs": t * k, "gate_up": _tile(gate_up), "down": _tile(down),
                       "down_input": "gate_up epilogue" if epilogue else "quantization launch", "layer_us": us}
                print_table([row], list(row))
                rows.append(row)
    return rows


def _tile(t: GemmTile) -> str:
    return f"{t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}{' a8' if t.a8 else ''}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bs", nargs="+", type=int, default=[1, 64])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="uniform routing only, no kernel table")
    p.add_argument("--w8a8-rows-per-expert", type=int, default=None, metavar="N",
                   help="the FP8 steps again with the W8A8 rule at N pairs per expert (w8a8_step_ms beside step_ms)")
    p.add_argument("--quant-out", action="store_true", help="only the experts of one layer at 32, 64 and 128 tokens: "
                   "down's input quantized by gate_up's epilogue or by a launch (writes moe_fp8_quant_out.json)")
    args = p.parse_args()
    if args.quant_out:
        write_result("moe_fp8_quant_out", {"rows": quant_out_rows([32, 64, 128])})
        return
    if args.w8a8_rows_per_expert is not None and args.w8a8_rows_per_expert < 0:
        p.error(f"--w8a8-rows-per-expert {args.w8a8_rows_per_expert}: a pair count per expert, 0 or more")
    routings = ["uniform"] if args.quick else ["skewed", "uniform"]
    bw = measured_read_bw()
    print(f"probes: {bw.describe()}")
    kernels = [] if args.quick else kernel_rows([8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192])
    bf16 = decode_steps("none", args.bs, args.ctx, routings, bw)
    fp8 = decode_steps("fp8", args.bs, args.ctx, routings, bw)
    other = {}
    if args.w8a8_rows_per_expert is not None:
        rule, moe_fused.W8A8_MIN_ROWS_PER_EXPERT = moe_fused.W8A8_MIN_ROWS_PER_EXPERT, args.w8a8_rows_per_expert
        try:
            other = decode_steps("fp8", args.bs, args.ctx, routings, bw)
        finally:
            moe_fused.W8A8_MIN_ROWS_PER_EXPERT = rule
    rows = []
    for (bs, routing), (ms, nbytes, touched) in fp8.items():
        row = {"model": f"{MODEL} --quantization fp8 ({routing} routing)", "bs": bs, "ctx": args.ctx,
               "routing": routing, "experts_touched": touched, "step_ms": ms, "read_bytes": nbytes,
               "bf16_step_ms": bf16[bs, routing][0], "bf16_read_bytes": bf16[bs, routing][1]}
        if other:
            row["w8a8_step_ms"] = other[bs, routing][0]
        rows.append(row)
    bw.probe_again()  # the probes again, after the work: each method's best of both rounds
    for r in rows:  # floors last: the best read rate of the whole run is the denominator
        r.update({key: v for key, v in bw.ratios(r["step_ms"], r["read_bytes"]).items() if key in ("floor_ms", "ratio")})
        r.update(vs_bf16=r["step_ms"] / r["bf16_step_ms"], floor_gbs=bw.best_gbs, floor_method=bw.best_method)
    print(f"\nfloor: {bw.describe()}")
    print_table(rows, COLS + (["w8a8_step_ms"] if other else []))
    if kernels:
        print_table(kernels, ["tokens", "pairs", "bf16_ms", "w8a16_ms", "w8a8_ms", "layer_ms", "picked"])
    merge_rows("fp8_decode", [{key: r[key] for key in ("model", "bs", "ctx", "step_ms", "floor_ms", "ratio",
                                               "bf16_step_ms", "floor_gbs", "floor_method")} for r in rows],
               ceilings={"read": bw.summary()})  # fmt: skip
    write_result("moe_fp8", {"ceilings": {"read": bw.summary()}, "rows": rows, "kernels": kernels})


if __name__ == "__main__":
    main()
