"""FP8-weight projections by row count: the streaming W8A16 gemv, the W8A8 paths and bf16, and the
routing table layers/quant/fp8.py reads (graphserve/kernels/fp8_rule.json), written from what was measured.

Per projection shape (Llama-3-8B's by default; Qwen3-30B-A3B's dense attention with ``--shapes``; the
table keeps an earlier run's shapes that this one did not measure) and row count m, with 128x128 block
scales (``--scales block128``, as the shipped checkpoints and ``--quantization fp8-block`` store them) or
one scale per output channel (``--scales channel``, as ``--quantization fp8`` and ``fp8-channel`` store dense
projections; x is then quantized per token: one scale a row):
- ``stream``: kernels/fp8_gemv.py (m <= 64), its default tiles and, with ``--sweep`` (the default
  unless ``--quick``), a grid of alternatives, among them ``a8`` tiles reading x quantized by the launch
  before: the best is what the table keeps;
- ``w8a8``: per-token-group activation quantization + the Triton block-scaled GEMM (per channel: per-token
  quantization + ``torch._scaled_mm``'s rowwise cuBLASLt GEMM, as the layer runs it);
- ``scaled_mm``: the same quantization (padded, column-major scales) + ``torch._scaled_mm``'s
  block-scaled cuBLASLt GEMM, where this build has it;
- ``bf16``: F.linear on the bf16 weight, for reference (an fp8 layer has no bf16 weight to route to).
Each path is timed as the layer runs it, launch for launch, with the making of its input (the RMSNorm
before qkv and gate_up, SiLU·mul before down): in the streaming kernel's loads at the rows where it
computes them (layers/quant/fp8.py's limits), in the input's quantization launch for the paths that
quantize it (a8 stream tiles, ``w8a8``, ``scaled_mm``), else in a separate launch before. Each
time is one call's share of a CUDA graph of back-to-back calls cycling through enough weight copies (>= 256 MB) that every call reads
its weight from device memory, as decode does. ``stream/floor``: the stream time over the weight's
bytes (fp8 + scales) at the best read bandwidth of this run: benchmarks.roofline's probes, run again after the
work, and every rate this run's own calls reached (``observe_rows``: a path that read its weights faster than the
probes raises the floor). ``read_us``: a bare read of the same weight's bytes in the same graph, launch for launch
(``bare_read_us``); ``stream/read`` what the streaming kernel takes over it. Each row names the floor it was divided
by (``floor_gbs``, ``floor_method``).

o_proj's input comes from decode attention, which writes it already quantized where o_proj's path quantizes its
input (layers/quant/fp8.py ``input_quant``; layers/attention_triton.py ``attend_quantized``): per channel one scale a
row (group k), with 128x128 blocks one a head (``HEAD_DIM``). Its a8 tiles and its ``w8a8`` path are therefore timed
on x quantized once so, outside the timed calls (``attention_group``); the row says so (``quantized_input``:
"attention", ``quantized_input_group``; else "launch": the quantization is inside the timed call).
Per (shape, m) the table keeps the fastest fp8 path (and the stream tiles that won); a call of m rows
takes the entry of the smallest measured count >= m, above the largest the code's defaults.
Run: python3 -m benchmarks.fp8_route [--quick] [--scales block128|channel] [--shapes NAME ...] [--rows M ...]
(writes benchmarks/results/fp8_route.json, or fp8_route_channel.json, and graphserve/kernels/fp8_rule.json)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from graphserve.kernels import tables
from graphserve.kernels.common import sm_count
from graphserve.kernels.fp8_config import (
    MAX_STREAM_ROWS,
    RULE_PATH,
    Route,
    StreamConfig,
    default_route,
    default_stream_config,
    tile_cap,
)
from graphserve.kernels.fp8_gemm import (
    blockwise_scale_layout,
    blockwise_scaled_mm_available,
    scaled_mm_blockwise,
    scaled_mm_rowwise,
    scaled_mm_supported,
    w8a8_matmul,
)
from graphserve.kernels.fp8_gemv import fp8_gemv, fp8_gemv_a8, fp8_norm_gemv, fp8_silu_mul_gemv
from graphserve.kernels.fp8_quant import (
    norm_group_quant,
    per_token_group_quant,
    quantize_weight_blocks,
    quantize_weight_channels,
    silu_mul_group_quant,
)
from graphserve.kernels.norm import fused_add_rms_norm
from graphserve.layers.activation import silu_and_mul
from graphserve.layers.attention_triton import output_scale_groups
from graphserve.layers.quant.fp8 import NORM_PROLOGUE_MAX_ROWS, SILU_PROLOGUE_MAX_ROWS
from graphserve.tuning.roofline import BLOCK_GRID, measured_read_bw, stream_programs, wide_view
from graphserve.tuning.timing import environment, graph_time_ms, print_table

SHAPES = {
    "llama3-8b qkv": (6144, 4096),
    "llama3-8b o_proj": (4096, 4096),
    "llama3-8b gate_up": (28672, 4096),
    "llama3-8b down": (4096, 14336),
    "qwen3-30b-a3b qkv": (5120, 2048),
    "qwen3-30b-a3b o_proj": (2048, 4096),
}
DEFAULT_SHAPES = [name for name in SHAPES if name.startswith("llama3-8b")]
PROLOGUES = {"qkv": "norm", "gate_up": "norm", "down": "silu"}  # by projection: what precedes it in a layer
HEAD_DIM = 128  # both models' head size: the group of decode attention's quantized output with 128x128 blocks
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048]
QUICK_ROWS = [1, 2, 4, 8, 16, 64, 256]
COLD_BYTES = 256 << 20
BLOCK = 128
COLS = ["shape", "m", "prologue", "stream_us", "w8a8_us", "scaled_mm_us", "bf16_us", "best", "stream_a8_us",
        "stream_bf16x_us", "quantized_input", "stream/floor", "stream_GBps", "read_us", "stream/read"]


# FMA tiles swept at 1-4 rows: (block_n, weight bytes a thread a step, split_k, warps, stages). The first five
# are the tiles the table was first measured over (4 warps, 2 stages); the others add eight- and two-warp
# programs, deeper pipelines of smaller steps, and 4-way splits for tall K.
FMA_TILES = ((8, 128, 1, 4, 2), (8, 256, 1, 4, 2), (16, 128, 1, 4, 2), (8, 128, 2, 4, 2), (16, 128, 2, 4, 2),
             (8, 64, 1, 4, 4), (16, 64, 1, 4, 4), (8, 64, 2, 4, 4), (8, 128, 1, 4, 3), (16, 128, 1, 4, 3),
             (16, 128, 1, 8, 2), (32, 128, 1, 8, 2), (16, 256, 1, 8, 2), (16, 128, 2, 8, 2), (32, 128, 2, 8, 2),
             (4, 128, 1, 2, 2), (8, 128, 1, 2, 2), (16, 128, 4, 4, 2))


# Per-channel a8 tiles with K steps past one 128-column block, (rows, K step, FP8 dot) -> the stage counts swept,
# where a stage holds (rows + up to 64 rows of x) x step bytes (three of 64x512: 192 KB of an H200's 227 KB; a tile
# that does not fit is skipped by the sweep, said so). 64x256 also four and five deep: at 64 rows of x o_proj and
# down ran one 64x512 program an SM at 32% and 59% of DRAM's peak (benchmarks/results/ncu_kernels.json), and five stages
# of 64x256 keep more of the weight in flight in less shared memory (160 KB).
WIDE_STEP_TILES = {(64, 256, True): (2, 3, 4, 5), (128, 256, True): (2, 3), (64, 512, True): (2, 3)}



def fma_config(block_n: int, per_thread: int, split_k: int, warps: int, stages: int) -> StreamConfig:
    """The FMA tile an ``FMA_TILES`` entry names: its step ``block_k`` from the weight bytes a thread loads."""
    return StreamConfig(block_n, per_thread * 32 * warps // block_n, num_warps=warps, num_stages=stages,
                        use_dot=False, split_k=split_k)


def power_of_two_grid(programs: int, split: int, sms: int) -> bool:
    """A power-of-two split giving every SM one to four programs."""
    return split & (split - 1) == 0 and sms <= programs <= 4 * sms


def even_waves(programs: int, sms: int) -> bool:
    """A grid filling 3/4 to all of one wave, or of two, of one program an SM: a grid just past a wave (160
    programs on 132 SMs) leaves the SMs holding two programs to finish last; a whole number of waves does not."""
    return any(0.75 * waves * sms <= programs <= waves * sms for waves in (1, 2))


def candidates(m: int, n: int, k: int, sms: int, channel: bool = False) -> list[StreamConfig]:
    """Stream tiles to try at ``m`` rows of an [n, k] weight.

    - m <= 4: FMA tiles (``FMA_TILES``): 4-32 rows, 64-256 weight bytes a thread, 2-8 warps, 2-4 stages,
      whole or split 2 and 4 ways along K;
    - 2 <= m <= 16: dot tiles 16-64 rows tall, whole or split 2 and 4 ways;
    - m > 16 (the dot path only): tiles of 64 and 128 rows (x is read again by every program, so taller
      tiles read it fewer times), 128 or 256 columns a step, split so the grid gives every SM one to four
      programs, or (FP8 dot, x quantized before) into any count that fills one or two waves evenly
      (``even_waves``);
    - m > 4: the FP8 dot in tiles of 32-128 rows (256 above 16 rows), one 128-column scale block a step,
      split likewise; each tile twice: x quantized in the kernel, and x quantized by the launch before (a8),
      the a8 tiles above 16 rows in three and four pipeline stages;
    - m > 16 with per-channel scales (``channel``): a8 tiles of 64 and 128 rows also 256 and 512 columns a
      step. x then comes quantized per token, so no scale varies along K and the step is free of the scale
      block (kernels/fp8_gemv.py's X_TOKEN): a wider step puts more bytes in flight a program.
    Every split keeps at least two tiles of K; each distinct tile is one more compile."""
    out = []
    if m <= 4:
        for cfg in (fma_config(*entry) for entry in FMA_TILES):
            bk, split = cfg.block_k, cfg.split_k
            if bk * (2 * split if split > 1 else 1) <= k and k % bk == 0:
                out.append(cfg)
    if 2 <= m <= 16:
        for bn, bk, split in ((16, 256, 1), (32, 256, 1), (64, 256, 1), (32, 256, 2), (32, 256, 4), (64, 256, 2),
                              (64, 128, 4)):
            if k % bk == 0 and bk * (2 * split if split > 1 else 1) <= k:
                out.append(StreamConfig(bn, bk, num_warps=4, num_stages=3, use_dot=True, split_k=split))
    if m > 4:
        block_m = max(16, triton.next_power_of_2(m))
        tiles = ((32, 128, True), (64, 128, True), (128, 128, True)) if m <= 16 else ()
        if m > 16:
            tiles = ((64, 128, False), (128, 128, False), (128, 256, False), (64, 128, True), (128, 128, True),
                     (256, 128, True))
            if channel:
                tiles += tuple(WIDE_STEP_TILES)
        for bn, bk, fp8 in tiles:
            for split in range(1, 17):
                programs, steps = triton.cdiv(n, bn) * split, k // bk
                if k % bk or bk * (2 * split if split > 1 else 1) > k or triton.cdiv(steps, triton.cdiv(steps, split)) != split:
                    continue  # every split two or more K steps, and the launch runs this many (tile_constants)
                pow2 = power_of_two_grid(programs, split, sms)
                if not pow2 and not (fp8 and m > 16 and even_waves(programs, sms)):
                    continue
                # FP8-dot tiles of 64-128 rows at 64 rows of x also in 4 warps: twice the registers a thread (no
                # spill on sm_90 up to 128 rows), and ptxas's occupancy (benchmarks/kernel_ptxas.py) may then fit
                # two programs an SM where 8 warps fit one
                big = bn * block_m >= 64 * 64
                warps = (8, 4) if big and fp8 and m > 32 and bn <= 128 else (8 if big else 4,)
                # a8 tiles above 16 rows also with a fourth stage: one more weight and x step in flight
                wide = WIDE_STEP_TILES.get((bn, bk, fp8))
                a8_forms = (True,) if wide or (fp8 and not pow2) else (False, True) if fp8 else (False,)
                forms = [(a8, stages) for a8 in a8_forms
                         for stages in (wide or ((3, 4) if a8 and m > 16 else (3,)))]
                out += [StreamConfig(bn, bk, num_warps=w, num_stages=stages, use_dot=True, split_k=split, fp8_dot=fp8,
                                     a8=a8) for w in warps for a8, stages in forms]
    return out


class ColdWeights:
    """Copies of one projection's weight (fp8 + block scales + cuBLASLt's scale layout, or fp8 + per-channel
    scales [n, 1], and bf16), enough that back-to-back calls never find theirs in L2."""

    def __init__(self, n: int, k: int, channel: bool = False) -> None:
        copies = max(2, math.ceil(COLD_BYTES / (n * k)))
        self.fp8 = []
        for _ in range(copies):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            if channel:
                wq, ws = quantize_weight_channels(w)
                self.fp8.append((wq, ws.view(n, 1), None))
            else:
                wq, ws = quantize_weight_blocks(w, BLOCK, BLOCK)
                self.fp8.append((wq, ws, blockwise_scale_layout(ws)))
        self.bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                     for _ in range(max(2, math.ceil(COLD_BYTES / (2 * n * k))))]
        self.nbytes = n * k + self.fp8[0][1].numel() * 4

    def time_us(self, fn, bf16: bool = False) -> float:
        """Microseconds per ``fn(weight)``, each call on the next cold copy."""
        pool = self.bf16 if bf16 else self.fp8
        step = itertools.count()
        return graph_time_ms(lambda: fn(pool[next(step) % len(pool)]), calls=max(20, len(pool))) * 1e3


def tile_label(c: StreamConfig) -> str:
    """A stream tile as the sweep prints it: rows x columns a step, warps, stages, splits, and its inner product."""
    return (f"{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} split{c.split_k}"
            f"{' dot' if c.use_dot else ''}{' fp8' if c.fp8_dot else ''}{' a8' if c.a8 else ''}")


def prologue(name: str, m: int) -> str | None:
    """What the model computes right before this projection inside the streaming kernel at ``m`` rows
    (layers/quant/fp8.py's limits): "norm" (residual add + RMSNorm: qkv, gate_up), "silu" (down), or None."""
    kind = PROLOGUES.get(name.split()[-1])
    if kind == "norm" and m <= NORM_PROLOGUE_MAX_ROWS or kind == "silu" and m <= SILU_PROLOGUE_MAX_ROWS:
        return kind
    return None


def attention_group(name: str, channel: bool, m: int, k: int) -> int | None:
    """The group in which decode attention writes this projection's input already quantized at ``m`` rows, for a
    path that quantizes its input: o_proj's per channel one scale a row (group ``k``), with 128x128 blocks one a head
    (``HEAD_DIM``), where the attention kernel takes that group (layers/attention_triton.output_scale_groups, the rule
    ``attend_quantized`` applies). None for every other projection (its input comes from a norm or SiLU·mul,
    quantized by the launch that makes it) and where the kernel takes no such group."""
    if not name.endswith("o_proj"):
        return None
    group = k if channel else HEAD_DIM
    return group if output_scale_groups(k // HEAD_DIM, HEAD_DIM, group, m) is not None else None


def measure_row(name: str, m: int, cold: ColdWeights, sweep: bool, scaled_mm_ok: bool, sms: int,
                channel: bool = False) -> dict:
    n, k = SHAPES[name]
    gn, gk = (1, k) if channel else (BLOCK, BLOCK)  # the kernels' scale block: per channel, one row by all of K
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    r = {"shape": name, "scales": "channel" if channel else "block128", "n": n, "k": k, "m": m,
         "weight_bytes": cold.nbytes, "pool": len(cold.fp8), "bf16_pool": len(cold.bf16)}
    # o_proj's input as decode attention writes it, quantized once here, outside every timed call
    fed = attention_group(name, channel, m, k)
    r["quantized_input"], r["quantized_input_group"] = ("attention", fed) if fed else ("launch", None)
    attention_written = per_token_group_quant(x, fed) if fed else None
    # every path is timed with the making of its input, as the layer runs it: the norm before qkv and
    # gate_up, SiLU·mul before down, in the streaming kernel's loads (at the rows where it computes them,
    # r["prologue"]), in the launch that quantizes the input (a8 tiles, w8a8, scaled_mm; o_proj's excepted where
    # the attention kernel writes it quantized: attention_written), or else in a separate launch
    kind = PROLOGUES.get(name.split()[-1])
    r["prologue"] = prologue(name, m)
    residual = torch.randn_like(x) if kind == "norm" else None
    norm_w = torch.randn(k, device="cuda", dtype=torch.bfloat16) if kind == "norm" else None
    gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16) if kind == "silu" else None

    def made() -> torch.Tensor:
        if kind == "norm":
            return fused_add_rms_norm(x, residual, norm_w, 1e-6)[0]
        return silu_and_mul(gate_up) if kind == "silu" else x

    def quantized(group: int, blockwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if group == fed and not blockwise:  # written by the attention kernel before the call: no launch to time
            return attention_written
        layout = {"pad_rows_to": 4 if blockwise else 1, "scales_column_major": blockwise}
        if kind == "norm":
            return norm_group_quant(x, norm_w, 1e-6, group, residual, **layout)[:2]
        if kind == "silu":
            return silu_mul_group_quant(gate_up, group, **layout)
        return per_token_group_quant(x, group, **layout)

    def stream(w, c):
        if c.a8:  # per channel, x per token (layers/quant/fp8.py's _quant_layout)
            return fp8_gemv_a8(*quantized(k if channel else c.block_k), w[0], w[1], gn, gk, torch.bfloat16, config=c)
        if r["prologue"] == "norm":
            return fp8_norm_gemv(x, norm_w, 1e-6, w[0], w[1], gn, gk, residual=residual, config=c)[0]
        if r["prologue"] == "silu":
            return fp8_silu_mul_gemv(gate_up, w[0], w[1], gn, gk, config=c)
        return fp8_gemv(made(), w[0], w[1], gn, gk, config=c)

    if m <= MAX_STREAM_ROWS:
        # per channel, the default per-token FP8 dot and the widening tiles below it both, in --quick runs too
        widening = default_stream_config(m, n, k, tile_cap(gn, gk, k), sms)
        chosen = default_route(m, n, k, gn, gk, False, sms).config if channel else widening
        tried = {}
        for cfg in dict.fromkeys([chosen, widening, *(candidates(m, n, k, sms, channel) if sweep else [])]):
            try:
                tried[cfg] = cold.time_us(lambda w, c=cfg: stream(w, c))
            except Exception as e:  # a tile this card cannot hold (shared memory, registers): skipped, said so
                print(f"  {name} m={m} skip {cfg}: {type(e).__name__}: {str(e)[:80]}")
        best = min(tried, key=tried.get)
        if sweep:
            print(f"  {name} m={m}: " + "; ".join(f"{tile_label(c)} {us:.2f}" for c, us in tried.items()))
            r["tiles"] = [{"tile": tile_label(c), "us": us} for c, us in tried.items()]
        r.update(stream_us=tried[best], stream_default_us=tried.get(chosen), stream_config=vars(best))
        a8 = [c for c in tried if c.a8]
        if 0 < len(a8) < len(tried):  # the best of each kind, for the table's readers
            r["stream_a8_us"] = min(tried[c] for c in a8)
            r["stream_bf16x_us"] = min(tried[c] for c in tried if not c.a8)

    def w8a8(w):
        if channel and scaled_mm_supported(m, n, k, x.device):  # as the layer's w8a8 path runs per channel
            return scaled_mm_rowwise(*quantized(k), w[0], w[1], torch.bfloat16)
        return w8a8_matmul(*quantized(gk), w[0], w[1], gn, gk, torch.bfloat16)

    def scaled_mm(w):
        return scaled_mm_blockwise(*quantized(BLOCK, blockwise=True), w[0], w[2], rows=m)

    r["w8a8_us"] = cold.time_us(w8a8)
    r["scaled_mm_us"] = cold.time_us(scaled_mm) if scaled_mm_ok and not channel else None
    r["bf16_us"] = cold.time_us(lambda w: F.linear(made(), w), bf16=True)
    times = {p: r.get(f"{p}_us") for p in ("stream", "w8a8", "scaled_mm")}
    r["best"] = min((p for p in times if times[p] is not None), key=times.get)
    print_table([r], COLS[:8])
    return r


def bare_read_us(cold: ColdWeights, sms: int) -> float:
    """One call's share of the same graph of back-to-back calls over the same cold copies, each call a bare read of
    its fp8 weight's bytes: kernels/stream_read.py on one program a block (``roofline.BLOCK_GRID``, the read probe's
    fastest grid), the bytes viewed as 16-bit elements. What a projection's kernel could take if it did nothing but
    read its weight, launch for launch."""
    read = bare_read(cold.fp8[0][0], sms)
    return cold.time_us(lambda w: read(w[0]))


def bare_read(w: torch.Tensor, sms: int):
    """A function reading a weight of ``w``'s size and device (the argument, ``w`` by default) as the read probe's
    fastest grid does: kernels/stream_read.py on one program a block (``roofline.BLOCK_GRID``), the bytes viewed as
    16-bit elements, its partial sums into one buffer allocated here."""
    from graphserve.kernels.stream_read import stream_read

    per_sm, block, warps = BLOCK_GRID
    programs = stream_programs(per_sm, sms, wide_view(w).numel(), block)
    out = torch.empty(programs, dtype=torch.float32, device=w.device)

    def read(weight: torch.Tensor = w) -> torch.Tensor:
        return stream_read(wide_view(weight), programs, block=block, num_warps=warps, out=out)

    return read


def measure(name: str, rows: list[int], sweep: bool, scaled_mm_ok: bool, sms: int, channel: bool = False) -> list[dict]:
    cold = ColdWeights(*SHAPES[name], channel=channel)
    out = [measure_row(name, m, cold, sweep, scaled_mm_ok, sms, channel) for m in rows]
    read_us = bare_read_us(cold, sms)
    for r in out:
        r["read_us"] = read_us
        if r.get("stream_us"):
            r["stream/read"] = r["stream_us"] / read_us
    del cold
    torch.cuda.empty_cache()
    return out


def observe_rows(bw, rows: list[dict]) -> None:
    """Every rate the rows' calls reached reading their weights, offered to ``bw`` (roofline.ReadBandwidth.observe):
    one copy's bytes over one call's time is a read rate the floor must not be below. Offered as the whole cycled pool
    (every copy's bytes over every call's time, the same rate), which is what the timed graph read from device memory:
    one copy alone is under ``observe``'s twice-the-L2 bound, and would be ignored."""
    for r in rows:
        for path in ("stream", "w8a8", "scaled_mm", "read", "bf16"):
            us = r.get(f"{path}_us")
            if us:
                bf16 = path == "bf16"
                pool, nbytes = (r["bf16_pool"], 2 * r["n"] * r["k"]) if bf16 else (r["pool"], r["weight_bytes"])
                bw.observe(f"{r['shape']} m={r['m']} {path}", nbytes * pool, us * pool / 1e3)


def stream_ratios(rows: list[dict], bw) -> None:
    """Each stream time over its floor at ``bw``'s best rate, naming that floor; call it once the rates are settled
    (``settle_floor``)."""
    for r in rows:
        if r.get("stream_us"):
            r["stream_GBps"] = r["weight_bytes"] / r["stream_us"] / 1e3
            r["stream/floor"] = r["stream_us"] / (bw.floor_ms(r["weight_bytes"]) * 1e3)
            r["floor_gbs"], r["floor_method"] = bw.best_gbs, bw.best_method


def settle_floor(rows: list[dict], bw) -> None:
    """The floors of ``rows``, last: the rates their own calls reached (``observe_rows``), the probes once more
    (the first ones may have run on a GPU still clocking up), then the ratios (``stream_ratios``)."""
    observe_rows(bw, rows)
    bw.probe_again()
    stream_ratios(rows, bw)


def rule_from_rows(rows: list[dict], env: dict, earlier: dict | None) -> dict:
    """The table for the shapes measured here, plus an earlier table's other shapes from the same card.

    Every entry says which run measured it (``measured_at``: commit and date). An earlier table's entry that
    carries no stamp was measured at or before that table's own ``measured`` run, and is stamped so
    (``at_or_before``); where that table names no run, the entry stays unstamped rather than stamped with nothing."""
    measured = {(r["shape"], r["scales"]) for r in rows}
    same_card = (earlier or {}).get("device") == env["device"]
    run = (earlier or {}).get("measured") or {}
    inherited = {"commit": run["commit"], "date": run.get("date"), "at_or_before": True} if run.get("commit") else None
    before = {(s["name"], s["scales"]): {**s, "rows": [e if "measured_at" in e or not inherited
                                                       else {**e, "measured_at": inherited} for e in s["rows"]]}
              for s in (earlier or {}).get("shapes", []) if same_card}
    stamp = {"commit": env.get("commit"), "date": env.get("date")}
    shapes = [s for key, s in before.items() if key not in measured]
    for key in dict.fromkeys((r["shape"], r["scales"]) for r in rows):
        # row counts this run measured take its winner; the earlier table's other counts stay
        entries = {e["m"]: e for e in before.get(key, {}).get("rows", [])}
        for r in (r for r in rows if (r["shape"], r["scales"]) == key):
            cfg = StreamConfig(**r["stream_config"]) if r["best"] == "stream" else None
            entries[r["m"]] = {"m": r["m"], **Route(r["best"], cfg).to_json(), "measured_at": stamp}
        entries = [entries[m] for m in sorted(entries)]
        first = next(r for r in rows if (r["shape"], r["scales"]) == key)
        shapes.append({"name": key[0], "n": first["n"], "k": first["k"], "scales": key[1], "rows": entries})
    return {"device": env["device"], "written_by": "benchmarks/fp8_route.py",
            "measured": {key: env.get(key) for key in ("date", "commit", "torch", "triton")},
            "rule": "per (n, k, scales), a call of m rows takes the entry of the smallest measured m >= it; "
                    "above the largest, the defaults of kernels/fp8_config.py; 'measured' is the run that last "
                    "wrote the table, each entry's 'measured_at' the run that measured it",
            "shapes": shapes,
            # the gated MLPs' pairs (benchmarks/fp8_gated_mlp.py writes them) stay as they were
            **({"mlps": earlier["mlps"]} if same_card and earlier.get("mlps") else {})}


def write_result(name: str, payload: dict):
    """benchmarks/common.write_result: a source checkout's results folder (the benchmark's own entry point only;
    `graphserve tune` writes tables, not results)."""
    from benchmarks.common import write_result as write

    return write(name, payload)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer row counts, default stream tiles only")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=DEFAULT_SHAPES, metavar="SHAPE")
    p.add_argument("--scales", choices=("block128", "channel"), default="block128",
                   help="the weights' scales: 128x128 blocks, or one per output channel (x then per token)")
    p.add_argument("--no-rule", action="store_true", help="measure and print, but leave fp8_rule.json as it is")
    p.add_argument("--rows", nargs="+", type=int, metavar="M",
                   help="row counts to measure (default: all; the table keeps its entries for the others)")
    p.add_argument("--result-name", help="the results file's name (default fp8_route, or fp8_route_channel)")
    args = p.parse_args()
    device = torch.device("cuda")
    sms = sm_count(device)
    bw = measured_read_bw()
    scaled_mm_ok = blockwise_scaled_mm_available(device)
    print(f"probes: {bw.describe()}; {sms} SMs; torch._scaled_mm block-scaled: {scaled_mm_ok}")
    if args.rows and min(args.rows) < 1:
        p.error(f"--rows {args.rows} is invalid: every row count must be >= 1")
    counts = sorted(set(args.rows)) if args.rows else QUICK_ROWS if args.quick else ROWS
    channel = args.scales == "channel"
    rows = [r for name in args.shapes for r in measure(name, counts, not args.quick, scaled_mm_ok, sms, channel)]
    settle_floor(rows, bw)
    print(f"\nfloor: {bw.describe()}")
    print_table(rows, COLS)
    rule_path = tables.shipped_path(RULE_PATH.name, environment()["device"])  # this card's, never another's
    earlier = json.loads(rule_path.read_text()) if rule_path.exists() else None
    rule = rule_from_rows(rows, environment(), earlier)
    write_result(args.result_name or ("fp8_route_channel" if channel else "fp8_route"),
                 {"read": bw.summary(), "scales": args.scales, "scaled_mm_blockwise": scaled_mm_ok, "rows": rows,
                  "rule": rule})
    if not args.no_rule:
        text = json.dumps(rule, indent=1) + "\n"
        rule_path.parent.mkdir(parents=True, exist_ok=True)
        rule_path.write_text(text)
        if os.environ.get("OUT"):  # a copy that comes back from a remote GPU run, as write_result's
            Path(os.environ["OUT"], RULE_PATH.name).write_text(text)
        print(f"routing table for {rule['device']} written to {rule_path}")


if __name__ == "__main__":
    main()
