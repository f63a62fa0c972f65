"""The gated FP8 MLP at decode rows: gate_up's epilogue computing silu·up and writing it quantized for down
(kernels/fp8_gemv.fp8_gate_up_a8) against the launches the engine runs without it, and the table entries
(graphserve/kernels/fp8_rule.json, ``mlps``) written from what was measured.

Per scale kind (``--scales channel``: ``--quantization fp8``'s dense projections; ``block128``: the shipped
checkpoints and ``fp8-block``) and row count m, on Llama-3-8B's MLP (4096 -> 2 x 14336 -> 4096):
- ``unfused_us``: the post-attention norm and the MLP as layers/linear.norm_mlp runs them without a pair in the
  table (norm_linear, then silu_mul_linear, through real fp8 ``Linear`` layers on their table routes): the norm
  in gate_up's input quantization, gate_up's [M, 2N] output written, SiLU·mul in down's input quantization;
- ``gated_us``: the norm's quantization launch, a gated gate_up tile (``block_n / 2`` gate rows and as many up
  rows a program; silu·up quantized in groups of ``block_n / 2`` columns) and a down tile whose K step is that
  group, every pair run by the engine's own code (layers/quant/fp8.norm_mlp_with): the gate_up tiles swept with
  the first down tile of their group, then the down tiles with the fastest gate_up tile (the result files of
  43d5c33 and 2a30f0a timed gate_up's launches and down's apart in the sweeps, the best pair together);
- ``unfused_error``, ``gated_error``: each path's output against the MLP in fp32 on the dequantized weights (both
  quantize the activations, in different groups: per token for per-channel down, down's K step for the pair);
- ``engine_us``: norm_mlp after the table is rewritten, the path the engine takes (the pair where it won).
Every pair's output is checked against that fp32 MLP before it is timed. Each time is one call's share of a CUDA graph of back-to-back calls cycling through copies of the MLP's weights (over 256 MB in all), so every
call reads its weights from device memory as decode does; ``/floor``: over the two weights' bytes (fp8 + scales)
at the best read bandwidth of this run.
Run: python3 -m benchmarks.fp8_gated_mlp [--scales channel|block128] [--rows M ...] [--no-rule | --rule-from RESULT]
(writes benchmarks/results/fp8_gated_mlp[_block128].json and the table's ``mlps`` entries for what it measured)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from pathlib import Path

import torch

from benchmarks.common import environment, print_table, write_result
from benchmarks.kernels import graph_time_ms
from benchmarks.roofline import measured_read_bw
from graphserve.kernels import fp8_config
from graphserve.kernels.fp8_config import RULE_PATH, GatedMlp, StreamConfig
from graphserve.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    norm_linear,
    norm_mlp,
    silu_mul_linear,
)
from graphserve.layers.norm import RMSNorm
from graphserve.layers.quant.config import Fp8Config
from graphserve.layers.quant.fp8 import Fp8LinearMethod

HIDDEN, INTER = 4096, 14336
NAME = "llama3-8b mlp"
ROWS = [1, 2, 4, 8, 16, 32, 64]  # every count the table routes by up to the streaming limit: below the first
# measured count a call would take its pair unmeasured
COLD_BYTES = 256 << 20
# gated gate_up tiles swept, (block_n, warps, split_k): 64 or 128 output columns a program (half the rows), one
# 128-column K step, three stages
GATE_UP_TILES = ((128, 4, 1), (128, 8, 1), (128, 4, 2), (256, 8, 1), (256, 8, 2), (256, 4, 1))
# down tiles swept for a K step of one group, (block_n, split_k, stages), four warps
DOWN_TILES = ((64, 2, 3), (64, 4, 3), (32, 4, 3), (64, 2, 4), (128, 2, 3))
# a pair is kept where it took at most this share of the unfused launches' time: the same row measured in two runs
# moved by up to 1.5% (block128, 64 rows: the pair 1.010 and 0.985 of the unfused), so a smaller win is not one
MARGIN = 0.98
COLS = ["scales", "m", "unfused_us", "gated_us", "engine_us", "gated/unfused", "unfused/floor", "gated/floor",
        "unfused_error", "gated_error",
        "gate_up_tile", "down_tile"]


def gated_tile(block_n: int, warps: int, split: int) -> StreamConfig:
    return StreamConfig(block_n, 128, num_warps=warps, num_stages=3, use_dot=True, split_k=split, fp8_dot=True, a8=True)


def down_tile(group: int, block_n: int, split: int, stages: int) -> StreamConfig:
    return StreamConfig(block_n, group, num_warps=4, num_stages=stages, use_dot=True, split_k=split, fp8_dot=True,
                        a8=True)


def label(c: StreamConfig) -> str:
    return f"{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} split{c.split_k}"


class ColdMlps:
    """Copies of the MLP (fp8 gate_up and down layers, quantized at load as the engine does), enough that
    back-to-back calls never find theirs in L2."""

    def __init__(self, block: tuple[int, int] | None) -> None:
        self.config = Fp8Config(block=block, serialized=False)
        copies = max(2, math.ceil(COLD_BYTES / (3 * HIDDEN * INTER)))
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.layers = []
        for _ in range(copies):
            with torch.device("cuda"):
                gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], False)
                down = RowParallelLinear(INTER, HIDDEN, False)
            for layer in (gate_up, down):
                method = Fp8LinearMethod(self.config)
                method.create_weights(layer)
                method.init_random(layer, torch.bfloat16, gen)
            self.layers.append((gate_up, down))
        gate_up, down = self.layers[0]
        self.nbytes = sum(t.numel() * t.element_size() for layer in (gate_up, down)
                          for t in (layer.weight, layer.quant_method.scale(layer)))

    def time_us(self, fn) -> float:
        """Microseconds per ``fn(gate_up, down)``, each call on the next copy."""
        step = itertools.count()
        return graph_time_ms(lambda: fn(*self.layers[next(step) % len(self.layers)]),
                             calls=max(20, len(self.layers))) * 1e3


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    """The gated MLP's relative error against the MLP on the dequantized weights with unquantized activations,
    refused past 5e-2: what its two activation quantizations cost (x in gate_up's groups, silu·up in groups of
    down's K step: e4m3 rounds each element to 2^-4 relative, ~2e-2 normwise each); a wrong scale or a missed
    tile is off by order 1."""
    err = ((got - want).norm() / want.norm()).item()
    if not err <= 5e-2:
        raise AssertionError(f"gated MLP {what} is off the dequantized MLP by {err:.3g}")
    return err


def exact_mlp(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, gate_up, down) -> torch.Tensor:
    """The MLP in fp32 on the dequantized weights, its input the bf16 norm the kernels quantize."""
    h = norm(x, residual.clone())[0].float()
    gu = h @ gate_up.quant_method.dequantized_weight(gate_up, torch.float32).T
    act = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
    return act @ down.quant_method.dequantized_weight(down, torch.float32).T


def measure_row(cold: ColdMlps, m: int) -> tuple[dict, object]:
    """One row count's times and errors, and the engine's call (``norm_mlp``) for timing after the table is written."""
    norm = RMSNorm(HIDDEN, 1e-5).cuda().to(torch.bfloat16)
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)

    def unfused(gate_up, down):
        h, _ = norm_linear(norm, x, residual, gate_up)
        return silu_mul_linear(h, down)

    def gated(gate_up, down, tiles: GatedMlp):  # the engine's fused path on these tiles
        return gate_up.quant_method.norm_mlp_with(tiles, gate_up, norm, x, residual, down)[0]

    def sweep(candidates: list[GatedMlp], what: str) -> dict[GatedMlp, float]:
        """Each pair checked against the fp32 MLP, then timed; a pair this card or these scales cannot take (shared
        memory, a K step off the scale block) is skipped, said so."""
        times = {}
        for tiles in candidates:
            try:
                got = gated(*cold.layers[0], tiles).float()
            except Exception as e:
                print(f"  m={m} skip {what} {label(getattr(tiles, what))}: {type(e).__name__}: {str(e)[:80]}")
                continue
            check(got, want, f"m={m} {label(tiles.gate_up)} + {label(tiles.down)}")
            times[tiles] = cold.time_us(lambda g, d, t=tiles: gated(g, d, t))
        return times

    r = {"shape": NAME, "scales": "block128" if cold.config.block else "channel", "hidden": HIDDEN,
         "intermediate": INTER, "m": m, "weight_bytes": cold.nbytes, "unfused_us": cold.time_us(unfused)}
    want = exact_mlp(x, residual, norm, *cold.layers[0])
    r["unfused_error"] = check(unfused(*cold.layers[0]).float(), want, f"m={m} unfused")
    # gate_up tiles, each with the first down tile of its group; then down tiles with the fastest gate_up
    gate_up_us = sweep([GatedMlp(gated_tile(bn, warps, split), down_tile(bn // 2, *DOWN_TILES[0]))
                        for bn, warps, split in GATE_UP_TILES], "gate_up")
    best_gate_up = min(gate_up_us, key=gate_up_us.get).gate_up
    down_us = sweep([GatedMlp(best_gate_up, down_tile(best_gate_up.block_n // 2, *t)) for t in DOWN_TILES], "down")
    best = min(down_us, key=down_us.get)
    r["gated_error"] = check(gated(*cold.layers[0], best).float(), want, f"m={m} pair")
    r["gated_us"] = down_us[best]
    r.update({"gated/unfused": r["gated_us"] / r["unfused_us"], "gate_up_tile": label(best.gate_up),
              "down_tile": label(best.down), "pair": best.to_json(),
              "gate_up_tiles": [{"tile": label(t.gate_up), "us": us} for t, us in gate_up_us.items()],
              "down_tiles": [{"tile": label(t.down), "us": us} for t, us in down_us.items()]})
    print(f"  m={m}: unfused {r['unfused_us']:.2f} us; pairs by gate_up "
          + "; ".join(f"{label(t.gate_up)} {us:.2f}" for t, us in gate_up_us.items())
          + "; by down " + "; ".join(f"{label(t.down)} {us:.2f}" for t, us in down_us.items()))
    return r, lambda g, d: norm_mlp(norm, x, residual, g, d)[0]


def table_with(rows: list[dict], env: dict, earlier: dict) -> dict:
    """The routing table with this run's ``mlps`` rows: the pair where it beat the unfused launches by ``MARGIN``,
    else null; the table's other entries (and its other row counts) as they were."""
    stamp = {"commit": env.get("commit"), "date": env.get("date")}
    mlps = {(e["name"], e["scales"]): e for e in earlier.get("mlps", [])}
    for r in rows:
        key = (r["shape"], r["scales"])
        entry = mlps.setdefault(key, {"name": r["shape"], "hidden": r["hidden"], "intermediate": r["intermediate"],
                                      "scales": r["scales"], "rows": []})
        won = r["gated_us"] < MARGIN * r["unfused_us"]
        by_m = {e["m"]: e for e in entry["rows"]}
        by_m[r["m"]] = {"m": r["m"], **(r["pair"] if won else {"gate_up": None, "down": None}), "measured_at": stamp}
        entry["rows"] = [by_m[m] for m in sorted(by_m)]
    return {**earlier, "mlps": list(mlps.values())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scales", choices=("channel", "block128"), default="channel",
                   help="the weights' scales: one per output channel (--quantization fp8), or 128x128 blocks")
    p.add_argument("--rows", nargs="+", type=int, default=ROWS, metavar="M")
    p.add_argument("--no-rule", action="store_true", help="measure and print, but leave fp8_rule.json as it is")
    p.add_argument("--rule-from", type=Path, metavar="RESULT_JSON",
                   help="measure nothing: write the table's entries from the rows of an earlier run's results file")
    args = p.parse_args()
    if args.rule_from:
        result = json.loads(args.rule_from.read_text())
        rule = table_with(result["rows"], result["environment"], json.loads(RULE_PATH.read_text()))
        RULE_PATH.write_text(json.dumps(rule, indent=1) + "\n")
        print(f"gated MLP entries of {args.rule_from} ({result['environment'].get('commit')}) written to {RULE_PATH}")
        return
    if not all(1 <= m <= fp8_config.MAX_STREAM_ROWS for m in args.rows):
        p.error(f"--rows {args.rows}: each must be in 1..{fp8_config.MAX_STREAM_ROWS} (the streaming kernel's rows)")
    bw = measured_read_bw()
    cold = ColdMlps((128, 128) if args.scales == "block128" else None)
    with torch.no_grad():
        rows, engine = zip(*(measure_row(cold, m) for m in args.rows))
        env = environment()
        if not args.no_rule:
            rule = table_with(rows, env, json.loads(RULE_PATH.read_text()))
            text = json.dumps(rule, indent=1) + "\n"
            RULE_PATH.write_text(text)
            if os.environ.get("OUT"):  # a copy that comes back from a remote GPU run, as write_result's
                Path(os.environ["OUT"], RULE_PATH.name).write_text(text)
            fp8_config.load_rule.cache_clear()
            fp8_config.rule_for.cache_clear()
        for r, call in zip(rows, engine):
            r["engine_us"] = cold.time_us(call)
            floor_us = bw.floor_ms(r["weight_bytes"]) * 1e3
            r.update({"unfused/floor": r["unfused_us"] / floor_us, "gated/floor": r["gated_us"] / floor_us,
                      "floor_us": floor_us})
    print(f"\nfloor: {bw.describe()}")
    print_table(rows, COLS)
    write_result("fp8_gated_mlp" + ("" if args.scales == "channel" else "_block128"),
                 {"read": bw.summary(), "rows": list(rows), "rule_written": not args.no_rule})


if __name__ == "__main__":
    main()
