"""The dense FP4 GEMM's tiles (kernels/fp4_gemm_config.py's ``fp4_gemm_tiles.json``) and, from the same timings, the
FP4 rule (``fp4_rule.json``: the streaming kernel's rows, the fp8 variant's first rows).

Per projection of a preset (``dense_shapes``), per format and row count (``ROWS``, in order of importance, so that a
time share spent leaves out the least telling): the streaming kernel up to 64 rows, and from 8 rows a short list of
tiles per variant (``candidates``: the card's default tile first, so the best is never slower than it; "dequant"
and "dequant_fp8" from 128 rows, the latter on a card with FP8 tensor cores), each timed as a CUDA graph replaying the call over copies of the weight together past three times
L2 (graphserve/tuning/fp4.py's ``graph_ms``), so the weight comes from HBM as in a decode step. The fastest tile of
any variant goes into the table's bucket of that row count; the rows of each kernel at its best tile feed fp4.py's
``derive_rule`` (the streaming kernel's rows, and the fp8 variant's against the bf16 one's).

``graphserve tune --tables fp4`` runs ``measure_projection`` per projection (graphserve/tuning/measure.py's fp4 plan)
and ``table_from`` merges them into the card's table; ``python3 -m benchmarks.fp4_gemm_tiles`` prints them.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from graphserve.kernels.fp4_dequant_fp8 import fp8_row_scales
from graphserve.kernels.fp4_gemm_config import (
    TABLE_NAME,
    VARIANTS,
    Fp4GemmConfig,
    Fp4GemmShapeTiles,
    Fp4GemmTable,
    Fp4GemmTile,
    default_config,
    fp8_tensor_cores,
    shape_entry,
)
from graphserve.kernels.fp4_gemv import MAX_ROWS as STREAM_MAX_ROWS
from graphserve.kernels.fp4_layout import FORMATS, GROUP

TABLE_FILE = TABLE_NAME
# rows in order of importance: a 64-row decode step first, then a prefill chunk (a call past the largest bucket takes
# its tile), one row (the streaming kernel alone: the rule's floor), small batches
ROWS = (64, 4096, 1, 16, 128, 32, 8, 256, 1024)
QUICK_ROWS = ROWS[:5]
MIN_GEMM_ROWS = 8  # below this the streaming kernel is the only contender
# (block_n, block_k, num_warps, num_stages, split_k) around the default, which comes first; x-first row tiles below 64
# rows (narrow column tiles, K split for few columns), weight-first from 64 (the prefill tiles)
BF16_SMALL = [(32, 128, 4, 3, 1), (64, 128, 4, 3, 1), (32, 128, 4, 3, 2), (32, 256, 4, 2, 1), (32, 128, 4, 3, 4),
              (64, 64, 4, 4, 1)]  # fmt: skip
BF16_LARGE = [(64, 128, 4, 3, 1), (128, 64, 8, 3, 1), (128, 128, 8, 3, 1), (64, 64, 4, 4, 1)]
# the fp8 variant: one 32-column MMA a step, the weight the MMA's M side (block_n >= 64)
FP8_SMALL = [(64, 32, 4, 4, 1), (64, 32, 4, 4, 2), (128, 32, 4, 4, 1), (64, 32, 4, 4, 4), (64, 32, 4, 6, 1)]
FP8_LARGE = [(64, 32, 4, 4, 1), (128, 32, 4, 4, 1), (128, 32, 8, 4, 1), (128, 32, 8, 3, 1)]
# the dequant variants (the weight dequantized to bf16 or converted to e4m3, then a library matmul): their first
# launch's tile, timed from DEQUANT_ROWS only (past kernels/fp4_gemm_config.DEQUANT_ABOVE_ROWS: the bucket holds 65
# to 128 rows)
DEQUANT_ROWS = 128
DEQUANT = [(64, 128, 4, 1, 1), (32, 256, 4, 1, 1)]
SPACE = {("bf16", False): BF16_SMALL, ("bf16", True): BF16_LARGE, ("fp8", False): FP8_SMALL, ("fp8", True): FP8_LARGE,
         ("dequant", False): [], ("dequant", True): DEQUANT, ("dequant_fp8", False): [],
         ("dequant_fp8", True): DEQUANT}  # fmt: skip
QUICK_CANDIDATES = 3
# families whose attention is q/k/v heads (graphserve/models' GQA layers); latent and compressed attention differ
GQA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")
DT = torch.bfloat16
DEVICE = torch.device("cuda")  # the CPU test of the sweep's logic swaps in the CPU, and fakes the timings


def dense_shapes(model: str) -> dict[str, tuple[int, int]]:
    """The dense projections (N, K) an FP4 checkpoint of preset ``model`` runs through the dense GEMM at tp 1: the
    fused q/k/v and the output projection, and, without routed experts, the fused gate/up and down. Empty for a
    family whose attention is not q/k/v heads."""
    from graphserve.models.presets import PRESETS

    c = PRESETS.get(model.removeprefix("dummy:"), {}).get("config", {})
    if c.get("model_type") not in GQA_TYPES:
        return {}
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    kv, hd = int(c.get("num_key_value_heads") or heads), int(c.get("head_dim") or hidden // heads)
    shapes = {"qkv": ((heads + 2 * kv) * hd, hidden), "o": (hidden, heads * hd)}
    if not any(c.get(key) for key in ("num_local_experts", "num_experts", "n_routed_experts")):
        inter = int(c["intermediate_size"])
        shapes |= {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    return shapes


def candidates(variant: str, m: int, n: int, k: int, group: int, sms: int, quick: bool) -> list[Fp4GemmConfig]:
    """``variant``'s tiles for an ``m``-row GEMM on (N, K): the card's default first, then those of ``SPACE`` that can
    run (a K step no deeper than K's power of two, a split that cuts K at all); past 256 rows also at 64 rows a tile,
    and the bf16 variant at 33 to 64 rows also at 32 (x first). "dequant" and "dequant_fp8" from DEQUANT_ROWS only."""
    from graphserve.kernels.fp4_gemm import k_split

    if variant in ("dequant", "dequant_fp8") and m < DEQUANT_ROWS:
        return []
    first = default_config(variant, m, n, k, group, sms)
    try:
        first.check("candidate", variant, group, k)
    except ValueError:  # the fp8 variant where 32 does not divide K
        return []
    out = [first]
    deepest = max(group, 1 << max(0, k - 1).bit_length())
    bms = [first.block_m]
    if first.block_m > 64 and variant not in ("dequant", "dequant_fp8"):
        bms.append(64)
    if first.block_m == 64 and m <= 64 and variant == "bf16":
        bms.append(32)  # x the MMA's first operand in two row tiles, the widening done twice
    for bm in bms:
        for bn, bk, warps, stages, split in SPACE[(variant, m > 64)]:
            cfg = Fp4GemmConfig(bm, bn, bk, first.group_m, warps, stages, split)
            try:
                cfg.check("candidate", variant, group, k)
            except ValueError:
                continue
            if bk > deepest or (split > 1 and k_split(cfg, k) >= k) or cfg in out:
                continue
            out.append(cfg)
    return out[:QUICK_CANDIDATES if quick else len(out)]


def measure_projection(model: str, proj: str, budget_s: float, quick: bool, sms: int, card: str) -> list[dict]:
    """One projection's rows: per row count and format the streaming kernel (up to 64 rows) and each variant at its
    best tile (``tile``: its JSON, ``default_ms``: the default tile's time, ``tiles``: every candidate's), in ``ROWS``
    order until ``budget_s`` is spent (one row count at most past it). Times in ms (inf: did not run)."""
    from graphserve.kernels.fp4_gemm import fp4_gemm
    from graphserve.kernels.fp4_gemv import fp4_gemv
    from graphserve.tuning import fp4 as bench

    n, k = dense_shapes(model)[proj]
    start = time.monotonic()
    weights = {fmt: bench.fp4_weights(n, k, fmt, bench.copies_for(bench.fp4_bytes(n, k, fmt))) for fmt in FORMATS}
    # "dequant_fp8" reads each weight's row scales, made once at load as the layers make them (none: not timed here)
    variants = [v for v in VARIANTS if v != "dequant_fp8" or fp8_tensor_cores(DEVICE)]
    row_scales = {fmt: [fp8_row_scales(p, s, fmt) for p, s, _ in ws] for fmt, ws in weights.items()} \
        if "dequant_fp8" in variants else {}
    rows: list[dict] = []
    for m in QUICK_ROWS if quick else ROWS:
        if rows and time.monotonic() - start > budget_s:
            print(f"{model} {proj}: time share {budget_s:.0f} s spent: rows from {m} left out", flush=True)
            break
        x = torch.randn(m, k, device=DEVICE, dtype=DT)
        for fmt, ws in weights.items():
            base = {"card": card, "model": model.removeprefix("dummy:"), "proj": proj, "n": n, "k": k, "m": m,
                    "fmt": fmt}  # fmt: skip
            if m <= STREAM_MAX_ROWS:
                ms = bench.graph_ms([partial(fp4_gemv, x, p, s, g, fmt) for p, s, g in ws])
                rows.append({**base, "kernel": "fp4 stream", "ms": ms})
            if m < MIN_GEMM_ROWS:
                continue
            copies = ws[: 2 if m >= 1024 else len(ws)]
            for variant in variants:
                timed = []
                extra = [{"fp8_row_scale": rs} for rs in row_scales[fmt]] if variant == "dequant_fp8" else [{}] * len(ws)
                for cfg in candidates(variant, m, n, k, GROUP[fmt], sms, quick):
                    calls = [partial(fp4_gemm, x, p, s, g, fmt, variant=variant, config=cfg, **kw)
                             for (p, s, g), kw in zip(copies, extra)]  # fmt: skip
                    timed.append((bench.graph_ms(calls), Fp4GemmTile(variant, cfg)))
                if not timed:
                    continue
                ms, tile = min(timed, key=lambda t: t[0])
                rows.append({**base, "kernel": f"fp4 gemm {variant}", "ms": ms, "tile": tile.to_json(),
                             "default_ms": timed[0][0], "tiles": {t.short(): v for v, t in timed}})  # fmt: skip
        best = {r["kernel"] + " " + r["fmt"]: r["ms"] for r in rows if r["m"] == m}
        print(f"{model} {proj} m={m}: " + ", ".join(f"{key} {v:.4f} ms" for key, v in best.items()), flush=True)
    del weights, row_scales
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def entry_from_rows(rows: list[dict]) -> Fp4GemmShapeTiles | None:
    """One weight shape's buckets: per measured row count the fastest tile of either variant (None: no GEMM ran)."""
    best: dict[int, tuple[float, dict]] = {}
    for r in rows:
        if r["kernel"].startswith("fp4 gemm") and r["ms"] < best.get(r["m"], (float("inf"),))[0]:
            best[r["m"]] = (r["ms"], r["tile"])
    if not best:
        return None
    buckets = tuple(sorted(best))
    return Fp4GemmShapeTiles(buckets, tuple(Fp4GemmTile.from_json(best[b][1]) for b in buckets))


def table_from(rows: list[dict], earlier: dict | None, card: str) -> dict | None:
    """``fp4_gemm_tiles.json``: the shapes measured in ``rows`` over ``earlier``'s others; None where no GEMM ran."""
    shapes = {(s["fmt"], s["n"], s["k"]): s for s in (earlier or {}).get("shapes", [])}
    measured = False
    for key in dict.fromkeys((r["fmt"], r["n"], r["k"]) for r in rows):
        mine = [r for r in rows if (r["fmt"], r["n"], r["k"]) == key]
        entry = entry_from_rows(mine)
        if entry is None:
            continue
        data = shape_entry(key, entry)
        data["measurements"] = [{k: None if v == float("inf") else v for k, v in r.items() if k != "tile"}
                                for r in mine]  # inf: did not run  # fmt: skip
        shapes[key] = data
        measured = True
    if not measured:
        return None
    table = {"device": card, "source": "graphserve tune --tables fp4 (graphserve/tuning/fp4_gemm.py)",
             "shapes": list(shapes.values())}  # fmt: skip
    Fp4GemmTable.from_json(table)  # what the engine will read back: refused here rather than passed over there
    return table


def bench_rows(rows: list[dict], floor_ms) -> list[dict]:
    """Per measured row: ms, GB/s of the kernel's fewest bytes (weight, scales, x and the output once), TFLOP/s and the
    ratio to the read floor (``floor_ms(bytes)``, the same run's probe); the GEMM rows also at their default tile."""
    from graphserve.tuning.fp4 import fp4_bytes

    out = []
    for r in rows:
        nbytes = fp4_bytes(r["n"], r["k"], r["fmt"]) + r["m"] * r["k"] * 2 + r["m"] * r["n"] * 2
        kinds = [(r["kernel"], r["ms"])]
        if "default_ms" in r:
            kinds = [(r["kernel"] + " default tile", r["default_ms"]), (r["kernel"] + " best tile", r["ms"])]
        for kernel, ms in kinds:
            if ms == float("inf"):
                continue
            out.append({"model": r["model"], "proj": r["proj"], "fmt": r["fmt"], "m": r["m"], "kernel": kernel,
                        "tile": Fp4GemmTile.from_json(r["tile"]).short() if "best" in kernel else "", "ms": ms,
                        "gbs": nbytes / ms / 1e6, "tflops": 2 * r["m"] * r["n"] * r["k"] / ms / 1e9,
                        "ratio": ms / floor_ms(nbytes)})  # fmt: skip
    return out

