"""Tiles of the MoE expert kernels per (experts, intermediate size, hidden size, dtype, GPU, batch bucket).

The tables are JSON files under kernels/moe_configs/ (or the tune cache: kernels/tables.py), written by
``graphserve tune --tables moe`` or ``python3 -m benchmarks.moe_tune``
(never tuned at run time: autotuning inside a CUDA-graph capture is unsafe, and a serving process
should start the same way every time). A bucket is the number of (token, slot) pairs T * k: the
rows the grouped GEMM gathers depend on it, not on T and k apart. Up to ``small_max_pairs`` pairs
the per-pair streaming kernel runs instead of the grouped GEMM (the tuner measures where it stops
winning). A shape with no table gets the defaults below and one warning naming the tuning command.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from graphserve.kernels import tables

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "moe_configs"


@dataclass(frozen=True)
class GemmTile:
    """Grouped GEMM tiles; ``block_m`` is also the alignment of the sort.

    ``a8`` (fp8 weights with block scales only): the activations are quantized to fp8 inside the
    GEMM, per row and K step, and the step runs on the FP8 tensor cores (kernels/moe_gemm.py's
    ``A_QUANT``); ``block_k`` must then equal the scale block's K. Tables written before the field
    existed read False.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    a8: bool = False


@dataclass(frozen=True)
class GemvTile:
    """Streaming kernels: ``block_n`` output rows per program, ``block_k`` along K per step.

    The down kernel loads every slot of its token at once: its tile is [next_power_of_2(k),
    block_n, block_k]. Both kernels prefetch the next K step by hand, so ``num_stages`` = 1 (no
    compiler pipelining through shared memory on top) is the default.
    """

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1


@dataclass(frozen=True)
class MoeTiles:
    small_max_pairs: int
    gemv_gate_up: GemvTile | None  # None: default_gemv_tiles for the call's shape and k
    gemv_down: GemvTile | None
    buckets: tuple[int, ...]  # ascending pair counts
    gate_up: tuple[GemmTile, ...]  # one per bucket; a bucket's two tiles share block_m (one sort)
    down: tuple[GemmTile, ...]

    def gemm_tiles(self, num_pairs: int) -> tuple[GemmTile, GemmTile]:
        """The tiles of the smallest bucket holding ``num_pairs`` (the largest bucket beyond them)."""
        i = next((i for i, b in enumerate(self.buckets) if b >= num_pairs), len(self.buckets) - 1)
        return self.gate_up[i], self.down[i]

    def gemv_tiles(self, top_k: int, intermediate: int, hidden: int, max_block_k: int | None = None,
                   ) -> tuple[GemvTile, GemvTile]:  # fmt: skip
        """The streaming kernels' tiles: the table's, or the shape's defaults where it has none
        (``max_block_k``: fp8 block scales, whose K block a step may not cross)."""
        gate_up, down = default_gemv_tiles(top_k, intermediate, hidden, max_block_k)
        return self.gemv_gate_up or gate_up, self.gemv_down or down

    def to_json(self) -> dict:
        return {
            "small_max_pairs": self.small_max_pairs,
            "gemv": {
                name: asdict(tile) if tile else None
                for name, tile in (("gate_up", self.gemv_gate_up), ("down", self.gemv_down))
            },
            "buckets": {
                str(b): {"gate_up": asdict(g), "down": asdict(d)}
                for b, g, d in zip(self.buckets, self.gate_up, self.down)
            },
        }

    @classmethod
    def from_json(cls, data: dict) -> MoeTiles:
        buckets = sorted(int(b) for b in data["buckets"])
        return cls(
            small_max_pairs=int(data["small_max_pairs"]),
            gemv_gate_up=GemvTile(**data["gemv"]["gate_up"]) if data["gemv"]["gate_up"] else None,
            gemv_down=GemvTile(**data["gemv"]["down"]) if data["gemv"]["down"] else None,
            buckets=tuple(buckets),
            gate_up=tuple(GemmTile(**data["buckets"][str(b)]["gate_up"]) for b in buckets),
            down=tuple(GemmTile(**data["buckets"][str(b)]["down"]) for b in buckets),
        )


def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_")


def table_path(num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype, device: str) -> Path:
    dtype_name = str(dtype).removeprefix("torch.")
    return CONFIG_DIR / f"E={num_experts},I={intermediate},H={hidden},dtype={dtype_name},device={device}.json"


def default_tiles(num_experts: int) -> MoeTiles:
    """Tiles that are reasonable on any recent GPU: small tiles while each expert gets few rows."""
    buckets, gate_up = [], []
    for pairs in (64, 512, 4096, 1 << 30):
        per_expert = pairs / num_experts
        if per_expert <= 16:
            tile = GemmTile(16, 64, 128, 1, 4, 3)
        elif per_expert <= 64:
            tile = GemmTile(32, 64, 128, 8, 4, 3)
        else:
            tile = GemmTile(64, 128, 64, 8, 8, 3)
        buckets.append(pairs)
        gate_up.append(tile)
    return MoeTiles(
        small_max_pairs=8,
        gemv_gate_up=None,  # chosen per call from the shape and k: default_gemv_tiles
        gemv_down=None,
        buckets=tuple(buckets),
        gate_up=tuple(gate_up),
        down=tuple(gate_up),
    )


# elements of one K step's weight tile per program: 64 per thread at 4 warps, so that the
# tile, the prefetched next one and the products stay in registers
GEMV_TILE_ELEMS = 64 * 32 * 4
# at one token, the down kernel's programs are H / block_n: keep at least this many in flight
# (two per SM on a 132-SM H100/H200, and more on smaller cards)
MIN_DOWN_PROGRAMS = 256


def _dividing_block_k(k: int) -> int:
    """The largest of 512, 256, 128 that divides K (no masked tail); 128 otherwise."""
    return next((bk for bk in (512, 256, 128) if k % bk == 0), 128)


def default_gemv_tiles(top_k: int, intermediate: int, hidden: int, max_block_k: int | None = None,
                       ) -> tuple[GemvTile, GemvTile]:  # fmt: skip
    """Streaming tiles for an expert shape with no tuned table.

    gate_up: one pair per program row, 8 output rows of gate and of up over a K step that divides
    H, so a step is ~8K weight elements. down: all ``k`` slots at once over a K step that divides
    I, with block_n as wide as the element budget allows while a token still spreads over
    ``MIN_DOWN_PROGRAMS`` programs (qwen3-30b-a3b: [8, 4, 256], 512 programs; mixtral-8x7b:
    [2, 8, 512], 512 programs). ``max_block_k`` caps the K step (fp8 weights with 128-wide scale
    blocks); the rows per step grow to keep the step's elements (qwen3-30b-a3b fp8: gate_up [32, 128]).
    """
    cap = max_block_k or 512
    gu_k = min(_dividing_block_k(hidden), cap)
    gate_up = GemvTile(max(4, GEMV_TILE_ELEMS // (2 * gu_k)), gu_k, 4)
    dn_k = min(_dividing_block_k(intermediate), cap)
    slots = 1 << max(0, top_k - 1).bit_length()
    by_budget = max(1, GEMV_TILE_ELEMS // (slots * dn_k))
    by_programs = 1 << (max(1, hidden // MIN_DOWN_PROGRAMS).bit_length() - 1)
    return gate_up, GemvTile(min(by_budget, by_programs), dn_k, 4)


def tune_command(num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    return (
        f"{tables.TUNE_COMMAND} --tables moe --experts {num_experts} --intermediate {intermediate} "
        f"--hidden {hidden} --dtype {dtype_name}"
    )


def table_label(num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype) -> str:
    return f"moe E={num_experts},I={intermediate},H={hidden},{str(dtype).removeprefix('torch.')}"


@tables.reader_cache
@functools.lru_cache(maxsize=64)
def _load(num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype, device: str) -> MoeTiles:
    """This card's table (kernels/tables.py: the tune cache, then the shipped tables), else the defaults: the
    start-up line names the shapes that fell back, and this log line the command that tunes this one."""
    if device == "cpu":
        return default_tiles(num_experts)
    path = table_path(num_experts, intermediate, hidden, dtype, device)
    found = tables.find(f"{CONFIG_DIR.name}/{path.name}", device, MoeTiles.from_json,
                        table_label(num_experts, intermediate, hidden, dtype), legacy=path)  # fmt: skip
    if found:
        return found.table
    # the start-up line (kernels/tables.py) is the warning; this names the command for this one shape, which a
    # checkpoint that is not a preset needs
    logger.info(
        "no MoE tile table for experts=%d intermediate=%d hidden=%d dtype=%s on %s; using defaults; "
        "tune with: %s", num_experts, intermediate, hidden, dtype, device,
        tune_command(num_experts, intermediate, hidden, dtype),
    )  # fmt: skip
    return default_tiles(num_experts)


def moe_tiles(num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype, device: torch.device) -> MoeTiles:
    """The tile table for this rank's expert shapes on ``device``: tuned if a table serves this card, else defaults."""
    return _load(num_experts, intermediate, hidden, dtype, device_name(device))
