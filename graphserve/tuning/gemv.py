"""Decode-sized matmuls: the gemv kernels against cuBLAS (F.linear) at real projection shapes, and
the routing rule layers/linear.py follows, written from what was measured.

Each time is one call's share of a CUDA graph holding back-to-back calls, as decode runs them.
The calls cycle through enough copies of the weight (>= 256 MB in all) that every call reads
its weight from device memory, not from L2, as in a real step where the layers' weights
together dwarf the cache. Floor: bytes moved / the best read bandwidth of benchmarks.roofline.

Three kinds of call, as the layers make them: a plain projection (gemv vs F.linear); the down
projection with its SiLU·mul fused into the loads (silu_mul_gemv vs silu_and_mul + the faster of
F.linear and gemv); the qkv and gate_up projections with the RMSNorm before them fused
(norm_gemv vs fused_add_rms_norm + the faster of F.linear and gemv). Per shape and kind, the
largest row count up to which the gemv path won at every measured count goes into
graphserve/kernels/gemv_rule.json with the card's name: the table layers/linear.py routes by.

Run on a GPU: python3 -m benchmarks.gemv [--sweep]   (writes benchmarks/results/gemv.json and the rule)
One model's projections: python3 -m benchmarks.gemv --models dummy:qwen3-30b-a3b dummy:mixtral-8x7b
(the rows of shapes not measured in this run are carried over from the results file, each row
keeping the date and commit it was measured at, and the rule is derived from the merged file)
Rewrite the rule from a results file, no GPU needed: python3 -m benchmarks.gemv --rule-from FILE
``--sweep`` also times a grid of tile configurations per shape and batch and prints the best one
next to ``choose_config``'s pick, the data for retuning that function.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from graphserve.kernels import tables
from graphserve.kernels.activation import silu_and_mul
from graphserve.kernels.common import sm_count
from graphserve.kernels.gemv import gemv, norm_gemv, silu_mul_gemv
from graphserve.kernels.gemv_config import RULE_PATH, GemvConfig, choose_config
from graphserve.kernels.norm import fused_add_rms_norm
from graphserve.tuning.roofline import ReadBandwidth, measured_read_bw
from graphserve.tuning.timing import graph_time_ms, print_table

DT = torch.bfloat16
BATCHES = [1, 2, 4, 8, 16]
COLD_BYTES = 256 << 20  # several times any GPU's L2
# name: (N, K); qkv and gate_up are the fused projections the models run
SHAPES = {
    "qwen3-0.6b qkv": (4096, 1024),
    "qwen3-0.6b o_proj": (1024, 2048),
    "qwen3-0.6b gate_up": (6144, 1024),
    "qwen3-0.6b down": (1024, 3072),
    "qwen3-0.6b lm_head": (151936, 1024),
    "llama3-8b qkv": (6144, 4096),
    "llama3-8b o_proj": (4096, 4096),
    "llama3-8b gate_up": (28672, 4096),
    "llama3-8b down": (4096, 14336),
    # the MoE presets' dense projections (their experts run through kernels/moe_*); the router gate
    # goes through this rule only beyond the fused gate kernels' rows (kernels/moe_gate.MAX_ROWS, and
    # kernels/moe_gate_dot.DOT_MAX_ROWS for 16-bit activations)
    # or under --moe-routing uniform
    "qwen3-30b-a3b qkv": (5120, 2048),
    "qwen3-30b-a3b o_proj": (2048, 4096),
    "qwen3-30b-a3b router": (128, 2048),
    "mixtral-8x7b router": (8, 4096),
    # DeepSeek-V2-Lite: MLA's fused q/kv-a projection (q_proj without q LoRA, and kv_a_proj_with_mqa), its
    # o_proj, the two shared experts as one MLP (gate_up plain: the norm rides in the fused router gate),
    # the first layer's dense MLP, the lm_head
    "deepseek-v2-lite qkv": (16 * 192 + 512 + 64, 2048),
    "deepseek-v2-lite o_proj": (2048, 16 * 128),
    "deepseek-v2-lite shared gate_up": (2 * 2 * 1408, 2048),
    "deepseek-v2-lite shared down": (2048, 2 * 1408),
    "deepseek-v2-lite dense gate_up": (2 * 10944, 2048),
    "deepseek-v2-lite dense down": (2048, 10944),
    "deepseek-v2-lite lm_head": (102400, 2048),
    # gpt-oss-20b and -120b (one attention shape; bf16 and biased, their experts MXFP4 through kernels/fp4_moe):
    # q/k/v of 64 + 2 x 8 heads of 64, o_proj, the routers of 32 and 128 experts, the 201,088-row head
    "gpt-oss qkv": (64 * 64 + 2 * 8 * 64, 2880),
    "gpt-oss o_proj": (2880, 64 * 64),
    "gpt-oss-20b router": (32, 2880),
    "gpt-oss-120b router": (128, 2880),
    "gpt-oss lm_head": (201088, 2880),
}
# gate_up projections the models call without the RMSNorm prologue (DeepSeek's shared experts: their norm
# rides in the router's fused gate), so only their plain gemv is measured
PLAIN_GATE_UP = frozenset({"deepseek-v2-lite shared gate_up"})
# measured when neither --shapes nor --models is given (the dense presets)
DEFAULT_SHAPES = [name for name in SHAPES if name.startswith(("qwen3-0.6b", "llama3-8b"))]
# the projections each preset runs, by shape name (mixtral-8x7b's attention has llama3-8b's shapes)
MODEL_SHAPES = {
    "dummy:qwen3-0.6b": [name for name in SHAPES if name.startswith("qwen3-0.6b")],
    "dummy:llama3-8b": [name for name in SHAPES if name.startswith("llama3-8b")],
    "dummy:qwen3-30b-a3b": ["qwen3-30b-a3b qkv", "qwen3-30b-a3b o_proj", "qwen3-30b-a3b router"],
    "dummy:mixtral-8x7b": ["llama3-8b qkv", "llama3-8b o_proj", "mixtral-8x7b router"],
    "dummy:deepseek-v2-lite": [name for name in SHAPES if name.startswith("deepseek-v2-lite")],
    "dummy:gpt-oss-20b": ["gpt-oss qkv", "gpt-oss o_proj", "gpt-oss-20b router", "gpt-oss lm_head"],
    "dummy:gpt-oss-120b": ["gpt-oss qkv", "gpt-oss o_proj", "gpt-oss-120b router", "gpt-oss lm_head"],
}
COLS = ["shape", "M", "cublas_us", "gemv_us", "gemv/cublas", "gemv_GBps", "floor_us", "gemv/floor", "gemv/datasheet"]
FUSED_COLS = ["shape", "M", "kind", "unfused_us", "fused_us", "fused/unfused", "fused/floor", "fused/datasheet"]
EPS = 1e-6



def timed_us(n: int, k: int, m: int, fn, x_cols: int | None = None) -> float:
    """Microseconds per ``fn(x, w)`` for x [m, x_cols or k], each call taking the next cold weight [n, k]."""
    copies = max(1, min(512, math.ceil(COLD_BYTES / (n * k * 2))))  # a router gate is 16 KB-0.5 MB
    weights = [torch.randn(n, k, device="cuda", dtype=DT) * k**-0.5 for _ in range(copies)]
    x = torch.randn(m, x_cols or k, device="cuda", dtype=DT)
    step = itertools.count()
    return graph_time_ms(lambda: fn(x, weights[next(step) % copies]), calls=max(20, copies)) * 1e3


def bench_shape(name: str, m: int, sms: int) -> dict:
    n, k = SHAPES[name]
    nbytes = (n * k + m * k + m * n) * 2
    cublas = timed_us(n, k, m, F.linear)
    ours = timed_us(n, k, m, gemv)
    return {"shape": name, "M": m, "N": n, "K": k, "bytes": nbytes, "cublas_us": cublas, "gemv_us": ours,
            "gemv/cublas": ours / cublas, "gemv_GBps": nbytes / ours / 1e3,
            "config": vars(choose_config(m, n, k, sms))}  # fmt: skip


def bench_fused(name: str, m: int) -> dict:
    """Down projection with its activation: silu_mul_gemv against silu_and_mul + the faster projection."""
    n, k = SHAPES[name]
    unfused = min(timed_us(n, k, m, lambda gu, w, mm=mm: mm(silu_and_mul(gu), w), x_cols=2 * k) for mm in (F.linear, gemv))
    fused = timed_us(n, k, m, silu_mul_gemv, x_cols=2 * k)
    return {"shape": name, "M": m, "N": n, "K": k, "kind": "silu_mul", "bytes": (n * k + 2 * m * k + m * n) * 2,
            "unfused_us": unfused, "fused_us": fused, "fused/unfused": fused / unfused}  # fmt: skip


def bench_norm(name: str, m: int) -> dict:
    """A projection with the RMSNorm before it: norm_gemv against fused_add_rms_norm + the faster projection."""
    n, k = SHAPES[name]
    residual = torch.randn(m, k, device="cuda", dtype=DT)
    norm_w = torch.randn(k, device="cuda", dtype=DT)
    unfused = min(timed_us(n, k, m, lambda x, w, mm=mm: mm(fused_add_rms_norm(x, residual, norm_w, EPS)[0], w))
                  for mm in (F.linear, gemv))  # fmt: skip
    fused = timed_us(n, k, m, lambda x, w: norm_gemv(x, norm_w, EPS, w, None, residual))
    return {"shape": name, "M": m, "N": n, "K": k, "kind": "norm",
            "bytes": (n * k + 3 * m * k + m * n) * 2,  # weight, x and residual in, residual and y out
            "unfused_us": unfused, "fused_us": fused, "fused/unfused": fused / unfused}  # fmt: skip


def add_floors(rows: list[dict], fused: list[dict], read: ReadBandwidth) -> None:
    """Each time against its bytes at the best rate of the run (probes, and every call timed here whose
    bytes exceed the cache), and at the datasheet rate."""
    for r in rows:
        read.observe(f"{r['shape']} M={r['M']} gemv", r["bytes"], r["gemv_us"] / 1e3)
        read.observe(f"{r['shape']} M={r['M']} cuBLAS", r["bytes"], r["cublas_us"] / 1e3)
    for r in fused:
        read.observe(f"{r['shape']} M={r['M']} fused {r['kind']}", r["bytes"], r["fused_us"] / 1e3)
    for r, key, prefix in [*((r, "gemv_us", "gemv") for r in rows), *((r, "fused_us", "fused") for r in fused)]:
        ratios = read.ratios(r[key] / 1e3, r["bytes"])
        if prefix == "gemv":
            r["floor_us"] = ratios["floor_ms"] * 1e3
        r[f"{prefix}/floor"], r[f"{prefix}/datasheet"] = ratios["ratio"], ratios["ratio_datasheet"]


def candidates(k: int) -> list[GemvConfig]:
    """The tile grid --sweep times: FMA tiles of 64 or 128 weight elements per thread, and dot tiles."""
    out = []
    for bn, per_thread in itertools.product((4, 8, 16, 32), (64, 128)):
        bk = per_thread * 32 * 4 // bn
        if bk <= max(256, k):
            out.append(GemvConfig(bn, bk, num_warps=4, num_stages=2, use_dot=False))
    for bn, bk in itertools.product((16, 32, 64), (64, 128, 256)):
        out.append(GemvConfig(bn, bk, num_warps=4, num_stages=3, use_dot=True))
    return out


def sweep(name: str, m: int, sms: int) -> dict:
    n, k = SHAPES[name]
    chosen = choose_config(m, n, k, sms)
    times = {}
    for cfg in dict.fromkeys([chosen, *candidates(k)]):
        try:
            times[cfg] = timed_us(n, k, m, lambda x, w, c=cfg: gemv(x, w, config=c))
        except Exception as e:  # a tile too large for this card's shared memory: skipped, and said so
            print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}")
    best = min(times, key=times.get)
    row = {"shape": name, "M": m, "chosen_us": times[chosen], "best_us": times[best],
           "chosen/best": times[chosen] / times[best], "chosen": str(chosen), "best": str(best)}  # fmt: skip
    print_table([row], list(row))
    return row


def largest_winning_m(rows: list[dict], ratio: str) -> dict[str, int]:
    """Per shape, the largest M below which (inclusive) every measured M has ``ratio`` < 1."""
    out: dict[str, int] = {}
    for name in dict.fromkeys(r["shape"] for r in rows):
        best = 0
        for r in sorted((r for r in rows if r["shape"] == name), key=lambda r: r["M"]):
            if r[ratio] >= 1.0:
                break
            best = r["M"]
        out[name] = best
    return out


def rule_from_results(payload: dict) -> dict:
    """The routing table (gemv_rule.json) a results payload of this benchmark supports: per shape, the
    largest winning row count of each kind of call measured; kinds not measured are left out (cuBLAS)."""
    dims = {r["shape"]: (r["N"], r["K"]) for r in payload["rows"]}
    fused = payload.get("fused", [])
    kinds = {"linear": largest_winning_m(payload["rows"], "gemv/cublas")}
    for kind in ("silu_mul", "norm"):
        # results from before the norm rows carry SiLU·mul rows without a "kind"
        measured = [r for r in fused if r.get("kind", "silu_mul") == kind]
        if measured:
            kinds[kind] = largest_winning_m(measured, "fused/unfused")
    env = payload.get("environment", {})
    shapes = [{"name": name, "n": n, "k": k, **{kind: per[name] for kind, per in kinds.items() if name in per}}
              for name, (n, k) in dims.items()]
    return {"device": env.get("device"), "written_by": "benchmarks/gemv.py",
            "measured": {key: env.get(key) for key in ("date", "commit", "torch", "triton")},
            "rule": "gemv for a (kind, N, K) call at most the listed rows; unlisted: cuBLAS", "shapes": shapes}


def merge_with_earlier(payload: dict, earlier: dict | None) -> dict:
    """``payload`` plus the rows of ``earlier`` (a results file of this benchmark on the same card) for
    shapes this run did not measure. Every row names the run that measured it (date, commit)."""
    env = payload["environment"]
    for r in payload["rows"] + payload["fused"]:
        r.setdefault("measured", {"date": env.get("date"), "commit": env.get("commit")})
    if not earlier or earlier.get("environment", {}).get("device") != env.get("device"):
        return payload
    old_env = earlier["environment"]
    measured = {r["shape"] for r in payload["rows"]}
    carried = {"rows": [], "fused": []}
    for key in carried:
        for r in earlier.get(key, []):
            if r["shape"] not in measured:
                carried[key].append({**r, "measured": r.get("measured") or
                                     {"date": old_env.get("date"), "commit": old_env.get("commit")}})  # fmt: skip
    return {**payload, "rows": carried["rows"] + payload["rows"], "fused": carried["fused"] + payload["fused"]}


def write_rule(payload: dict, path: Path | None = None) -> dict:
    """The rule of ``payload`` written to ``path``, by default this card's shipped table (kernels/tables.py)."""
    rule = rule_from_results(payload)
    path = path or tables.shipped_path(RULE_PATH.name, str(rule["device"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rule, indent=1) + "\n")
    print(f"routing rule for {rule['device']} written to {path}")
    return rule


def write_result(name: str, payload: dict):
    """benchmarks/common.write_result: a source checkout's results folder (the benchmark's own entry point only;
    `graphserve tune` writes tables, not results)."""
    from benchmarks.common import write_result as write

    return write(name, payload)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES), metavar="SHAPE")
    p.add_argument("--models", nargs="+", default=None, choices=list(MODEL_SHAPES), metavar="MODEL",
                   help="measure the projections of these presets (with --shapes: both)")  # fmt: skip
    p.add_argument("--batches", nargs="+", type=int, default=BATCHES)
    p.add_argument("--sweep", action="store_true",
                   help="also time a grid of tile configs per shape and batch (minutes each: narrow it with "
                        "--shapes and --batches)")  # fmt: skip
    p.add_argument("--rule-from", default=None, metavar="RESULTS_JSON",
                   help="only rewrite graphserve/kernels/gemv_rule.json from an earlier results file")
    args = p.parse_args()
    if args.rule_from:
        write_rule(json.loads(Path(args.rule_from).read_text()))
        return
    chosen = list(dict.fromkeys((args.shapes or []) + [n for m in args.models or [] for n in MODEL_SHAPES[m]]))
    args.shapes = chosen or DEFAULT_SHAPES
    sms = sm_count(torch.device("cuda"))
    read = measured_read_bw()
    print(f"probes: {read.describe()}; {sms} SMs, {torch.cuda.get_device_name(0)}")
    rows = []
    for name in args.shapes:
        for m in args.batches:
            rows.append(bench_shape(name, m, sms))
            print_table([rows[-1]], COLS[:6])
    fused = [bench_fused(name, m) for name in args.shapes if name.endswith("down") for m in args.batches]
    fused += [bench_norm(name, m) for name in args.shapes if name.endswith(("qkv", "gate_up"))
              and name not in PLAIN_GATE_UP for m in args.batches]  # fmt: skip
    add_floors(rows, fused, read)
    print(f"floor: {read.describe()}")
    print()
    print_table(rows, COLS)
    if fused:
        print()
        print_table(fused, FUSED_COLS)
    swept = [sweep(name, m, sms) for name in args.shapes for m in args.batches] if args.sweep else []
    payload = {"read_gbs": read.best_gbs, "read": read.summary(), "sm_count": sms, "dtype": str(DT), "rows": rows,
               "fused": fused, "sweep": swept}
    from benchmarks.common import RESULTS_DIR

    results = RESULTS_DIR / "gemv.json"
    earlier = json.loads(results.read_text()) if results.exists() else None
    path = write_result("gemv", payload)
    merged = merge_with_earlier(json.loads(path.read_text()), earlier)
    path = write_result("gemv", {k: v for k, v in merged.items() if k != "environment"})
    rule = write_rule(json.loads(path.read_text()))
    print()
    for shape in rule["shapes"]:
        kinds = ", ".join(f"{kind} up to M = {shape[kind]}" for kind in ("linear", "silu_mul", "norm") if kind in shape)
        print(f"{shape['name']}: gemv {kinds}")


if __name__ == "__main__":
    main()
