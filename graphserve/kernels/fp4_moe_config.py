"""Which path and tiles the FP4 routed experts (kernels/fp4_moe.fp4_fused_experts) take, per card, expert shape and
batch: the streaming kernels up to a number of (token, slot) pairs, beyond it the grouped GEMM with a gate_up and a
down tile, each in the "bf16" (W4A16) or "fp8" (W4A8) variant (kernels/fp4_moe_gemm.py).

The table is ``fp4_moe_tiles.json`` (kernels/tables.py: the tune cache, then the shipped per-card tables), written
by ``graphserve tune --tables fp4`` (graphserve/tuning/fp4_moe.py). One entry per expert shape, keyed by format,
experts on this rank (E), intermediate size per expert on this rank (N of gate_up's halves, K of down) and hidden
size (K of gate_up, N of down):

    {"device": ..., "shapes": [{"fmt": "nvfp4", "experts": 256, "intermediate": 2048, "hidden": 4096,
      "stream_max_pairs": 24,                        # streaming path up to this many pairs (null: the default)
      "buckets": {"384": {"gate_up": TILE, "down": TILE}, ...}}]}   # pairs T * k; a call takes the smallest
                                                                    # bucket holding it, the largest beyond them
    TILE = {"variant": "bf16" | "fp8", "block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages"}

A bucket's two tiles share block_m (one sort). A shape or card the table does not list takes the tile every call
took before tables existed (``default_tile``: bf16, BLOCK_N 64, BLOCK_K 128, 4 warps, 3 stages, BLOCK_M by the
pairs an expert gets) and the streaming path up to ``DEFAULT_STREAM_MAX_PAIRS``; the start-up line names the
command that measures it. Read once per process, before any capture: a captured graph replays one path and tile.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

from graphserve.kernels import tables
from graphserve.kernels.fp4_gemm_config import FP8_STEP, check_tile, table_fmt
from graphserve.kernels.fp4_layout import GROUP

TABLE_NAME = "fp4_moe_tiles.json"
VARIANTS = ("bf16", "fp8")
# (token, slot) pairs up to which the streaming path runs where no table says: each pair streams its expert's rows,
# so past a few tokens per expert the grouped GEMM's one read per tile wins. benchmarks/fp4.py on an H100
# (results/fp4_kernels.json): qwen3-30b-a3b's experts stream faster up to 64 pairs (0.145 against 0.162 ms at 8
# tokens, 0.274 against 0.265 at 16), gpt-oss-120b's up to 4 (0.107 against 0.125 ms at 1 token; 0.240 against
# 0.222 at 4 tokens, 0.393 against 0.388 at 8, 0.694 against 0.611 at 16): 32 costs gpt-oss at most 8% and qwen3
# 10% (at 64 pairs)
DEFAULT_STREAM_MAX_PAIRS = 32


@dataclass(frozen=True)
class Fp4MoeTile:
    variant: str
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def check(self, name: str, group: int, k: int) -> None:
        """A ValueError naming ``name``'s field, its value and the limit where this tile cannot run a GEMM of
        depth ``k`` over scale groups of ``group``."""
        check_tile(name, self.variant, VARIANTS, self.block_m, self.block_n, self.block_k, self.group_m, self.num_warps,
                   group, k)


@dataclass(frozen=True)
class Fp4MoeShapeTiles:
    """One expert shape's measured entry: ``stream_max_pairs`` None where the streaming path was not timed."""

    stream_max_pairs: int | None
    buckets: tuple[int, ...]  # ascending pair counts
    gate_up: tuple[Fp4MoeTile, ...]
    down: tuple[Fp4MoeTile, ...]

    def tiles(self, pairs: int) -> tuple[Fp4MoeTile, Fp4MoeTile]:
        i = next((i for i, b in enumerate(self.buckets) if b >= pairs), len(self.buckets) - 1)
        return self.gate_up[i], self.down[i]

    def to_json(self) -> dict:
        return {"stream_max_pairs": self.stream_max_pairs,
                "buckets": {str(b): {"gate_up": asdict(g), "down": asdict(d)}
                            for b, g, d in zip(self.buckets, self.gate_up, self.down)}}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> Fp4MoeShapeTiles:
        buckets = sorted(int(b) for b in data["buckets"])
        if not buckets:
            raise ValueError("field 'buckets' is empty")
        gate_up = tuple(Fp4MoeTile(**data["buckets"][str(b)]["gate_up"]) for b in buckets)
        down = tuple(Fp4MoeTile(**data["buckets"][str(b)]["down"]) for b in buckets)
        for b, g, d in zip(buckets, gate_up, down):
            if g.block_m != d.block_m:
                raise ValueError(f"bucket {b}: gate_up's block_m {g.block_m} and down's {d.block_m} must be equal "
                                 f"(one sort)")
        smp = data.get("stream_max_pairs")
        return cls(None if smp is None else int(smp), tuple(buckets), gate_up, down)


ShapeKey = tuple[str, int, int, int]  # (fmt, experts, intermediate, hidden)


@dataclass(frozen=True)
class Fp4MoeTable:
    device: str
    shapes: dict[ShapeKey, Fp4MoeShapeTiles]

    @classmethod
    def from_json(cls, data: dict) -> Fp4MoeTable:
        shapes = {}
        for s in data["shapes"]:
            key = (table_fmt(s), int(s["experts"]), int(s["intermediate"]), int(s["hidden"]))
            entry = Fp4MoeShapeTiles.from_json(s)
            group = GROUP[key[0]]
            for b, g, d in zip(entry.buckets, entry.gate_up, entry.down):
                g.check(f"{table_label(key)} bucket {b} gate_up", group, key[3])
                d.check(f"{table_label(key)} bucket {b} down", group, key[2])
            shapes[key] = entry
        return cls(str(data["device"]), shapes)


def shape_entry(key: ShapeKey, tiles: Fp4MoeShapeTiles) -> dict:
    fmt, e, inter, hidden = key
    return {"fmt": fmt, "experts": e, "intermediate": inter, "hidden": hidden, **tiles.to_json()}


def default_block_m(pairs: int, num_local: int) -> int:
    """Rows a tile: about the pairs an expert gets, so few rows of a tile are padding."""
    per_expert = pairs / max(num_local, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def default_tile(variant: str, block_m: int, group: int, k: int) -> Fp4MoeTile:
    """The tile of a shape no table lists. "bf16": the one tile the grouped GEMM ran before tables (BLOCK_N 64,
    BLOCK_K up to 128, 4 warps, 3 stages). "fp8": the dense GEMM's fixed tile before its tables (one 32-column MMA a
    step, 4 stages deep to keep its loads ahead)."""
    if variant == "fp8":
        return Fp4MoeTile("fp8", block_m, 64, FP8_STEP, 8, 4, 4)
    return Fp4MoeTile("bf16", block_m, 64, max(group, min(128, 1 << max(0, k - 1).bit_length())), 8, 4, 3)


@dataclass(frozen=True)
class Fp4MoePlan:
    """What one call runs: ``path`` "stream" or "gemm", and the grouped GEMM's two tiles."""

    path: str
    gate_up: Fp4MoeTile
    down: Fp4MoeTile


def table_label(key: ShapeKey) -> str:
    fmt, e, inter, hidden = key
    return f"fp4 experts E={e},I={inter},H={hidden},{fmt}"


def tune_command() -> str:
    return f"{tables.TUNE_COMMAND} --tables fp4"


@tables.reader_cache
@functools.lru_cache(maxsize=64)
def shape_tiles(key: ShapeKey, card: str) -> Fp4MoeShapeTiles | None:
    """This card's entry for the expert shape ``key`` (the tune cache, then the shipped tables), else None (the
    defaults: the start-up line names them, and this log line the command)."""
    fmt, e, inter, hidden = key
    return tables.find_shape(TABLE_NAME, card, Fp4MoeTable.from_json, key, table_label(key),
                             f"FP4 expert tiles for fmt={fmt} experts={e} intermediate={inter} hidden={hidden}", "fp4")


@tables.reader_cache
@functools.lru_cache(maxsize=1024)  # called per forward: the card's name and the table lookup once per shape
def plan(fmt: str, num_local: int, inter: int, hidden: int, pairs: int, device: torch.device,
         variant: str | None = None) -> Fp4MoePlan:  # fmt: skip
    """The path and tiles of a call with ``pairs`` (token, slot) pairs, a pure function of the shape (a captured
    graph replays one). ``variant`` ("bf16" | "fp8") forces both GEMMs' variant with default tiles."""
    group = GROUP[fmt]
    block_m = default_block_m(pairs, num_local)
    entry = None
    if device.type == "cuda" and variant is None:
        entry = shape_tiles((fmt, num_local, inter, hidden), torch.cuda.get_device_name(device))
    if entry is None:
        v = variant or "bf16"
        return Fp4MoePlan("stream" if pairs <= DEFAULT_STREAM_MAX_PAIRS else "gemm",
                          default_tile(v, block_m, group, hidden), default_tile(v, block_m, group, inter))
    stream_max = DEFAULT_STREAM_MAX_PAIRS if entry.stream_max_pairs is None else entry.stream_max_pairs
    gate_up, down = entry.tiles(pairs)
    return Fp4MoePlan("stream" if pairs <= stream_max else "gemm", gate_up, down)
