"""The FP4 routed experts' tiles (kernels/fp4_moe_config.py's ``fp4_moe_tiles.json``): for each expert shape of the
FP4 presets, at batches of 64, 1, 16, 4 and 256 tokens (T * k pairs; in that order, so that a time share spent leaves out the
last), a bounded set of grouped-GEMM tiles in both
variants ("bf16": FP4 widened to bf16; "fp8": converted to e4m3 for the FP8 tensor cores) and the streaming path,
each timed as the whole call (sort, quantization launches, both GEMMs, slot sum) replayed from a CUDA graph over two
weight copies in turn, so the routed experts come from HBM as in a decode step rather than from L2.

Per bucket and block_m, per variant: the best gate_up tile under that variant's default down tile, then the best
down tile under it; then the two mixes (gate_up in one variant, down in the other). The fastest goes into the table;
the streaming path takes the buckets from the smallest up while it beats it. A shape's time share spent, its
remaining buckets are left out (a call past the table's largest bucket takes that bucket's tiles).

``graphserve tune --tables fp4`` runs ``measure_shape`` per expert shape (graphserve/tuning/measure.py's fp4 plan)
and ``table_from`` merges them into the card's table; ``python3 -m benchmarks.fp4_moe_tiles`` prints, per shape and
tokens, ms, GB/s of the expert bytes the batch touches and the ratio to the same run's read floor for the streaming
path, the bf16 variant's default tile, its best tile and the fp8 variant's best tile (``bench_rows``).
"""

from __future__ import annotations

import time
from functools import partial

import torch

from graphserve.kernels.fp4_layout import GROUP
from graphserve.kernels.fp4_moe_config import (
    DEFAULT_STREAM_MAX_PAIRS,
    FP8_STEP,
    TABLE_NAME,
    Fp4MoeShapeTiles,
    Fp4MoeTable,
    Fp4MoeTile,
    default_block_m,
    default_tile,
    shape_entry,
)

# expert shapes of the FP4 presets (qwen3-30b-a3b as --quantization nvfp4 makes it): experts, hidden, intermediate
# per expert, top-k, format, activation, biases
SHAPES = {
    "deepseek-v4-flash-l6": (256, 4096, 2048, 6, "nvfp4", "silu_clamp", False),
    "gpt-oss-20b": (32, 2880, 2880, 4, "mxfp4", "swiglu_oai", True),
    "gpt-oss-120b": (128, 2880, 2880, 4, "mxfp4", "swiglu_oai", True),
    "qwen3-30b-a3b": (128, 2048, 768, 8, "nvfp4", "silu", False),
}
# batches in order of importance, so that a time share spent leaves out the least telling: a 64-token decode step
# first (DeepSeek-V4-Flash's measured one: 384 pairs over 256 experts), then one token
TOKENS = (64, 1, 16, 4, 256)
QUICK_TOKENS = (64, 1, 16)
DEVICE = torch.device("cuda")  # the CPU test of the sweep's logic swaps in the CPU, and fakes the timings
TABLE_FILE = TABLE_NAME  # where graphserve tune writes it: the per-user cache, or --out's per-card folder
STREAM_TIMED_PAIRS = 256  # past this the streaming path (one read of a pair's rows per pair) is not a contender
# (block_n, block_k, num_warps, num_stages) around the default tile (64, 128, 4, 3), which comes first so that the
# best is never slower than it; the fp8 variant's K step is one MMA (32), its block_n the MMA's M side (>= 64)
BF16_TILES = [(64, 128, 4, 3), (32, 128, 4, 3), (128, 128, 4, 3), (64, 256, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3),
              (64, 128, 4, 4), (32, 256, 4, 2)]  # fmt: skip
FP8_TILES = [(64, FP8_STEP, 4, 4), (64, FP8_STEP, 4, 3), (64, FP8_STEP, 4, 6), (128, FP8_STEP, 4, 4),
             (128, FP8_STEP, 8, 4), (128, FP8_STEP, 8, 3)]  # fmt: skip
VARIANT_TILES = {"bf16": BF16_TILES, "fp8": FP8_TILES}


def candidates(variant: str, block_m: int, group: int, k: int, quick: bool) -> list[Fp4MoeTile]:
    """``variant``'s tiles at ``block_m`` for a GEMM of depth ``k``: its default first, then the others that can run
    (a K step no deeper than K's power of two, whole scale groups; the fp8 variant only where 32 divides K)."""
    if variant == "fp8" and k % FP8_STEP:
        return []
    first = default_tile(variant, block_m, group, k)
    deepest = max(group, 1 << max(0, k - 1).bit_length())
    out = [first]
    for bn, bk, warps, stages in VARIANT_TILES[variant]:
        tile = Fp4MoeTile(variant, block_m, bn, bk, first.group_m, warps, stages)
        if bk % group == 0 and bk <= deepest and tile not in out:
            out.append(tile)
    return out[: 4 if quick else len(out)]


def block_ms(pairs: int, experts: int) -> list[int]:
    """The default block_m and, where an expert gets more pairs than half of it, the next one up."""
    bm = default_block_m(pairs, experts)
    return [bm, 2 * bm] if pairs / experts > bm / 2 and bm < 128 else [bm]


class Case:
    """One expert shape on the GPU: two copies of random FP4 experts, and a batch's random routing."""

    def __init__(self, name: str, gen: torch.Generator):
        self.name = name
        e, h, inter, k, fmt, act, bias = SHAPES[name]
        self.e, self.h, self.inter, self.k, self.fmt, self.activation = e, h, inter, k, fmt, act
        self.group = GROUP[fmt]
        self.copies = [self._weights(gen, bias) for _ in range(2)]

    def _weights(self, gen: torch.Generator, bias: bool) -> tuple:
        e, h, inter, g = self.e, self.h, self.inter, self.group
        out = []
        for parts, n, k in ((2, 2 * inter, h), (1, h, inter)):  # w13's gate and up globals; w2's one
            packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=DEVICE, generator=gen)
            if self.fmt == "nvfp4":
                scale = (torch.rand(e, n, k // g, device=DEVICE, generator=gen) * 0.5 + 0.05).to(torch.float8_e4m3fn)
                glob = torch.full((e, parts), 0.05, device=DEVICE)
            else:
                scale = torch.randint(118, 124, (e, n, k // g), dtype=torch.uint8, device=DEVICE, generator=gen)
                glob = None
            out += [packed, scale, glob]
        biases = {}
        if bias:
            biases = {"w13_bias": torch.randn(e, 2 * inter, device=DEVICE, generator=gen).bfloat16() * 0.1,
                      "w2_bias": torch.randn(e, h, device=DEVICE, generator=gen).bfloat16() * 0.1}  # fmt: skip
        return tuple(out), biases

    def batch(self, tokens: int, gen: torch.Generator) -> tuple:
        x = torch.randn(tokens, self.h, device=DEVICE, generator=gen).bfloat16()
        logits = torch.randn(tokens, self.e, device=DEVICE, generator=gen)
        weights, ids = torch.softmax(logits, -1).topk(self.k, dim=-1)
        return x, weights.contiguous(), ids.int().contiguous()

    def expert_bytes(self, ids: torch.Tensor) -> int:
        """The FP4 bytes (codes and block scales) of the experts a batch routes to: what the call must read."""
        per_expert = 3 * self.h * self.inter // 2 + 3 * self.h * self.inter // self.group
        return int(ids.unique().numel()) * per_expert

    def ms(self, batch: tuple, **overrides) -> float:
        """The call's GPU time (ms) under ``overrides`` (path, tiles), over both weight copies; inf where the tile
        does not compile or run on this card."""
        from graphserve.kernels.fp4_moe import fp4_fused_experts
        from graphserve.tuning.moe_tune import graph_ms

        x, weights, ids = batch
        calls = [partial(fp4_fused_experts, x, w[0], w[1], w[2], w[3], w[4], w[5], self.fmt, weights, ids,
                         activation=self.activation, **biases, **overrides) for w, biases in self.copies]  # fmt: skip

        def run() -> None:
            for c in calls:
                c()

        try:
            return graph_ms(run) / len(calls)
        except Exception as e:  # a tile that does not compile here (shared memory, registers) costs its timing
            print(f"{self.name}: {overrides}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            torch.cuda.synchronize()
            return float("inf")


def _sweep(case: Case, batch: tuple, variant: str, bm: int, quick: bool) -> tuple[Fp4MoeTile, Fp4MoeTile, float]:
    """``variant``'s best gate_up tile under its default down tile, then its best down tile."""
    gu_all = candidates(variant, bm, case.group, case.h, quick)
    dn_all = candidates(variant, bm, case.group, case.inter, quick)
    if not gu_all or not dn_all:
        return gu_all[0] if gu_all else None, dn_all[0] if dn_all else None, float("inf")
    gu_ms = {t: case.ms(batch, path="gemm", tiles=(t, dn_all[0])) for t in gu_all}
    gu = min(gu_ms, key=gu_ms.get)
    dn_ms = {t: case.ms(batch, path="gemm", tiles=(gu, t)) for t in dn_all}
    dn = min(dn_ms, key=dn_ms.get)
    return gu, dn, dn_ms[dn]


def measure_bucket(case: Case, tokens: int, quick: bool, gen: torch.Generator) -> dict:
    """One bucket: the streaming path (up to STREAM_TIMED_PAIRS pairs), the bf16 default tile, each variant's best
    pair of tiles and the mixes; the winner's tiles. Times in ms (inf: not timed or did not run)."""
    batch = case.batch(tokens, gen)
    pairs = tokens * case.k
    bm0 = default_block_m(pairs, case.e)
    default = (default_tile("bf16", bm0, case.group, case.h), default_tile("bf16", bm0, case.group, case.inter))
    row = {"model": case.name, "fmt": case.fmt, "tokens": tokens, "pairs": pairs,
           "experts_read": int(batch[2].unique().numel()), "bytes": case.expert_bytes(batch[2]),
           "stream_ms": case.ms(batch, path="stream") if pairs <= STREAM_TIMED_PAIRS else float("inf"),
           "gemm_bf16_default_ms": case.ms(batch, path="gemm", tiles=default)}  # fmt: skip
    best = {"bf16": (*default, row["gemm_bf16_default_ms"]), "fp8": (None, None, float("inf"))}
    mixed = (None, None, float("inf"))
    for bm in block_ms(pairs, case.e):
        found = {v: _sweep(case, batch, v, bm, quick) for v in ("bf16", "fp8")}
        for v, res in found.items():
            if res[2] < best[v][2]:
                best[v] = res
        if found["fp8"][0] is not None and found["bf16"][0] is not None:
            for gu, dn in ((found["fp8"][0], found["bf16"][1]), (found["bf16"][0], found["fp8"][1])):
                ms = case.ms(batch, path="gemm", tiles=(gu, dn))
                if ms < mixed[2]:
                    mixed = (gu, dn, ms)
    gu, dn, ms = min((best["bf16"], best["fp8"], mixed), key=lambda r: r[2])
    row.update(gemm_bf16_best_ms=best["bf16"][2], gemm_fp8_best_ms=best["fp8"][2], gemm_mixed_ms=mixed[2],
               gemm_ms=ms, gate_up=_short(gu), down=_short(dn), tiles=(gu, dn))  # fmt: skip
    return row


def _short(t: Fp4MoeTile) -> str:
    return f"{t.variant} {t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages} g{t.group_m}"


def measure_shape(name: str, budget_s: float, quick: bool, tokens: tuple[int, ...] | None = None) -> list[dict]:
    """The bucket rows of one preset's expert shape, the buckets in order until ``budget_s`` is spent (one bucket
    at most past it)."""
    start = time.monotonic()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    case = Case(name, gen)
    rows = []
    for t in tokens or (QUICK_TOKENS if quick else TOKENS):
        if rows and time.monotonic() - start > budget_s:
            print(f"{name}: time share {budget_s:.0f} s spent: buckets from {t} tokens left out", flush=True)
            break
        rows.append(measure_bucket(case, t, quick, gen))
        r = rows[-1]
        print(f"{name} T={t}: stream {r['stream_ms']:.3f} ms, bf16 default {r['gemm_bf16_default_ms']:.3f}, "
              f"bf16 best {r['gemm_bf16_best_ms']:.3f}, fp8 best {r['gemm_fp8_best_ms']:.3f}, mixed "
              f"{r['gemm_mixed_ms']:.3f}: {r['gate_up']} / {r['down']}", flush=True)
    del case
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def entry_from_rows(rows: list[dict]) -> Fp4MoeShapeTiles:
    """One shape's entry from its bucket rows: each bucket's winning tiles; the streaming path up to the largest
    bucket through which it beat the grouped GEMM at every bucket (0 where it lost at the first)."""
    rows = sorted(rows, key=lambda r: r["pairs"])
    stream_max = 0
    for r in rows:
        if not r["stream_ms"] < r["gemm_ms"]:
            break
        stream_max = r["pairs"]
    return Fp4MoeShapeTiles(stream_max, tuple(r["pairs"] for r in rows), tuple(r["tiles"][0] for r in rows),
                            tuple(r["tiles"][1] for r in rows))  # fmt: skip


def table_from(results: dict[str, list[dict]], earlier: dict | None, card: str) -> dict:
    """``fp4_moe_tiles.json``: the shapes measured now (by preset) over ``earlier``'s others."""
    shapes = {}
    for s in (earlier or {}).get("shapes", []):
        shapes[(s["fmt"], s["experts"], s["intermediate"], s["hidden"])] = s
    for name, rows in results.items():
        if not rows:
            continue
        e, h, inter, _k, fmt, _act, _bias = SHAPES[name]
        key = (fmt, e, inter, h)
        entry = shape_entry(key, entry_from_rows(rows))
        entry["measurements"] = [{k: None if v == float("inf") else v for k, v in r.items() if k != "tiles"}
                                 for r in rows]  # inf: not timed, or did not run
        shapes[key] = entry
    table = {"device": card, "source": "graphserve tune --tables fp4 (graphserve/tuning/fp4_moe.py)",
             "default_stream_max_pairs": DEFAULT_STREAM_MAX_PAIRS, "shapes": list(shapes.values())}  # fmt: skip
    Fp4MoeTable.from_json(table)  # what the engine will read back: refused here rather than passed over there
    return table


def bench_rows(rows: list[dict], floor_ms) -> list[dict]:
    """Per bucket row, one row per kernel: ms, GB/s of the expert bytes touched, ratio to the read floor
    (``floor_ms(bytes)``, the same run's probe)."""
    out = []
    for r in rows:
        for kernel, key in (("stream", "stream_ms"), ("gemm-bf16 default tile", "gemm_bf16_default_ms"),
                            ("gemm-bf16 best tile", "gemm_bf16_best_ms"), ("gemm-fp8 best tile", "gemm_fp8_best_ms"),
                            ("gemm mixed best", "gemm_mixed_ms")):  # fmt: skip
            ms = r[key]
            if ms == float("inf"):
                continue
            out.append({"model": r["model"], "fmt": r["fmt"], "tokens": r["tokens"], "pairs": r["pairs"],
                        "experts_read": r["experts_read"], "kernel": kernel, "ms": ms, "bytes": r["bytes"],
                        "gbs": r["bytes"] / ms / 1e6, "ratio": ms / floor_ms(r["bytes"])})  # fmt: skip
    return out

