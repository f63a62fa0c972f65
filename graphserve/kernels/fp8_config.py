"""How an FP8-weight projection is computed at a given row count: which path, and the streaming
kernel's tiles. Defaults are a pure function of the shape; where benchmarks/fp8_route.py measured this
card, its table (fp8_rule.json beside this file) decides instead.

Three paths (layers/quant/fp8.py runs them):
- ``stream``: kernels/fp8_gemv.py: the fp8 weight widened in registers against the bf16 activation
  (W8A16), or, with ``fp8_dot`` tiles, the activation rows quantized inside the kernel for the FP8
  tensor cores (no quantization launch either way), or, with ``a8`` tiles, the activation quantized by
  one launch before (fused with the norm or SiLU·mul that makes it) and read as fp8. At decode batch
  sizes a projection is a weight stream and this path reads half of bf16's bytes.
- ``w8a8``: per-token-group activation quantization (fused likewise), then the Triton block-scaled
  GEMM (kernels/fp8_gemm.py) on the FP8 tensor cores.
- ``scaled_mm``: the same quantization, then ``torch._scaled_mm``'s block-scaled mode (cuBLASLt;
  128x128 weight blocks only, where this torch/CUDA build has it).

Gated MLPs have entries of their own (``mlps``, benchmarks/fp8_gated_mlp.py writes them): per row count, the
pair of streaming tiles with which gate_up's epilogue makes down's quantized input (``GatedMlp``), or none where
the unfused launches measured faster. They have no default: unmeasured, the MLP runs unfused.

No autotuning at run time (unsafe inside CUDA-graph capture): the table is read once per process.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton

from graphserve.kernels import tables

MAX_STREAM_ROWS = 64  # the streaming kernel's dot path pads x to one tensor-core tile of 16, 32 or 64 rows
MAX_FMA_ROWS = 16  # its FMA path makes one pass over the weight tile per row of x, unrolled
MAX_BLOCK_N = 256  # the tallest weight tile (the FP8 dot's; the other paths stop at one scale block)
PATHS = ("stream", "w8a8", "scaled_mm")
RULE_PATH = Path(__file__).with_name("fp8_rule.json")
# without a measured table: the streaming kernel up to this many rows; from SCALED_MM_MIN_ROWS on the
# cuBLASLt block-scaled GEMM where available (about 2x the Triton GEMM's rate at 2048-16384 rows of the
# Llama-3-8B projections on an H200, benchmarks/results/fp8_decode.json), the Triton GEMM in between
DEFAULT_STREAM_ROWS = 8
SCALED_MM_MIN_ROWS = 128


@dataclass(frozen=True)
class StreamConfig:
    """Tiles of one streaming-kernel call. ``use_dot``: tensor cores with x padded to 16-64 rows; else
    fp32 multiply-adds on the CUDA cores, one pass per row of x (cheaper while M is small).
    ``split_k``: programs per column tile, each streaming 1/split_k of K (reduced in the same launch);
    tables written before it existed read as 1. ``fp8_dot`` (with ``use_dot``): x quantized to fp8 per
    row and K step in registers and the product taken on the FP8 tensor cores (W8A8 without a
    quantization launch); ``block_k`` is then the scale block's K. ``a8`` (with ``fp8_dot``): x comes
    quantized by one launch before (kernels/fp8_quant.py, fused with the norm or SiLU·mul that makes it)
    and the kernel reads fp8 x and its scales instead of quantizing x's rows in every program."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool
    split_k: int = 1
    fp8_dot: bool = False
    a8: bool = False

    def num_programs(self, n: int) -> int:
        return triton.cdiv(n, self.block_n) * self.split_k

    def validate(self) -> None:
        """Refuse tiles no call can run (the shape-dependent limits are kernels/fp8_gemv.py's), naming the
        field, its value and the limit."""
        for name, value, low in (("block_n", self.block_n, 1), ("block_k", self.block_k, 16)):
            if value < low or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= {low}")
        if self.block_n > MAX_BLOCK_N:
            raise ValueError(f"block_n={self.block_n} exceeds {MAX_BLOCK_N}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        if self.num_stages < 1 or self.split_k < 1:
            raise ValueError(f"num_stages={self.num_stages} and split_k={self.split_k} must be at least 1")
        if self.fp8_dot and not self.use_dot:
            raise ValueError("fp8_dot=True needs use_dot=True (the FP8 dot is a tensor-core tile)")
        if self.a8 and not self.fp8_dot:
            raise ValueError("a8=True needs fp8_dot=True (x comes quantized for the FP8 tensor cores)")


def tile_cap(group_n: int, group_k: int, k: int) -> int:
    """The tallest tile whose rows share one row of scale blocks: the largest power of two dividing
    the block height (any height, up to 128, for per-channel scales)."""
    return 128 if group_n == 1 and group_k >= k else min(128, group_n & -group_n)


def default_stream_config(m: int, n: int, k: int, cap: int, sms: int) -> StreamConfig:
    """Tiles for ``m`` rows against an [n, k] fp8 weight, at most ``cap`` rows tall (``tile_cap``).

    The kernel is a weight stream: what matters is bytes in flight per SM. Each program streams a
    ``[block_n, k / split_k]`` slab. A block of scale rows must not straddle programs (the kernel reads
    one scale row per program), so ``block_n`` never exceeds ``group_n``; a projection too narrow to give
    every SM two programs splits K, as long as every split keeps two tiles of K.
    - FMA path: ``block_n`` the widest that still gives every SM two programs; 128 weight bytes per
      thread per tile (eight 16-byte loads).
    - dot path: every program reads its share of x again (from L2), (n / block_n) * m * k * 2 bytes in
      all, so tiles at least 2m rows tall keep that below the weight's own n * k; one scale block of K
      per step (16 KB of fp8 at 128 rows), 3 stages through shared memory.
    """
    target = 2 * sms
    # kernels/gemv.py's bf16 FMA product fell to 0.5x of cuBLAS at 4 rows on an H200 (registers: one
    # fp32 copy of the tile plus one x row per pass) while its dot product held 0.9x from 8 rows on
    use_dot = m > MAX_FMA_ROWS or (m > 2 and cap >= 16 and triton.cdiv(n, 16) >= sms)
    if use_dot:
        block_n = min(cap, 128, max(32, triton.next_power_of_2(2 * m)))
        block_k = max(16, min(128, triton.next_power_of_2(k)))
        warps, stages = (8 if block_n * max(16, triton.next_power_of_2(m)) >= 64 * 64 else 4), 3
    else:
        widths = (8,) if m <= 2 else (16, 8)  # gemv.py measured 8-row slabs best at 1-2 rows
        block_n = next((bn for bn in widths if bn <= cap and triton.cdiv(n, bn) >= target), min(4, cap))
        block_k = max(16, min(128 * 32 * 4 // block_n, triton.next_power_of_2(k)))
        warps, stages = 4, 2
    # each split adds a partial tile to write and read back: only as many as the SMs need
    tiles = triton.cdiv(n, block_n)
    split_k = max(1, min(triton.cdiv(target, tiles), k // (2 * block_k))) if tiles < target else 1
    if not use_dot:
        split_k = min(4, split_k)
    return StreamConfig(block_n, block_k, num_warps=warps, num_stages=stages, use_dot=use_dot, split_k=split_k)


def per_token_stream_config(m: int, n: int, k: int, sms: int) -> StreamConfig:
    """FP8-dot tiles for ``m`` rows of x quantized per token against a per-channel [n, k] weight: 64 weight rows
    by one 128-column step (x's rows padded to a 16-64-row tensor-core tile), 4 warps, 3 stages, K split until
    the grid gives every SM a program while each split keeps two steps."""
    block_n, block_k = 64, max(16, min(128, triton.next_power_of_2(k)))
    tiles = triton.cdiv(n, block_n)
    split_k = max(1, min(triton.cdiv(sms, tiles), k // (2 * block_k)))
    return StreamConfig(block_n, block_k, num_warps=4, num_stages=3, use_dot=True, split_k=split_k, fp8_dot=True,
                        a8=True)


# -- the measured table -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    path: str
    config: StreamConfig | None = None  # the streaming kernel's tiles (path "stream" only)

    def to_json(self) -> dict:
        return {"path": self.path, **({"config": asdict(self.config)} if self.config else {})}


@dataclass(frozen=True)
class GatedMlp:
    """A gated MLP's two streaming tiles where gate_up's epilogue makes down's input (kernels/fp8_gemv.fp8_gate_up_a8):
    ``gate_up`` an a8 FP8-dot tile of ``block_n / 2`` gate rows and as many up rows, which writes silu·up quantized in
    groups of ``block_n / 2`` columns; ``down`` an a8 FP8-dot tile whose K step is that group."""

    gate_up: StreamConfig
    down: StreamConfig

    def validate(self, scales: str = "channel") -> None:
        """Refuse a pair no call of a table with ``scales`` can run, naming the field and the limit."""
        for name, cfg in (("gate_up", self.gate_up), ("down", self.down)):
            cfg.validate()
            if not (cfg.fp8_dot and cfg.a8):
                raise ValueError(f"{name} tile {cfg} must be an a8 FP8-dot tile")
            if scales == "block128" and cfg.block_k != 128:
                raise ValueError(f"{name} tile's block_k={cfg.block_k} must be the 128-column scale block's K")
        if self.gate_up.block_n < 32 or self.down.block_k != self.gate_up.block_n // 2:
            raise ValueError(f"gate_up's block_n={self.gate_up.block_n} must be at least 32 and twice down's "
                             f"block_k={self.down.block_k} (its output groups are down's K steps)")

    def to_json(self) -> dict:
        return {"gate_up": asdict(self.gate_up), "down": asdict(self.down)}

    @classmethod
    def from_json(cls, mlp: dict, row: dict) -> GatedMlp | None:
        """A table row's pair (None: the unfused launches won there), refused by name where no call can run it."""
        if row.get("gate_up") is None and row.get("down") is None:
            return None
        try:
            for part in ("gate_up", "down"):
                if not isinstance(row.get(part), dict):
                    raise ValueError(f"{part} is {row.get(part)!r}: a pair names both tiles (or neither, where the "
                                     f"unfused launches won)")
            tiles = cls(StreamConfig(**row["gate_up"]), StreamConfig(**row["down"]))
            tiles.validate(str(mlp["scales"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{RULE_PATH.name}: gated tiles for {mlp.get('name')} m={row.get('m')}: {e}") from e
        return tiles


@dataclass(frozen=True)
class Fp8Rule:
    """Per (N, K, scale kind): row counts measured, ascending, each with the path that won there.

    A call of ``m`` rows takes the route of the smallest measured count >= m; above the largest,
    the defaults. Scale kind: ``"block128"`` (128x128 blocks) or ``"channel"``.
    """

    device: str
    shapes: dict[tuple[int, int, str], list[tuple[int, Route]]]
    # per gated MLP (hidden size, intermediate size, scale kind): row counts measured, ascending, each with the tile
    # pair that won there (``GatedMlp``) or None where the unfused launches won
    mlps: dict[tuple[int, int, str], list[tuple[int, GatedMlp | None]]] = field(default_factory=dict)

    def route(self, m: int, n: int, k: int, kind: str) -> Route | None:
        for rows, route in self.shapes.get((n, k, kind), ()):
            if m <= rows:
                return route
        return None

    def gated_mlp(self, m: int, hidden: int, inter: int, kind: str) -> GatedMlp | None:
        """The tile pair of the smallest measured count >= m; None there or above the largest (unmeasured)."""
        for rows, tiles in self.mlps.get((hidden, inter, kind), ()):
            if m <= rows:
                return tiles
        return None

    @classmethod
    def from_json(cls, data: dict) -> Fp8Rule:
        shapes = {}
        mlps = {(int(mlp["hidden"]), int(mlp["intermediate"]), str(mlp["scales"])):
                sorted(((int(row["m"]), GatedMlp.from_json(mlp, row)) for row in mlp["rows"]), key=lambda e: e[0])
                for mlp in data.get("mlps", [])}  # fmt: skip
        for shape in data["shapes"]:
            key = (int(shape["n"]), int(shape["k"]), str(shape["scales"]))
            entries = []
            for row in shape["rows"]:
                if row["path"] not in PATHS:
                    raise ValueError(f"{RULE_PATH.name}: path {row['path']!r} for {shape.get('name')} m={row['m']} "
                                     f"is not one of {PATHS}")
                cfg = None
                if row.get("config"):
                    try:
                        cfg = StreamConfig(**row["config"])
                        cfg.validate()
                    except (TypeError, ValueError) as e:
                        raise ValueError(f"{RULE_PATH.name}: stream tiles for {shape.get('name')} m={row['m']}: "
                                         f"{e}") from e
                entries.append((int(row["m"]), Route(row["path"], cfg)))
            shapes[key] = sorted(entries, key=lambda e: e[0])
        return cls(str(data["device"]), shapes, mlps)


_NO_RULE = Fp8Rule("", {})


@tables.reader_cache
@functools.lru_cache(maxsize=1)
def load_rule(path: str = str(RULE_PATH)) -> Fp8Rule:
    if not Path(path).exists():
        return _NO_RULE
    return Fp8Rule.from_json(json.loads(Path(path).read_text()))


@tables.reader_cache
@functools.lru_cache(maxsize=16)
def rule_for(device: torch.device) -> Fp8Rule:
    """This card's measured table (kernels/tables.py: the tune cache, then the shipped tables), else none (the
    defaults; the start-up line names the command that measures it)."""
    found = tables.find(RULE_PATH.name, torch.cuda.get_device_name(device), Fp8Rule.from_json, "fp8")
    return found.table if found else _NO_RULE


def gated_mlp(m: int, hidden: int, inter: int, group_n: int, group_k: int, device: torch.device) -> GatedMlp | None:
    """The measured tile pair for ``m`` rows of a gated MLP (hidden -> 2 x inter -> hidden) whose gate_up has
    ``group_n`` x ``group_k`` scales, or None: where the table has no pair for the call the unfused launches run (no
    default: the fusion is taken only where it measured faster)."""
    kind = scale_kind(group_n, group_k, hidden)
    if kind is None or device.type != "cuda" or m > MAX_STREAM_ROWS:
        return None
    return rule_for(device).gated_mlp(m, hidden, inter, kind)


def scale_kind(group_n: int, group_k: int, k: int) -> str | None:
    """The table's name for a layer's scales; None for layouts the benchmark does not measure."""
    if group_n == 1 and group_k >= k:
        return "channel"
    if (group_n, group_k) == (128, 128):
        return "block128"
    return None


def default_route(m: int, n: int, k: int, group_n: int, group_k: int, scaled_mm_ok: bool, sms: int) -> Route:
    if 1 < m <= MAX_STREAM_ROWS and group_n == 1 and group_k >= k:
        # per-channel weights: x quantized per token by the launch before, one FP8 dot chain over K and both
        # scales after it (kernels/fp8_gemv.py), which measured faster than cuBLASLt's rowwise GEMM at
        # 16-64 rows, and at 16 rows faster than the widening tiles at 4 and 8
        # (benchmarks/results/fp8_route_channel*.json)
        return Route("stream", per_token_stream_config(m, n, k, sms))
    if m <= DEFAULT_STREAM_ROWS:
        return Route("stream", default_stream_config(m, n, k, tile_cap(group_n, group_k, k), sms))
    if scaled_mm_ok and m >= SCALED_MM_MIN_ROWS:
        return Route("scaled_mm")
    return Route("w8a8")


def choose_route(m: int, n: int, k: int, group_n: int, group_k: int, scaled_mm_ok: bool,
                 device: torch.device, sms: int) -> Route:
    """The path (and streaming tiles) for ``m`` rows: the measured table's where it covers the call and
    its choice is runnable here, else the default."""
    kind = scale_kind(group_n, group_k, k)
    route = rule_for(device).route(m, n, k, kind) if kind and device.type == "cuda" else None
    if route is None or (route.path == "scaled_mm" and not scaled_mm_ok) or (
            route.path == "stream" and m > MAX_STREAM_ROWS):
        return default_route(m, n, k, group_n, group_k, scaled_mm_ok, sms)
    if route.path == "stream" and route.config is None:
        return Route("stream", default_stream_config(m, n, k, tile_cap(group_n, group_k, k), sms))
    return route
