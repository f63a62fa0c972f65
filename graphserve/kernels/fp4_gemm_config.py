"""Which variant and tile the dense FP4 GEMM (kernels/fp4_gemm.py) takes, per card, weight shape and rows.

The table is ``fp4_gemm_tiles.json`` (kernels/tables.py: the tune cache, then the shipped per-card tables), written by
``graphserve tune --tables fp4`` (graphserve/tuning/fp4_gemm.py), beside ``fp4_rule.json`` (the streaming kernel's
rows, derived from the same timings):

    {"device": ..., "shapes": [{"fmt": "nvfp4", "n": 4096, "k": 4096,
      "buckets": {"16": TILE, "64": TILE, "4096": TILE}}]}   # rows; a call takes the smallest bucket holding it,
                                                              # the largest beyond them
    TILE = {"variant": "bf16" | "fp8" | "dequant" | "dequant_fp8", "block_m", "block_n", "block_k", "group_m",
            "num_warps", "num_stages", "split_k"}   # "dequant" / "dequant_fp8": its conversion's tile (block_n,
                                                     # block_k, num_warps)

A listed shape's variant is the table's (measured at its best tiles); a shape or card it does not list takes the
variant fp4_rule.json names ("dequant" from ``DEFAULT_DEQUANT_ROWS``) and ``default_config``'s tile, sized so the grid
holds about two programs an SM (a small weight split over K where its column tiles alone are too few). "dequant_fp8"
(kernels/fp4_dequant_fp8.py) is never a default: a table names it where the tune measured it faster (it needs FP8
tensor cores, sm_89 and later). The start-up line names the command that measures the tables. Read once per process, before any capture: a captured graph replays one
variant and tile.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import triton

from graphserve.kernels import tables
from graphserve.kernels.common import sm_count
from graphserve.kernels.fp4_layout import GROUP

TABLE_NAME = "fp4_gemm_tiles.json"
VARIANTS = ("bf16", "fp8", "dequant", "dequant_fp8")
# the variants that hold a transient converted weight [N, K] for the call: never at decode rows (DEQUANT_ABOVE_ROWS)
DEQUANT_VARIANTS = ("dequant", "dequant_fp8")
FP8_STEP = 32  # the fp8 MMA's K: the fp8 variant's BLOCK_K
# below 64 rows x is the MMA's first operand (a 16- or 32-row tile); from 64 the widened weight is, from registers:
# as the second operand (through shared memory) a widened tile failed to compile at 64 and 128 (Triton 3.6, sm_90)
X_FIRST_BELOW = 64
MIN_SPLIT_COLUMNS = 512  # K columns a split walks at least: shorter walks pay the prologue and the partials' traffic
MAX_SPLIT_K = 8
PROGRAMS_PER_SM = 2  # the defaults' target grid: one wave hides no load latency behind another program's MMAs
# rows from which a shape no table lists takes the "dequant" variant (the weight dequantized to bf16, then cuBLAS).
# From the H100 measurements before tables (benchmarks/results/fp4_kernels.json, llama3-8b's gate_up): at 1024 rows
# bf16 cuBLAS took 0.31 ms and the fp8 variant 0.85 (MXFP4) to 1.91 ms (NVFP4); the dequantization writes N * K
# bf16 once (235 MB, about 0.1 ms at the card's 3 TB/s) and cuBLAS reads them, so from about 512 rows it wins by
# the arithmetic; below, the weight's extra pass costs more than the tensor cores' rate gains.
# "dequant_fp8" (the weight converted to e4m3, then cuBLASLt FP8) is no default: its arithmetic promised ~1.7x
# over "dequant" (FP8's matmul at twice bf16's rate, half the bytes written), but the H100's tune at 4,096 rows
# (kernels/tables/NVIDIA_H100_80GB_HBM3/fp4_gemm_tiles.json, llama3-8b NVFP4, "measurements") found 1.04x for qkv
# (0.274 against 0.284 ms), 1.18x for gate_up (1.135 / 1.337), 1.04x for down (0.618 / 0.640) and none for o_proj
# (0.191 / 0.190): a card's table names it where its tune measured it faster
DEFAULT_DEQUANT_ROWS = 512
# the most rows the "dequant" variant never serves (a table's tile at a bucket of this many rows or fewer is refused):
# its transient [N, K] weight stays out of decode batches' activations, and `graphserve plan` counts it only past this
DEQUANT_ABOVE_ROWS = 64


@dataclass(frozen=True)
class Fp4GemmConfig:
    """One launch's tile. ``split_k`` > 1: that many programs per output tile, each over its own K range, their fp32
    partials summed in a fixed order by a second launch (deterministic, no atomics)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1

    def check(self, name: str, variant: str, group: int, k: int) -> None:
        """A ValueError naming ``name``'s field, its value and the limit where this tile cannot run ``variant`` over
        K = ``k`` with scale groups of ``group`` columns."""
        check_tile(name, variant, VARIANTS, self.block_m, self.block_n, self.block_k, self.group_m, self.num_warps,
                   group, k)
        if not 16 <= self.block_m <= 256:
            raise ValueError(f"{name}: block_m={self.block_m} must be 16 to 256 (the MMA's smallest side to the "
                             f"largest tile)")  # fmt: skip
        if not 16 <= self.block_n <= 256:
            raise ValueError(f"{name}: block_n={self.block_n} must be 16 to 256")
        if self.num_warps > 16 or self.num_stages < 1:
            raise ValueError(f"{name}: num_warps={self.num_warps} (at most 16), num_stages={self.num_stages} "
                             f"(at least 1)")  # fmt: skip
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"{name}: split_k={self.split_k} must be 1 to {MAX_SPLIT_K}")


def table_fmt(entry: dict) -> str:
    """A table entry's FP4 format, refused naming the field unless one of fp4_layout.GROUP's."""
    fmt = str(entry["fmt"])
    if fmt not in GROUP:
        raise ValueError(f"field 'fmt' is {fmt!r}, must be one of {tuple(GROUP)}")
    return fmt


def check_tile(name: str, variant: str, variants: tuple[str, ...], block_m: int, block_n: int, block_k: int,
               group_m: int, num_warps: int, group: int, k: int) -> None:
    """What every FP4 GEMM tile (dense and experts) must satisfy: a known variant, power-of-two sides, at least the
    MMA's 16 rows, and the variant's K step (fp8: one 32-column MMA with the weight as its M side; else whole scale
    groups). A ValueError naming ``name``'s field, its value and the limit."""
    if variant not in variants:
        raise ValueError(f"{name}: variant={variant!r} must be one of {variants}")
    for field, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k), ("group_m", group_m),
                     ("num_warps", num_warps)):  # fmt: skip
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}: {field}={v} must be a power of two")
    if block_m < 16:
        raise ValueError(f"{name}: block_m={block_m} must be at least 16 (the MMA's smallest side)")
    if variant == "fp8":
        if block_k != FP8_STEP or k % FP8_STEP:
            raise ValueError(f"{name}: the fp8 variant steps {FP8_STEP} columns (one MMA) over K a multiple of "
                             f"{FP8_STEP}: got block_k={block_k}, K={k}")
        if block_n < 64:
            raise ValueError(f"{name}: the fp8 variant's block_n={block_n} must be at least 64 (the weight is the "
                             f"MMA's M side)")
    elif block_k % group or block_k < 16:
        raise ValueError(f"{name}: block_k={block_k} must be a multiple of the scale group ({group}) and at least 16 "
                         f"(the bf16 MMA's K)")


@dataclass(frozen=True)
class Fp4GemmTile:
    """What one GEMM call runs: the variant ("bf16": W4A16, "fp8": W4A8, "dequant": the weight dequantized to x's
    dtype, then cuBLAS; "dequant_fp8": the weight converted to e4m3, then the FP8 linear's matmul) and its tile."""

    variant: str
    config: Fp4GemmConfig

    def to_json(self) -> dict:
        return {"variant": self.variant, **asdict(self.config)}

    @classmethod
    def from_json(cls, data: dict) -> Fp4GemmTile:
        fields = dict(data)
        return cls(str(fields.pop("variant")), Fp4GemmConfig(**fields))

    def short(self) -> str:
        c = self.config
        return (f"{self.variant} {c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} g{c.group_m}"
                f"{f' split{c.split_k}' if c.split_k > 1 else ''}")


ShapeKey = tuple[str, int, int]  # (fmt, N, K)


@dataclass(frozen=True)
class Fp4GemmShapeTiles:
    buckets: tuple[int, ...]  # ascending rows
    tiles: tuple[Fp4GemmTile, ...]

    def tile(self, m: int) -> Fp4GemmTile:
        return self.tiles[next((i for i, b in enumerate(self.buckets) if b >= m), len(self.buckets) - 1)]

    def to_json(self) -> dict:
        return {"buckets": {str(b): t.to_json() for b, t in zip(self.buckets, self.tiles)}}

    @classmethod
    def from_json(cls, data: dict, key: ShapeKey) -> Fp4GemmShapeTiles:
        fmt, n, k = key
        buckets = sorted(int(b) for b in data["buckets"])
        if not buckets or buckets[0] < 1:
            raise ValueError(f"{table_label(key)}: field 'buckets' must hold row counts >= 1, got {buckets}")
        tiles = []
        for b in buckets:
            tile = Fp4GemmTile.from_json(data["buckets"][str(b)])
            tile.config.check(f"{table_label(key)} bucket {b}", tile.variant, GROUP[fmt], k)
            if tile.variant in DEQUANT_VARIANTS and b <= DEQUANT_ABOVE_ROWS:
                raise ValueError(f"{table_label(key)} bucket {b}: variant {tile.variant!r} serves more than "
                                 f"{DEQUANT_ABOVE_ROWS} rows only (its transient [N, K] weight stays out of decode "
                                 "batches)")
            tiles.append(tile)
        return cls(tuple(buckets), tuple(tiles))


@dataclass(frozen=True)
class Fp4GemmTable:
    device: str
    shapes: dict[ShapeKey, Fp4GemmShapeTiles]

    @classmethod
    def from_json(cls, data: dict) -> Fp4GemmTable:
        shapes = {}
        for s in data["shapes"]:
            key = (table_fmt(s), int(s["n"]), int(s["k"]))
            shapes[key] = Fp4GemmShapeTiles.from_json(s, key)
        return cls(str(data["device"]), shapes)


def shape_entry(key: ShapeKey, tiles: Fp4GemmShapeTiles) -> dict:
    fmt, n, k = key
    return {"fmt": fmt, "n": n, "k": k, **tiles.to_json()}


def table_label(key: ShapeKey) -> str:
    fmt, n, k = key
    return f"fp4 gemm N={n},K={k},{fmt}"


def default_block_m(m: int) -> int:
    """Rows a tile: the batch's own below 64 (x the MMA's first operand, little padding), 64 up to 256 rows (more
    programs for a decode batch's narrow weights; the weight's re-reads come from L2), 128 beyond (prefill)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 256 else 128


def default_config(variant: str, m: int, n: int, k: int, group: int, sms: int) -> Fp4GemmConfig:
    """The tile of a shape no table lists, enough programs for ``sms`` SMs by construction: block_n halved from 128
    (64 past 64 rows, the prefill tile measured before tables) down to 32 (fp8: 64, the MMA's M side) while the grid
    is under two programs an SM; then K split in two while it still is, each split at least MIN_SPLIT_COLUMNS and the
    partials' traffic at most the weight's bytes. bf16 steps 128 columns (whole scale groups, no deeper than
    K), fp8 one 32-column MMA, 4 stages deep to keep its loads ahead."""
    bm = default_block_m(m)
    target = PROGRAMS_PER_SM * sms
    bn, bn_min = (128 if m <= X_FIRST_BELOW else 64), (64 if variant == "fp8" else 32)
    while bn > bn_min and triton.cdiv(m, bm) * triton.cdiv(n, bn) < target:
        bn //= 2
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = 1
    # each split writes and the sum reads back an fp32 [M, N] (mostly in L2): kept to the weight's bytes (8 * split *
    # M * N against N * K / 2)
    while (tiles * split < target and split * 2 <= MAX_SPLIT_K and k // (split * 2) >= MIN_SPLIT_COLUMNS
           and 16 * m * split * 2 <= k):  # fmt: skip
        split *= 2
    if variant in DEQUANT_VARIANTS:  # the conversion's tile: 4096 weights a program, whole scale groups
        return Fp4GemmConfig(16, 32, max(group, 128), 8, 4, 1)
    warps = 8 if bm * bn >= 128 * 128 else 4
    if variant == "fp8":
        return Fp4GemmConfig(bm, bn, FP8_STEP, 8, warps, 4, split)
    bk = max(group, min(128, 1 << max(0, k - 1).bit_length()))
    return Fp4GemmConfig(bm, bn, bk, 8, warps, 3, split)


def tune_command() -> str:
    return f"{tables.TUNE_COMMAND} --tables fp4"


@tables.reader_cache
@functools.lru_cache(maxsize=64)
def shape_tiles(key: ShapeKey, card: str) -> Fp4GemmShapeTiles | None:
    """This card's entry for the weight shape ``key`` (the tune cache, then the shipped tables), else None (the
    defaults: the start-up line names them, and this log line the command)."""
    fmt, n, k = key
    return tables.find_shape(TABLE_NAME, card, Fp4GemmTable.from_json, key, table_label(key),
                             f"FP4 GEMM tiles for fmt={fmt} N={n} K={k}", "fp4")


@tables.reader_cache
@functools.lru_cache(maxsize=1024)  # called per forward: the card's name and the table lookup once per shape and rows
def gemm_tile(fmt: str, n: int, k: int, m: int, device: torch.device, variant: str) -> Fp4GemmTile:
    """The variant and tile of an ``m``-row GEMM on the weight (fmt, N, K), a pure function of the shape (a captured
    graph replays one): the table's where it lists the shape, else ``variant`` (fp4_rule.json's choice; "dequant"
    from DEFAULT_DEQUANT_ROWS) with ``default_config``'s tile."""
    entry = shape_tiles((fmt, n, k), torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if entry is not None:
        return entry.tile(m)
    if m >= DEFAULT_DEQUANT_ROWS:
        variant = "dequant"
    elif variant == "fp8" and k % FP8_STEP:
        variant = "bf16"  # the fp8 variant steps whole 32-column MMAs
    return Fp4GemmTile(variant, default_config(variant, m, n, k, GROUP[fmt], sm_count(device)))


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` multiplies e4m3 on its tensor cores (sm_89 and later): the "dequant_fp8" variant's matmul."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8_tensor_cores(name: str, variant: str, device: torch.device) -> None:
    """A ValueError naming the variant, the card and the limit where a CUDA ``device`` has no FP8 tensor cores for
    ``variant``'s matmul (the interpreter's CPU runs it)."""
    if device.type == "cuda" and not fp8_tensor_cores(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"{name}: variant={variant!r} multiplies e4m3 on the tensor cores, sm_89 and later; "
                         f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}")
