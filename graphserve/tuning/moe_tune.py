"""Tune the MoE expert kernels' tiles for one model's expert shape and write the table the engine reads.

For each batch bucket (T tokens, k slots: T * k pairs) it times the whole expert path
(sort/align, gate_up, down, slot sum) inside CUDA graphs on random routing, alternating two
weight copies so the routed experts come from HBM as in a decode step, not from L2. Per block_m
it sweeps the gate_up tile with a default down tile, then the down tile with the best gate_up
one (a W8A8 gate_up tile one activation group wide runs with its epilogue quantizing down's input, as the
engine would run it: kernels/moe_fused.quant_out_group); the per-pair streaming path is timed at the small
buckets and wins its buckets while it is faster. Each bucket also times the path the engine took before the run (``before_us``: the table it
read at start, or the defaults where there was none) against the new table's (``tuned_us``), in the
same process; where that run took the grouped GEMM and timed faster than every tile the sweep timed, the
bucket keeps its tiles (``gemm_from``: "before"). The table goes to graphserve/kernels/moe_configs/ (and $OUT when set).

Run: python3 -m benchmarks.moe_tune --model dummy:qwen3-30b-a3b       (about 5-8 minutes on an H200)
     python3 -m benchmarks.moe_tune --experts 128 --hidden 2048 --intermediate 768 --top-k 8 --dtype bfloat16
     add --quick for a 4-bucket smoke run (under a minute)
     --dtype float8_e4m3fn: fp8 experts with 128x128 block scales and bf16 activations (the table
     ``--quantization fp8`` reads; the grouped GEMM runs W8A16 or W8A8 by kernels/moe_fused.py's rule,
     or, where a tile with ``a8`` wins, quantizes the activations inside the GEMM)
     --buckets 8 16 32 64 128 256 512: re-tune only these pair counts (here decode at batch 1..64,
     top-8) and keep the table's other buckets; the streaming path's entries are re-measured only
     when the smallest bucket (one token) is among them
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources

from graphserve.kernels.moe_config import (
    GemmTile,
    GemvTile,
    MoeTiles,
    default_gemv_tiles,
    device_name,
    moe_tiles,
    table_path,
)
from graphserve.kernels.moe_fused import W8A8_MIN_ROWS_PER_EXPERT, fused_experts
from graphserve.kernels.moe_routing import moe_softmax_topk
from graphserve.kernels.moe_scales import k_only_scales, stream_step
from graphserve.layers.quant.fp8_moe import quantize_stack
from graphserve.tuning.timing import environment, print_table

# expert shapes of the dummy presets: (experts, hidden, intermediate per expert, top_k)
SHAPES = {
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "olmoe-1b-7b": (64, 2048, 1024, 8),
    "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4),
    "deepseek-v2-lite": (64, 2048, 1408, 6),
    # DeepSeek-V3's routed experts (the dummy:deepseek-v3-l4 slice): two weight copies are 45 GB in bf16
    "deepseek-v3-l4": (256, 7168, 2048, 8),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
QUICK_TOKENS = [1, 8, 64, 256]
SMEM_LIMIT = 200 * 1024  # H100/H200 allow 227 KiB per block; leave room for the epilogue
DEVICE = torch.device("cuda")  # the CPU smoke test of the sweep's logic swaps in the CPU interpreter
# streaming tiles: a K step's weight tile of at most 64 elements a thread (gate_up's tile is its
# gate and up rows, down's all k slots), since the next step's tile is prefetched into registers
# beside it; larger ones spill (ptxas, sm_90: [32, 512] on 4 warps spills 5 KB)
GEMV_TILES = [GemvTile(bn, bk, w) for bn in (2, 4, 8, 16, 32) for bk in (128, 256, 512) for w in (4, 8)]
FP8 = torch.float8_e4m3fn
FP8_BLOCK = (128, 128)  # what Qwen3-FP8 / DeepSeek-V3 ship and --quantization fp8 writes


def gemv_candidates(top_k: int, fp8_block: tuple[int, int] | None = None) -> tuple[list[GemvTile], list[GemvTile]]:
    """(gate_up, down) streaming tiles within the register budget for ``top_k`` slots. With fp8 block scales
    (``fp8_block``) only tiles whose step the kernels take as given (kernels/moe_scales.stream_step): a step they
    would cap at the block's K would repeat a tile timed."""
    slots = triton.next_power_of_2(top_k)
    tiles = [g for g in GEMV_TILES if fp8_block is None or stream_step(*fp8_block, g.block_n, g.block_k)[0] == g.block_k]
    gate_up = [g for g in tiles if 2 * g.block_n * g.block_k <= 64 * 32 * g.num_warps]
    down = [g for g in tiles if slots * g.block_n * g.block_k <= 64 * 32 * g.num_warps]
    return gate_up, down


def gemm_candidates(per_expert: float, gated: bool, quick: bool, fp8_block: tuple[int, int] | None = None,
                    w8a8: bool = False) -> list[GemmTile]:  # fmt: skip
    """A pruned tile space: block_m up to twice the average rows per expert, shared memory that fits.

    fp8 weights (``fp8_block``: their scale block) take one byte a weight in shared memory, and a K
    step past the block's K only where the grouped GEMM folds the scales into an operand along k
    (W8A16, block_n dividing the block's N: kernels/moe_gemm.py's K_SCALES), up to 512 there;
    elsewhere the kernel would cap the step at the block's K, so such a tile would repeat one timed.
    fp8 weights also get the tiles that quantize the activations in the GEMM (``a8``, K step = the
    block's K), at every bucket: they compete with the mode kernels/moe_fused.py's rule gives the bucket, W8A8's
    separate quantization launch from ``W8A8_MIN_ROWS_PER_EXPERT`` pairs per expert (every bucket since it is 0),
    W8A16 below.
    """
    cap = max(16, min(128, triton.next_power_of_2(max(1, int(per_expert))) * 2))
    weight_bytes = 1 if fp8_block else 2
    out = []
    for bm in (16, 32, 64, 128):
        if bm > cap:
            continue
        for bn in (32, 64, 128, 256):
            if (bm == 16 and bn == 256) or (bm >= 64 and bn == 32):
                continue
            k_only = fp8_block is not None and k_only_scales(fp8_block[0], bn, w8a8)
            for bk in (64, 128, 256, 512) if k_only else (64, 128, 256):
                if (bm >= 64 and bk >= 256) or (fp8_block and not k_only and bk > fp8_block[1]):
                    continue
                # a K step of 256 or 512 may fit in shared memory only twice: time that too
                for stages in (2, 3, 4) if bk >= 256 and k_only else (3, 4):
                    smem = stages * (2 * bm * bk + weight_bytes * (2 if gated else 1) * bk * bn)
                    if smem > SMEM_LIMIT:
                        continue
                    out.append(GemmTile(bm, bn, bk, 8 if bm >= 64 else 1, 4 if bm * bn <= 8192 else 8, stages))
    if fp8_block:
        out += _a8_candidates(cap, gated, fp8_block[1])
    if quick:
        out = out[:: max(1, len(out) // 6)]
    return out


def _a8_candidates(cap: int, gated: bool, block_k: int) -> list[GemmTile]:
    """fp8 tiles that quantize the activations inside the GEMM (``GemmTile.a8``): a K step of exactly the
    scale block's K, a few widths, warps and stage counts."""
    out = []
    for bm in (16, 32, 64, 128):
        for bn in (32, 64, 128):
            if bm > cap or (bm >= 64 and bn == 32):
                continue
            for warps in (4, 8):
                for stages in (3, 4):
                    if stages * (2 * bm * block_k + (2 if gated else 1) * block_k * bn) <= SMEM_LIMIT:
                        out.append(GemmTile(bm, bn, block_k, 8 if bm >= 64 else 1, warps, stages, a8=True))
    return out


def graph_ms(fn) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph of enough calls to fill about 2 ms.

    Lighter than triton.testing.do_bench_cudagraph (which captures 15-20 ms per timing): the
    sweep times several hundred tiles per model and must finish inside 10 minutes.
    """
    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    calls = max(1, min(100, int(2.0 / max(start.elapsed_time(end) / 3, 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


class _Bucket:
    """One batch: T random tokens routed by random logits, run against both weight copies."""

    def __init__(self, sets: list, t: int, e: int, h: int, k: int, dtype: torch.dtype, gen: torch.Generator):
        self.sets = sets
        self.x = torch.randn(t, h, device=DEVICE, generator=gen).to(dtype)
        self.w, self.ids = moe_softmax_topk(torch.randn(t, e, device=DEVICE, generator=gen), k, True)

    def ms(self, **overrides) -> float:
        def run() -> None:
            for w13, w2, scales in self.sets:  # two weight copies: the second call's experts are not in L2
                fused_experts(self.x, w13, w2, self.w, self.ids, **scales, **overrides)

        try:
            return graph_ms(run) / len(self.sets)
        except OutOfResources as err:  # raised while compiling, before any capture: skip the tile
            print(f"skipped {overrides}: {err}")
            return float("inf")


def _tune_gemm(bucket: _Bucket, per_expert: float, quick: bool, space: dict) -> tuple[GemmTile, GemmTile, float]:
    """Per block_m: the best gate_up tile under a default down tile, then the best down tile
    (``space``: gemm_candidates' fp8 arguments for this bucket)."""
    best = (None, None, float("inf"))
    gated, plain = gemm_candidates(per_expert, True, quick, **space), gemm_candidates(per_expert, False, quick, **space)
    for bm in sorted({c.block_m for c in gated}):
        dn = GemmTile(bm, 64, 128, 8 if bm >= 64 else 1, 4, 3)
        gu_ms = {c: bucket.ms(path="gemm", gemm_tiles=(c, dn)) for c in gated if c.block_m == bm}
        gu = min(gu_ms, key=gu_ms.get)
        dn_ms = {c: bucket.ms(path="gemm", gemm_tiles=(gu, c)) for c in plain if c.block_m == bm}
        dn = min(dn_ms, key=dn_ms.get)
        if dn_ms[dn] < best[2]:
            best = (gu, dn, dn_ms[dn])
    if best[0] is None:
        raise RuntimeError(f"no tile compiled for {per_expert:.1f} rows per expert; see the skipped tiles above")
    return best


def _tune_gemv(bucket: _Bucket, k: int, default_down: GemvTile, fp8_block: tuple[int, int] | None,
               ) -> tuple[GemvTile, GemvTile]:  # fmt: skip
    gate_up, down = gemv_candidates(k, fp8_block)
    gu_ms = {g: bucket.ms(path="gemv", gemv_tiles=(g, default_down)) for g in gate_up}
    gu = min(gu_ms, key=gu_ms.get)
    dn_ms = {g: bucket.ms(path="gemv", gemv_tiles=(gu, g)) for g in down}
    return gu, min(dn_ms, key=dn_ms.get)


def tune(e: int, h: int, i: int, k: int, dtype: torch.dtype, quick: bool, budget_s: float,
         tokens: list[int] | None = None) -> tuple[MoeTiles, list]:  # fmt: skip
    """The table for ``tokens`` (default: every bucket, or the quick ones). The streaming path is timed
    only when the sweep starts at one token: it wins buckets from the smallest up, while it is faster."""
    tokens = tokens or (QUICK_TOKENS if quick else TOKENS)
    start = time.monotonic()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    fp8 = dtype == FP8
    act_dtype = torch.bfloat16 if fp8 else dtype
    sets = [_weights(e, h, i, act_dtype, fp8, gen) for _ in range(2)]
    default_gemv = default_gemv_tiles(k, i, h, FP8_BLOCK[1] if fp8 else 512)  # the defaults keep one block a step
    before = moe_tiles(e, i, h, dtype, DEVICE)  # what bucket.ms() runs with no overrides: the table read at start
    buckets, gate_up, down, rows = [], [], [], []
    small_max_pairs, gemv_best, gemv_winning = 0, None, tokens[0] == 1
    for t in tokens:
        bucket = _Bucket(sets, t, e, h, k, act_dtype, gen)
        before_ms = bucket.ms()  # what the engine ran before this run: the table it read at start, or the defaults
        over_budget = time.monotonic() - start > budget_s
        if over_budget and gate_up:
            print(f"time budget {budget_s:.0f} s spent: bucket T={t} reuses the previous bucket's tiles")
            best_gu, best_dn, best_ms = gate_up[-1], down[-1], float("nan")
        else:
            space = {"fp8_block": FP8_BLOCK if fp8 else None, "w8a8": fp8 and t * k >= W8A8_MIN_ROWS_PER_EXPERT * e}
            best_gu, best_dn, best_ms = _tune_gemm(bucket, t * k / e, quick, space)
        gemm_from = "this run"
        if t * k > before.small_max_pairs and before_ms < best_ms:  # the grouped GEMM ran before, and faster
            (best_gu, best_dn), best_ms, gemm_from = before.gemm_tiles(t * k), before_ms, "before"
        gemv_ms = float("nan")
        if gemv_winning and t * k <= 256 and not over_budget:
            gemv_best = gemv_best or _tune_gemv(bucket, k, default_gemv[1], FP8_BLOCK if fp8 else None)
            gemv_ms = bucket.ms(path="gemv", gemv_tiles=gemv_best)
            if gemv_ms < best_ms:
                small_max_pairs = t * k  # the streaming path wins every bucket up to here
            else:
                gemv_winning = False
        buckets.append(t * k)
        gate_up.append(best_gu)
        down.append(best_dn)
        row = {"tokens": t, "pairs": t * k, "gemm_us": best_ms * 1e3, "gemv_us": gemv_ms * 1e3,
               "before_us": before_ms * 1e3, "gemm_from": gemm_from, "gate_up": _short(best_gu), "down": _short(best_dn),
               "elapsed_s": time.monotonic() - start}  # fmt: skip
        rows.append(row)
        print_table([row], list(row))
    gemv_best = gemv_best or default_gemv
    tiles = MoeTiles(small_max_pairs, gemv_best[0], gemv_best[1], tuple(buckets), tuple(gate_up), tuple(down))
    for row in rows:  # the path the new table takes at each bucket, against what ran before
        row["tuned_us"] = row["gemv_us"] if row["pairs"] <= small_max_pairs else row["gemm_us"]
        row["tuned_vs_before"] = row["tuned_us"] / row["before_us"]
    return tiles, rows


def _weights(e: int, h: int, i: int, dtype: torch.dtype, fp8: bool, gen: torch.Generator) -> tuple:
    """(w13, w2, fused_experts' scale arguments): one copy of the experts, fp8 with block scales if asked."""
    w13 = (torch.randn(e, 2 * i, h, device=DEVICE, generator=gen) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=DEVICE, generator=gen) * i**-0.5).to(dtype)
    if not fp8:
        return w13, w2, {}
    (qg, sg), (qu, su), (q2, s2) = (quantize_stack(w, FP8_BLOCK) for w in (w13[:, :i], w13[:, i:], w2))
    scales = {"w13_scale": torch.cat([sg, su], 1).contiguous(), "w2_scale": s2.contiguous(), "weight_block": FP8_BLOCK}
    return torch.cat([qg, qu], 1), q2, scales


def merge_tables(old: dict, new: MoeTiles, rows: list[dict], streaming: bool) -> tuple[MoeTiles, list[dict]]:
    """The table written by an earlier run (``old``, its JSON) with the buckets of this run put in: a
    bucket in both takes this run's tiles and measurements, the others keep theirs. The streaming
    path's entries are this run's when it timed them (``streaming``: its sweep began at one token),
    else the earlier run's."""
    before = MoeTiles.from_json(old)
    tiles = {b: (g, d) for b, g, d in zip(before.buckets, before.gate_up, before.down)}
    tiles.update({b: (g, d) for b, g, d in zip(new.buckets, new.gate_up, new.down)})
    buckets = sorted(tiles)
    source = new if streaming else before
    merged = MoeTiles(source.small_max_pairs, source.gemv_gate_up, source.gemv_down, tuple(buckets),
                      tuple(tiles[b][0] for b in buckets), tuple(tiles[b][1] for b in buckets))  # fmt: skip
    kept = [_with_run(r, old) for r in old.get("measurements", []) if r.get("pairs") not in set(new.buckets)]
    return merged, sorted(kept + rows, key=lambda r: r["pairs"])


def _with_run(row: dict, table: dict) -> dict:
    """A kept measurement with the run that timed it (``measured_at``): its own, else the earlier table's
    environment where that table's run timed this bucket (a full run, or one of its ``retuned_buckets``); a row
    older than both stays without one (git history holds the table it came from)."""
    retuned = table.get("retuned_buckets")
    if "measured_at" in row or "environment" not in table or (retuned is not None and row.get("pairs") not in retuned):
        return row
    return {**row, "measured_at": table["environment"]}


def _short(tile: GemmTile | None) -> str:
    if tile is None:
        return "-"
    a8 = " a8" if tile.a8 else ""
    return f"{tile.block_m}x{tile.block_n}x{tile.block_k} g{tile.group_m} w{tile.num_warps} s{tile.num_stages}{a8}"


def table_payload(e: int, i: int, h: int, k: int, dtype: str, device: str, quick: bool, run: dict, tiles: MoeTiles,
                  rows: list[dict]) -> dict:  # fmt: skip
    """The table file kernels/moe_config.py reads, with the run that measured it and its measurements."""
    return {"experts": e, "intermediate": i, "hidden": h, "dtype": dtype, "device": device, "top_k": k,
            "quick": quick, "environment": run, **tiles.to_json(), "measurements": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"a dummy preset's expert shape: {', '.join('dummy:' + s for s in SHAPES)}")
    p.add_argument("--experts", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int, help="intermediate size of one expert (before tensor parallelism)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tp-size", type=int, default=1, help="tune for the per-rank shard I / tp-size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float8_e4m3fn"],
                   help="float8_e4m3fn: fp8 experts (128x128 block scales), bf16 activations")
    p.add_argument("--quick", action="store_true", help="4 buckets, a sixth of the tiles: a smoke run")
    p.add_argument("--buckets", nargs="+", type=int, metavar="PAIRS",
                   help="re-tune only these pair counts (multiples of top_k, e.g. 8 16 32 64 128 256 512 for "
                        "decode at batch 1..64 with top-8) and keep the table's other buckets")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=540.0, help="stop sweeping new buckets after this long")
    p.add_argument("--out-dir", type=Path, default=None, help="where the table goes (default: the package)")
    args = p.parse_args()
    if args.model:
        name = args.model.removeprefix("dummy:")
        if name not in SHAPES:
            p.error(f"--model {args.model!r} is not one of {', '.join('dummy:' + s for s in SHAPES)}")
        e, h, i, k = SHAPES[name]
    else:
        if None in (args.experts, args.hidden, args.intermediate):
            p.error("give --model, or all of --experts, --hidden and --intermediate")
        e, h, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    for flag, value in (("--experts", e), ("--hidden", h), ("--intermediate", i), ("--top-k", k),
                        ("--tp-size", args.tp_size)):  # fmt: skip
        if value < 1:
            p.error(f"{flag} {value} is invalid: must be >= 1")
    if not args.budget_s > 0:
        p.error(f"--budget-s {args.budget_s} is invalid: must be > 0")
    if k > e:
        p.error(f"--top-k {k} exceeds --experts {e}")
    if i % args.tp_size:
        p.error(f"--intermediate {i} is not divisible by --tp-size {args.tp_size}")
    i //= args.tp_size
    tokens = None
    if args.buckets:
        bad = [b for b in args.buckets if b <= 0 or b % k]
        if bad:
            p.error(f"--buckets {bad}: each bucket is a pair count T * k, a positive multiple of top_k {k}")
        tokens = sorted({b // k for b in args.buckets})
    dtype = getattr(torch, args.dtype)
    device = device_name(torch.device("cuda"))
    path = table_path(e, i, h, dtype, device)
    if args.out_dir is not None:
        path = args.out_dir / path.name
    old = None
    if args.buckets:
        # the table to keep the other buckets of: the one at the output path, else the package's
        for candidate in (path, table_path(e, i, h, dtype, device)):
            if candidate.exists():
                old = json.loads(candidate.read_text())
                break
        if old is None:
            p.error(f"--buckets re-tunes part of a table, and there is none at {path}: run without --buckets first")
    print(f"tuning experts={e} hidden={h} intermediate={i} top_k={k} {args.dtype} on {torch.cuda.get_device_name(0)}")
    tiles, rows = tune(e, h, i, k, dtype, args.quick, args.budget_s, tokens)
    run = environment()
    rows = [{**r, "measured_at": run} for r in rows]  # a later --buckets run keeps them with their run
    if old is not None:
        tiles, rows = merge_tables(old, tiles, rows, streaming=tokens[0] == 1)
    payload = table_payload(e, i, h, k, args.dtype, device, args.quick, run, tiles, rows)
    if args.buckets:
        payload["retuned_buckets"] = [t * k for t in tokens]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(json.dumps(payload, indent=1))
    print(f"small path up to {tiles.small_max_pairs} pairs; wrote {path}")


if __name__ == "__main__":
    main()
