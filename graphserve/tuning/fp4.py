"""FP4 kernels on this GPU: the streaming matmul and the GEMM variants at their default tiles (dequant and dequant_fp8
from 128 rows)
per projection shape and rows, against a same-run read-bandwidth probe, bf16 cuBLAS and the FP8 kernels on the same
shape; a prefill of 8 x 2048 tokens through Llama-3-8B's projections (tok/s, FP4 vs FP8 vs bf16); the routed
experts' two paths at gpt-oss-120b's and Qwen3-30B-A3B's shapes.

Every time is a CUDA graph's replay over several copies of the weight (together past three times L2), divided
by the copies: a small projection's weight would otherwise be read from L2. Bytes are the kernel's fewest:
packed weight, scales, x and the output once. ``ratio`` is time over bytes at the run's best read rate
(benchmarks/roofline.py, probed before and after). With ``--write-rule`` the measured crossovers become
graphserve/kernels/fp4_rule.json (streaming rows, the fp8 variant's first rows, per format and shape).

The streaming kernels' widenings side by side: ``python3 -m benchmarks.fp4_variants`` (results/fp4_variants.json).

Run: python3 -m benchmarks.fp4 [--write-rule] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial

import torch

from graphserve.kernels import tables
from graphserve.kernels.fp4_dequant_fp8 import fp8_row_scales
from graphserve.kernels.fp4_gemm import RULE_PATH, fp4_gemm
from graphserve.kernels.fp4_gemv import fp4_gemv
from graphserve.kernels.fp4_layout import GROUP
from graphserve.kernels.fp4_moe import fp4_fused_experts
from graphserve.kernels.fp8_gemm import scaled_mm_rowwise
from graphserve.kernels.fp8_gemv import fp8_gemv
from graphserve.kernels.fp8_quant import per_token_group_quant, quantize_weight_blocks, quantize_weight_channels
from graphserve.tuning.roofline import measured_read_bw
from graphserve.tuning.timing import cuda_times_ms, print_table

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
STREAM_ROWS = (1, 8, 32, 64)
GEMM_ROWS = (8, 32, 64, 128, 1024)
PREFILL_ROWS = 8 * 2048
MOE = {"gpt-oss-120b": (128, 2880, 2880, 4, "mxfp4", "swiglu_oai"), "qwen3-30b-a3b": (128, 2048, 768, 8, "nvfp4", "silu")}
MOE_TOKENS = (1, 4, 8, 16, 64, 256)
DT = torch.bfloat16


ERRORS: list[str] = []  # kernels that failed to build or run: their rows time inf, and the JSON says why



def graph_ms(calls: list) -> float:
    """Median ms of one call: a graph runs every call (one per weight copy) once, replayed 20 times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for c in calls:
                c()
        torch.cuda.synchronize()
    except Exception as e:  # a kernel that does not compile here costs its rows, not the run
        ERRORS.append(f"{calls[0]}: {type(e).__name__}: {str(e)[:300]}")
        print(ERRORS[-1], flush=True)
        return float("inf")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for c in calls:
            c()
    return statistics.median(cuda_times_ms(graph.replay, warmup=3, iters=20)) / len(calls)


def copies_for(nbytes: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(16, -(-3 * l2 // max(nbytes, 1))))


def fp4_weights(n: int, k: int, fmt: str, copies: int):
    out = []
    for _ in range(copies):
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        if fmt == "nvfp4":
            scale = (torch.rand(n, k // 16, device="cuda") * 40 + 8).to(torch.float8_e4m3fn)
            out.append((packed, scale, torch.tensor(1e-3, device="cuda")))
        else:
            out.append((packed, torch.randint(119, 123, (n, k // 32), dtype=torch.uint8, device="cuda"), None))
    return out


def fp4_expert_weights(e: int, h: int, inter: int, fmt: str):
    """``e`` random experts on the GPU as the FP4 MoE kernels take them: (w13 codes, w13 scales, w13 globals,
    w2 codes, w2 scales, w2 globals), the globals None under MXFP4."""
    w13 = fp4_weights(2 * inter * e, h, fmt, 1)[0]
    w2 = fp4_weights(h * e, inter, fmt, 1)[0]
    w13p, w13s = w13[0].view(e, 2 * inter, h // 2), w13[1].view(e, 2 * inter, -1)
    w2p, w2s = w2[0].view(e, h, inter // 2), w2[1].view(e, h, -1)
    g13 = torch.full((e, 2), 1e-3, device="cuda") if fmt == "nvfp4" else None
    g2 = torch.full((e, 1), 1e-3, device="cuda") if fmt == "nvfp4" else None
    return w13p, w13s, g13, w2p, w2s, g2


def fp4_bytes(n: int, k: int, fmt: str) -> int:
    return n * k // 2 + n * k // GROUP[fmt] + (4 if fmt == "nvfp4" else 0)


def _row(shape: dict, kernel: str, fmt: str, ms: float, wbytes: int) -> dict:
    n, k, m = shape["n"], shape["k"], shape["m"]
    nbytes = wbytes + m * k * 2 + m * n * 2
    return {**shape, "fmt": fmt, "kernel": kernel, "ms": ms, "bytes": nbytes, "gbs": nbytes / ms / 1e6,
            "tflops": 2 * m * n * k / ms / 1e9}


def _fp8_rowwise(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The FP8 prefill path of a per-channel checkpoint: x quantized per token, then cuBLASLt's rowwise GEMM."""
    a, a_s = per_token_group_quant(x, x.shape[1])
    return scaled_mm_rowwise(a, a_s, w, s, DT)


def projection_rows(card: str, quick: bool, projections: list[str] | None = None,
                    checkpoint: bool = True) -> tuple[list[dict], dict]:  # fmt: skip
    """Every kernel at every row count of Llama-3-8B's ``projections`` (default: all); ``checkpoint``: write the rows
    so far to benchmarks/results/fp4_kernels.json after each projection (graphserve tune writes only its tables)."""
    rows, prefill = [], {}
    for proj, (n, k) in LLAMA3_8B.items():
        if projections is not None and proj not in projections:
            continue
        wb = torch.randn(n, k, device="cuda", dtype=DT) * 0.02
        bf16_w = [wb.clone() for _ in range(copies_for(n * k * 2))]
        q8, s8 = quantize_weight_blocks(wb, 128, 128)
        fp8_block = [(q8.clone(), s8.clone()) for _ in range(copies_for(n * k))]
        qc, sc = quantize_weight_channels(wb)
        fp8_chan = (qc, sc.view(n, 1).contiguous())
        del wb
        fp4 = {fmt: fp4_weights(n, k, fmt, copies_for(fp4_bytes(n, k, fmt))) for fmt in ("nvfp4", "mxfp4")}
        for m in sorted({*STREAM_ROWS, *GEMM_ROWS, PREFILL_ROWS}):
            if quick and m not in (1, 32, 1024, PREFILL_ROWS):
                continue
            x = torch.randn(m, k, device="cuda", dtype=DT)
            shape = {"card": card, "proj": proj, "n": n, "k": k, "m": m}
            rows.append(_row(shape, "bf16 cublas", "bf16", graph_ms([partial(torch.matmul, x, w.T) for w in bf16_w]),
                             n * k * 2))  # fmt: skip
            if m <= 64:
                ms = graph_ms([partial(fp8_gemv, x, w, s, 128, 128) for w, s in fp8_block])
                rows.append(_row(shape, "fp8 stream", "fp8", ms, n * k + s8.numel() * 4))
            else:
                ms = graph_ms([partial(_fp8_rowwise, x, *fp8_chan)])
                rows.append(_row(shape, "fp8 rowwise cublaslt", "fp8", ms, n * k + n * 4))
            for fmt, ws in fp4.items():
                if m <= 64:
                    ms = graph_ms([partial(fp4_gemv, x, p, s, g, fmt) for p, s, g in ws])
                    rows.append(_row(shape, "fp4 stream", fmt, ms, fp4_bytes(n, k, fmt)))
                if m >= 8:
                    for variant in ("bf16", "fp8", "dequant", "dequant_fp8") if m >= 128 else ("bf16", "fp8"):
                        # dequant_fp8 reads the row scales a layer makes once at load (fp8_row_scales)
                        calls = [partial(fp4_gemm, x, p, s, g, fmt, variant=variant,
                                         **({"fp8_row_scale": fp8_row_scales(p, s, fmt)} if variant == "dequant_fp8"
                                            else {}))
                                 for p, s, g in ws[: 2 if m >= 1024 else len(ws)]]  # fmt: skip
                        rows.append(_row(shape, f"fp4 gemm {variant}", fmt, graph_ms(calls), fp4_bytes(n, k, fmt)))
            print(f"{proj} m={m} done", flush=True)
        if checkpoint:
            write_result("fp4_kernels", {"partial": f"projections up to {proj}", "rows": rows, "errors": ERRORS})
        del bf16_w, fp8_block, fp4
        torch.cuda.empty_cache()
    for r in rows:
        if r["m"] == PREFILL_ROWS:
            key = f"{r['kernel']} ({r['fmt']})"
            prefill[key] = prefill.get(key, 0.0) + r["ms"]
    return rows, {k: {"ms": ms, "tok_s": PREFILL_ROWS / ms * 1e3} for k, ms in prefill.items()}


def moe_rows(card: str) -> list[dict]:
    rows = []
    for name, (e, h, inter, topk, fmt, act) in MOE.items():
        w13p, w13s, g13, w2p, w2s, g2 = fp4_expert_weights(e, h, inter, fmt)
        for t in MOE_TOKENS:
            x = torch.randn(t, h, device="cuda", dtype=DT)
            wts, ids = torch.softmax(torch.randn(t, e, device="cuda"), -1).topk(topk, dim=-1)
            ids = ids.int()
            experts = ids.unique().numel()
            wbytes = experts * (fp4_bytes(2 * inter, h, fmt) + fp4_bytes(h, inter, fmt))
            for path in ("stream", "gemm"):
                if path == "stream" and t * topk > 256:
                    continue
                ms = graph_ms([partial(fp4_fused_experts, x, w13p, w13s, g13, w2p, w2s, g2, fmt, wts, ids,
                                       activation=act, path=path)])  # fmt: skip
                rows.append({"card": card, "model": name, "fmt": fmt, "tokens": t, "pairs": t * topk,
                             "experts_read": experts, "path": path, "ms": ms, "bytes": wbytes,
                             "gbs": wbytes / ms / 1e6})
            print(f"{name} t={t} done", flush=True)
    return rows


def derive_rule(rows: list[dict], card: str) -> dict:
    """Per (fmt, N, K) of ``rows``: the streaming kernel's rows (the largest measured count up to which it beat both
    GEMM variants at every measured count) and the fp8 variant's first rows (from which it beat bf16 at every
    larger measured count; 0 if it lost at the largest)."""
    shapes = []
    for fmt in ("nvfp4", "mxfp4"):
        for n, k in dict.fromkeys((r["n"], r["k"]) for r in rows if r["fmt"] == fmt):
            ms = {(r["kernel"], r["m"]): r["ms"] for r in rows if (r["fmt"], r["n"], r["k"]) == (fmt, n, k)}
            stream_max = 0
            for m in sorted({m for kern, m in ms if kern == "fp4 stream"}):
                gemm = min((ms[(f"fp4 gemm {v}", m)] for v in ("bf16", "fp8") if (f"fp4 gemm {v}", m) in ms),
                           default=float("inf"))
                if ms[("fp4 stream", m)] > gemm:
                    break
                stream_max = m
            gemm_ms = sorted({m for kern, m in ms if kern == "fp4 gemm fp8"})
            fp8_from = 0
            for m in reversed(gemm_ms):
                if ms[("fp4 gemm fp8", m)] >= ms.get(("fp4 gemm bf16", m), float("inf")):
                    break
                fp8_from = m
            shapes.append({"fmt": fmt, "n": n, "k": k, "stream_max_rows": stream_max, "fp8_min_rows": fp8_from})
    return {"device": card, "source": "benchmarks/fp4.py", "shapes": shapes}


def moe_stream_pairs(moe: list[dict]) -> dict[str, int]:
    """Per model: the most (token, slot) pairs up to which the streaming path beat the grouped GEMM at every
    measured count (fp4_moe.STREAM_MAX_PAIRS, the default where the FP4 expert tiles table lists no shape, is set from
    these; graphserve/tuning/fp4_moe.py measures the crossover per shape for that table)."""
    out = {}
    for name in {r["model"] for r in moe}:
        ms = {(r["path"], r["pairs"]): r["ms"] for r in moe if r["model"] == name}
        best = 0
        for pairs in sorted({p for path, p in ms if path == "stream"}):
            if ms[("stream", pairs)] > ms.get(("gemm", pairs), float("inf")):
                break
            best = pairs
        out[name] = best
    return out


def write_result(name: str, payload: dict):
    """benchmarks/common.write_result: a source checkout's results folder (the benchmark's own entry point only;
    `graphserve tune` writes tables, not results)."""
    from benchmarks.common import write_result as write

    return write(name, payload)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write-rule", action="store_true", help="write graphserve/kernels/fp4_rule.json")
    ap.add_argument("--quick", action="store_true", help="rows 1, 32, 1024 and the prefill only")
    ap.add_argument("--skip-moe", action="store_true")
    args = ap.parse_args()
    card = torch.cuda.get_device_name(0)
    bw = measured_read_bw()
    moe = [] if args.skip_moe else moe_rows(card)
    write_result("fp4_kernels", {"partial": "experts only", "moe": moe, "errors": ERRORS})
    rows, prefill = projection_rows(card, args.quick)
    bw.probe_again()
    for r in rows + moe:
        r["ratio"] = r["ms"] / bw.floor_ms(r["bytes"])
    rule = derive_rule(rows, card)
    payload = {"read_bw": bw.summary(), "rows": rows, "prefill_8x2048": prefill, "moe": moe, "rule": rule, "card": card,
               "moe_stream_max_pairs": moe_stream_pairs(moe),
               "errors": ERRORS}
    write_result("fp4_kernels", payload)
    if args.write_rule:
        rule_path = tables.shipped_path(RULE_PATH.name, card)  # this card's, never another's
        rule_path.parent.mkdir(parents=True, exist_ok=True)
        rule_path.write_text(json.dumps(rule, indent=1) + "\n")
    print_table([r for r in rows if r["m"] <= 64], ["proj", "m", "fmt", "kernel", "ms", "gbs", "ratio"])
    print_table([r for r in rows if r["m"] > 64], ["proj", "m", "fmt", "kernel", "ms", "tflops"])
    print_table(moe, ["model", "tokens", "path", "ms", "gbs", "ratio"])
    print(f"read bw {bw.best_gbs:.0f} GB/s ({bw.best_method}); prefill 8x2048 through llama3-8b's projections:")
    for key, v in sorted(prefill.items(), key=lambda kv: kv[1]["ms"]):
        print(f"  {key}: {v['ms']:.2f} ms, {v['tok_s']:.0f} tok/s")
    print(json.dumps(rule))
    print("experts: streaming path up to pairs", moe_stream_pairs(moe))


if __name__ == "__main__":
    main()
