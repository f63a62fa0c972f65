"""MLA attention kernels against the bytes of the latent cache they must read, and the decode tile sweep.

Decode: the absorbed attention kernel alone (kernels/mla_attention.py) at batch 1, 16, 64, 256 and
context 1024, 4096, 16384 with DeepSeek-V2-Lite's 16 heads, V3's 128 at batch 1 and 64, and an fp8
cache at batch 64, each with the tile and split count the engine would use (kernels/mla_config.py:
the measured rule, else the code defaults). Floor: the latent cache rows in context
(``batch x ctx x 576`` elements) plus the queries and outputs, over the best read bandwidth measured
in the same run (benchmarks/roofline.py). Times come from CUDA-graph replay, as decode runs in the engine.

``--sweep``: per (heads, batch, context) point, every candidate tile of ``CANDIDATES`` at the split
counts that its occupancies give; the winner of each point goes into the rule the kernel reads,
graphserve/kernels/mla_tiles.json (with the card's name; another card keeps the code defaults).
The full sweep takes about 3 minutes on an H200 (most of it compiling the ~30 tile variants),
``--sweep --quick`` under a minute (a few points and tiles; its rule is not written unless
``--write-rule``). ``--rule-from FILE`` rewrites the rule from an earlier sweep's results, no GPU.
``--sweep --cache fp8_e4m3`` sweeps over an fp8 latent cache: its winners become the rule's fp8 entries and
the model-dtype cache's stay (a cache kind without entries of its own takes the model dtype's).

Extend: one chunk on a cached prefix, the absorbed kernel against the expanded form the engine runs
(layers/mla_expanded.py: ``kv_b_proj`` over the chunk and its prefix, then SDPA with 192-wide keys),
to keep that choice measured.

Run: python3 -m benchmarks.mla [--quick]            (writes benchmarks/results/mla.json)
     python3 -m benchmarks.mla --sweep [--quick] [--cache fp8_e4m3]
                                    (benchmarks/results/mla_sweep.json or mla_sweep_fp8.json, and the rule)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

import torch

from graphserve.kernels import mla_attention as mla_kernels
from graphserve.kernels import tables
from graphserve.kernels.common import sm_count
from graphserve.kernels.mla_attention import mla_attention
from graphserve.kernels.mla_config import (
    RULE_PATH,
    MLATile,
    cache_kind,
    choose_num_splits,
    decode_tile,
    fallback_decode_tile,
)
from graphserve.layers.mla_expanded import expanded_extend
from graphserve.layers.mla_reference import absorbed_decode_batched
from graphserve.tuning.roofline import measured_read_bw
from graphserve.tuning.timing import cuda_time_ms, environment, graph_time_ms, print_table

DT = torch.bfloat16
RANK, ROPE, NOPE, V, PAGE = 512, 64, 128, 128, 16
COLS = ["heads", "bs", "ctx", "cache", "tile", "splits", "us", "floor_us", "ratio", "gbs", "pct_bw", "tflops"]
# Candidates per head count (the occupancy each is swept at is added by the sweep), all within sm_90's
# 227 KiB of shared memory and free of register spills (ptxas -v). Few heads: one head block;
# head-major with 16-64 tokens per step, token-major with 32-64, 2-4 stages (2 and more buffers).
# Many heads (V3's 128): 32-64 heads per program (a 64-row Hopper warpgroup MMA), both layouts, and
# 16 per program for comparison.
CANDIDATES = {
    16: ["hm-h16n16w4s2", "hm-h16n16w4s3", "hm-h16n32w4s2", "hm-h16n32w4s3", "hm-h16n32w4s4", "hm-h16n64w8s2",
         "tm-h16n32w4s3", "tm-h16n32w4s4", "tm-h16n64w4s2"],
    128: ["hm-h16n16w4s2", "hm-h32n32w8s3", "hm-h64n16w8s3", "hm-h64n32w8s2", "hm-h64n32w8s3", "tm-h64n32w8s3",
          "tm-h32n64w8s2"],
}
QUICK_CANDIDATES = {16: ["hm-h16n16w4s2", "hm-h16n32w4s3", "tm-h16n32w4s3", "tm-h16n64w4s2"],
                    128: ["hm-h64n32w8s2", "tm-h64n32w8s3"]}
SWEEP_POINTS = {16: ([1, 4, 16, 64, 256], [1024, 4096, 16384]), 128: ([1, 8, 64], [1024, 4096, 16384])}
QUICK_POINTS = {16: ([1, 64], [4096]), 128: ([64], [4096])}
_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}  # a sweep row's "cache"
OCCUPANCIES = (2, 1, 4)  # programs per SM the split count aims to fill; a tie in split count keeps the first



class SweepAborted(RuntimeError):
    """A launch faulted on the GPU (an illegal address, say): the CUDA context is unusable from then on,
    so nothing after it in this process could be timed or trusted."""


def cuda_fault(e: BaseException) -> bool:
    """An error that poisons the CUDA context, unlike a tile that fails to compile or to fit."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return (accelerator_error is not None and isinstance(e, accelerator_error)) or "CUDA error" in str(e)


class DecodeCase:
    """The inputs of one decode point (random cache, shuffled blocks), shared by every tile timed on it."""

    def __init__(self, heads: int, batch: int, ctx: int, cache_dtype: torch.dtype = DT, check: bool = False) -> None:
        self.heads, self.batch, self.ctx, self.cache_dtype = heads, batch, ctx, cache_dtype
        self.cache, self.tables, self.lens, self.q_lat, self.q_rope = setup(heads, batch, ctx, cache_dtype=cache_dtype)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        self.out = torch.empty_like(self.q_lat)
        self.capacity = self.tables.shape[1] * PAGE
        cache_bytes = cache_dtype.itemsize * batch * ctx * (RANK + ROPE)
        self.nbytes = cache_bytes + 2 * (batch * heads * (RANK + ROPE) + batch * heads * RANK)
        self.flops = 2 * batch * heads * ctx * (RANK + ROPE + RANK)
        # the PyTorch reference in fp32 (layers/mla_reference.py), not another tile: a winner is never wrong,
        # and no kernel runs before the candidates, so a fault is always the candidate's
        self.expected = self.reference() if check else None

    @property
    def point(self) -> str:
        return f"heads={self.heads} bs={self.batch} ctx={self.ctx} cache={str(self.cache_dtype).split('.')[-1]}"

    def reference(self, rows: int = 8) -> torch.Tensor:
        """``rows`` sequences at a time: bs 256 at 16k context would gather 9.7 GB of fp32 rows at once."""
        out = torch.empty(self.q_lat.shape, dtype=torch.float32, device="cuda")
        for i in range(0, self.batch, rows):
            j = min(i + rows, self.batch)
            out[i:j] = absorbed_decode_batched(self.q_lat[i:j].float(), self.q_rope[i:j].float(), self.cache,
                                               self.tables[i:j], self.lens[i:j], 0.1)
        return out

    def time_ms(self, tile: MLATile | None = None, num_splits: int | None = None) -> float | None:
        """Graph-replay time of one call; None when ``tile`` cannot compile or fit on this card or (with a
        reference) gives a wrong output. A fault on the GPU raises SweepAborted naming the tile and point."""
        label = f"tile {tile.name if tile else 'default'} (splits {num_splits or 'default'}) at {self.point}"
        calls = max(2, min(20, int(4e8 // self.nbytes)))  # ~0.4 GB read per graph: short points replay more

        def call():
            mla_attention(self.q_lat, self.q_rope, self.cache, self.tables, self.lens, self.qsl, 0.1,
                          max_query_len=1, out=self.out, tile=tile, num_splits=num_splits)

        try:
            call()  # eager and synchronised first: a fault is this launch's, not some later call's
            torch.cuda.synchronize()
        except Exception as e:
            if cuda_fault(e):
                raise SweepAborted(f"{label}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
            print(f"{label} skipped: {type(e).__name__}: {str(e).splitlines()[0][:100]}")  # does not compile
            return None
        if tile is not None and tile in mla_kernels._UNFIT:  # it ran the fallback tile: not this one's time
            print(f"{label} skipped: out of shared memory")
            return None
        if self.expected is not None and (err := rel_err(self.out, self.expected)) > 2e-2:  # never a wrong winner
            print(f"{label} skipped: output differs from the fp32 reference by {err:.2e}")
            return None
        try:
            ms = graph_time_ms(call, calls=calls)
            torch.cuda.synchronize()
        except Exception as e:
            if cuda_fault(e):
                raise SweepAborted(f"{label}, replayed from a CUDA graph: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0]}") from e
            raise
        return ms

    def row(self, bw, tile: MLATile, splits: int, ms: float) -> dict:
        bw.observe(f"mla decode h={self.heads} bs={self.batch} ctx={self.ctx} {tile.name}", self.nbytes, ms)
        return {"heads": self.heads, "bs": self.batch, "ctx": self.ctx, "cache": str(self.cache_dtype).split(".")[-1],
                "tile": tile.name, "splits": splits, "ms": ms, "bytes": self.nbytes, "flops": self.flops}

    def engine_row(self, bw) -> dict | None:
        """The tile and split count the engine would pick for this point."""
        ms = self.time_ms()
        if ms is None:
            return None
        tile = decode_tile(self.heads, self.batch, self.capacity, DT, torch.device("cuda"), cache_kind(self.cache_dtype))
        tile = fallback_decode_tile(DT) if tile in mla_kernels._UNFIT else tile
        return self.row(bw, tile, self.splits(tile), ms)

    def splits(self, tile: MLATile) -> int:
        return choose_num_splits(self.batch, math.ceil(self.heads / tile.block_h), self.capacity,
                                 sm_count(torch.device("cuda")), tile.occupancy)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def setup(heads: int, batch: int, ctx: int, tokens: int | None = None, cache_dtype: torch.dtype = DT):
    blocks = -(-ctx // PAGE)
    cache = torch.randn(batch * blocks + 1, PAGE, 1, RANK + ROPE, device="cuda", dtype=DT).mul_(0.5).to(cache_dtype)
    tables = (torch.randperm(batch * blocks, device="cuda").int() + 1).view(batch, blocks)
    tokens = batch if tokens is None else tokens
    q_lat = torch.randn(tokens, heads, RANK, device="cuda", dtype=DT).mul_(0.1)
    q_rope = torch.randn(tokens, heads, ROPE, device="cuda", dtype=DT).mul_(0.1)
    return cache, tables, torch.full((batch,), ctx, dtype=torch.int32, device="cuda"), q_lat, q_rope


def sweep(bw, quick: bool, rows: list[dict], cache_dtype: torch.dtype = DT,
          points: dict[int, tuple[list[int], list[int]]] | None = None) -> None:  # fmt: skip
    """Every candidate tile at every point over a latent cache of ``cache_dtype``, each at the distinct split
    counts its occupancies give; rows are appended as they are measured, so a SweepAborted leaves the ones
    before it. ``points``: heads -> (batches, contexts) instead of the sweep's own (graphserve tune measures one
    point at a time, to bound its time)."""
    candidates, default_points = (QUICK_CANDIDATES, QUICK_POINTS) if quick else (CANDIDATES, SWEEP_POINTS)
    points = points or default_points
    for heads, (batches, contexts) in points.items():
        tiles = [MLATile.parse(f"{name}o1") for name in candidates[heads]]
        for batch in batches:
            for ctx in contexts:
                case = DecodeCase(heads, batch, ctx, cache_dtype, check=True)
                for base in tiles:
                    timed: dict[int, dict] = {}  # split count -> its row: occupancies that give it share one timing
                    for occupancy in OCCUPANCIES:
                        tile = dataclasses.replace(base, occupancy=occupancy)
                        splits = case.splits(tile)
                        if splits in timed:
                            timed[splits].setdefault("also", []).append(tile.name)
                            continue
                        ms = case.time_ms(tile, splits)
                        if ms is None:
                            break
                        timed[splits] = case.row(bw, tile, splits, ms)
                        rows.append(timed[splits])
                del case
                torch.cuda.empty_cache()


def _cache(row: dict) -> str:
    """A row's cache dtype (rows of sweeps before the cache was recorded: bf16)."""
    return row.get("cache", "bfloat16")


def fastest(rows: list[dict], n: int) -> list[dict]:
    """The ``n`` fastest rows of each (cache, heads, bs, ctx) point, points in order."""
    ranked = sorted(rows, key=lambda r: (_cache(r), r["heads"], r["bs"], r["ctx"], r["ms"]))
    rank: dict[tuple, int] = {}
    out = []
    for r in ranked:
        key = (_cache(r), r["heads"], r["bs"], r["ctx"])
        rank[key] = rank.get(key, 0) + 1
        if rank[key] <= n:
            out.append(r)
    return out


def winners(rows: list[dict]) -> list[dict]:
    """Per (cache, heads, bs, ctx): the fastest row, beside the code default's time at that point."""
    from graphserve.kernels.mla_config import default_decode_tile

    out = []
    for r in fastest(rows, 1):
        key = (_cache(r), r["heads"], r["bs"], r["ctx"])
        default = default_decode_tile(r["heads"], DT).name
        at_default = [d["ms"] for d in rows  # the default's own row, or the row of the occupancy it shares splits with
                      if (_cache(d), d["heads"], d["bs"], d["ctx"]) == key and default in (d["tile"], *d.get("also", ()))]
        out.append({"cache": _cache(r), "heads": r["heads"], "bs": r["bs"], "ctx": r["ctx"], "tile": r["tile"],
                    "splits": r["splits"],
                    "us": r["us"], "pct_bw": r["pct_bw"], "tflops": r["tflops"], "default_tile": default,
                    "default_us": at_default[0] * 1e3 if at_default else None,
                    "speedup": at_default[0] / r["ms"] if at_default else None})
    return out


def rule_from_sweep(payload: dict, before: dict | None = None) -> dict:
    """The rule of a sweep's winners, each entry naming its cache kind and the run that measured it; ``before``
    (the rule file as it was): its entries of the cache kinds this sweep did not measure stay, on the same card
    (a sweep of the fp8 cache keeps the model-dtype cache's tiles)."""
    env = payload.get("environment", {})
    measured = {key: env.get(key) for key in ("date", "commit", "torch", "triton")}
    entries = [{"cache": cache_kind(_CACHE_DTYPES[_cache(w)]),
                **{k: w[k] for k in ("heads", "bs", "ctx", "tile", "splits", "us", "pct_bw", "default_us")},
                "measured_at": measured} for w in payload["winners"]]  # fmt: skip
    swept = {e["cache"] for e in entries}
    if before and before.get("device") == env.get("device"):
        entries = [{"cache": "model", "measured_at": before.get("measured"), **e} for e in before.get("entries", [])
                   if e.get("cache", "model") not in swept] + entries
    return {"device": env.get("device"), "written_by": "benchmarks/mla.py --sweep", "measured": measured,
            "rule": "MLA decode tile per (cache kind, heads, bs, ctx = block-table capacity); between points the "
                    "nearest (log scale, heads first); a cache kind without entries takes the model dtype's",
            "entries": entries}



def write_rule(payload: dict, path: Path | None = None) -> dict:
    """The rule of a sweep's winners written to ``path``, by default this card's shipped table (kernels/tables.py),
    keeping its entries of the cache kinds this sweep did not measure."""
    path = path or tables.shipped_path(RULE_PATH.name, str(payload.get("environment", {}).get("device")))
    before = json.loads(path.read_text()) if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    rule = rule_from_sweep(payload, before)
    text = json.dumps(rule, indent=1) + "\n"
    path.write_text(text)
    if os.environ.get("OUT"):  # comes back from the GPU beside the results
        Path(os.environ["OUT"], path.name).write_text(text)
    print(f"MLA decode tiles for {rule['device']} written to {path}")
    return rule


def finish(rows: list[dict], bw) -> None:
    """Every row against the best read rate of the whole run (a kernel that beat the probes raises it)."""
    for r in rows:
        r.update(bw.ratios(r["ms"], r["bytes"]))
        r.update(us=r["ms"] * 1e3, floor_us=r["floor_ms"] * 1e3, gbs=r["bytes"] / r["ms"] / 1e6,
                 pct_bw=100.0 / r["ratio"], tflops=r["flops"] / r["ms"] / 1e9)


def bench_extend(heads: int, chunk: int, prefix: int) -> dict:
    ctx = prefix + chunk
    cache, tables, lens, q_lat, q_rope = setup(heads, 1, ctx, tokens=chunk)
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    absorbed = cuda_time_ms(lambda: mla_attention(q_lat, q_rope, cache, tables, lens, qsl, 0.1,
                                                  max_query_len=chunk), warmup=3, iters=10)
    w_kv_b = torch.randn(heads, NOPE + V, RANK, device="cuda", dtype=DT).mul_(0.02)
    w_uk = w_kv_b[:, :NOPE]
    q = torch.randn(chunk, heads, NOPE + ROPE, device="cuda", dtype=DT)

    def absorbed_full():  # with the absorption and un-absorption matmuls the expanded form does not need
        ql = torch.bmm(q[..., :NOPE].transpose(0, 1), w_uk)
        o = mla_attention(ql.transpose(0, 1), q[..., NOPE:], cache, tables, lens, qsl, 0.1, max_query_len=chunk)
        return torch.bmm(o.transpose(0, 1), w_kv_b[:, NOPE:].transpose(1, 2))

    out = torch.empty(chunk, heads, V, device="cuda", dtype=DT)

    def expanded():  # what the engine runs for prefill and extend (layers/mla_expanded.py)
        expanded_extend(q, cache, w_kv_b, tables, [chunk], [ctx], NOPE, 0.1, out)

    return {"heads": heads, "chunk": chunk, "prefix": prefix, "absorbed_kernel_ms": absorbed,
            "absorbed_ms": cuda_time_ms(absorbed_full, warmup=3, iters=10),
            "expanded_ms": cuda_time_ms(expanded, warmup=3, iters=10)}


def abort(e: SweepAborted, rows: list[dict], bw) -> None:
    """Stop the run at a GPU fault: keep what was measured before it, write no rule, name the launch."""
    finish(rows, bw)
    write_result("mla_aborted", {"read_bandwidth": bw.summary(), "aborted": str(e), "rows": rows})
    raise SystemExit(f"MLA benchmark stopped: {e}\nA fault leaves the CUDA context unusable, so nothing after it "
                     f"can run in this process; the {len(rows)} rows measured before it are in "
                     f"benchmarks/results/mla_aborted.json and no tile rule was written.")


def write_result(name: str, payload: dict):
    """benchmarks/common.write_result: a source checkout's results folder (the benchmark's own entry point only;
    `graphserve tune` writes tables, not results)."""
    from benchmarks.common import write_result as write

    return write(name, payload)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer shapes and tiles (well under a minute)")
    p.add_argument("--bs", nargs="+", type=int, default=[1, 16, 64, 256])
    p.add_argument("--ctx", nargs="+", type=int, default=[1024, 4096, 16384])
    p.add_argument("--sweep", action="store_true", help="time the candidate tiles and write the rule (~3 min)")
    p.add_argument("--write-rule", action="store_true", help="with --sweep --quick: write the rule anyway")
    p.add_argument("--cache", choices=["bf16", "fp8_e4m3"], default="bf16",
                   help="with --sweep: the latent cache's dtype (the rule keeps the other kind's entries)")
    p.add_argument("--rule-from", default=None, metavar="RESULTS_JSON",
                   help="only rewrite graphserve/kernels/mla_tiles.json from an earlier --sweep results file")
    args = p.parse_args()
    if args.rule_from:
        write_rule(json.loads(Path(args.rule_from).read_text()))
        return
    bw = measured_read_bw()
    print(bw.describe())
    if args.sweep:
        rows: list[dict] = []
        try:
            sweep(bw, args.quick, rows, torch.float8_e4m3fn if args.cache == "fp8_e4m3" else DT)
        except SweepAborted as e:
            abort(e, rows, bw)
        finish(rows, bw)
        best = winners(rows)
        print("the 3 fastest tiles of each point:")
        print_table(fastest(rows, 3), COLS)
        print(f"\nwinners (% of the read bandwidth measured in this run, {bw.best_gbs:.0f} GB/s):")
        print_table(best, ["cache", "heads", "bs", "ctx", "tile", "splits", "us", "pct_bw", "tflops", "default_tile",
                           "default_us", "speedup"])
        payload = {"read_bandwidth": bw.summary(), "sweep": rows, "winners": best}
        write_result("mla_sweep" if args.cache == "bf16" else "mla_sweep_fp8", payload)  # each kind's file stays
        if not args.quick or args.write_rule:
            write_rule({"environment": environment(), **payload})
        return
    if args.quick:
        args.bs, args.ctx = [1, 64, 256], [1024, 4096]
    points = [(16, bs, ctx, DT) for bs in args.bs for ctx in args.ctx]
    points += [(128, bs, 4096, DT) for bs in (1, 64)]  # V3's heads
    points += [(16, 64, 4096, torch.float8_e4m3fn)]  # an fp8 latent cache: half the bytes
    rows = []
    for heads, bs, ctx, cache_dtype in points:
        try:
            row = DecodeCase(heads, bs, ctx, cache_dtype).engine_row(bw)
        except SweepAborted as e:
            abort(e, rows, bw)
        rows += [row] if row else []
        torch.cuda.empty_cache()
    finish(rows, bw)
    extend = [bench_extend(16, chunk, 4096) for chunk in (16, 64, 512, 2048)] + [bench_extend(128, 512, 4096)]
    print_table(rows, COLS)
    print("\nextend (one chunk on a 4096-token prefix):")
    print_table(extend, ["heads", "chunk", "prefix", "absorbed_kernel_ms", "absorbed_ms", "expanded_ms"])
    write_result("mla", {"read_bandwidth": bw.summary(), "decode": rows, "extend": extend})


if __name__ == "__main__":
    main()
