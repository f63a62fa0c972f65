"""How an MLA attention call is tiled and split (kernels/mla_attention.py), and the measured rule that
picks the decode tile per (heads, batch, context): mla_tiles.json, written by ``benchmarks/mla.py --sweep``.

Kept apart from the kernel so the choice can be read, tested and swept without the launch code. No
runtime autotuning: tuning inside a CUDA-graph capture is unsafe. Every input of the choice is a
static size of the step -- heads, batch (the captured size under graphs) and the block-table
capacity in tokens (``max_model_len`` under graphs) -- so a captured grid never changes on replay.
Where no table serves this card (kernels/tables.py: the tune cache, then the shipped tables), the code
defaults below apply.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from graphserve.kernels import tables

# At small batch a split's time is load latency (queries, block ids, then a few tiles in flight),
# not bandwidth, so short splits over many programs beat long ones: a bs-1 step at 16k context takes
# 16 steps of 32 tokens per program at 32 splits, 4 at 128. Merging reads 2 KiB of fp32 partial per
# split and head.
MAX_SPLITS = 128
MIN_SPLIT_TOKENS = 64  # each split keeps at least this much context


@dataclass(frozen=True)
class MLATile:
    """One program's work and launch shape.

    ``token_major=False`` (head-major): the score tile is ``[heads, tokens]``, so ``q_lat`` is the
    left operand of ``q·cᵀ`` and ``p·c`` accumulates ``[heads, 512]``. ``token_major=True``: the
    transposed products ``c·qᵀ`` and ``cᵀ·pᵀ``, whose row count is the context tokens of a step (64
    and up fills a Hopper warpgroup's MMA however few heads there are) and whose resident operand
    ``qᵀ`` can stay in shared memory instead of being copied into every warp's registers.
    ``occupancy`` is the resident programs per SM the split count aims to fill (registers and shared
    memory decide it; the sweep measures it). ``block_t`` query tokens per program (extend only).
    """

    token_major: bool
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    occupancy: int = 2
    block_t: int = 1

    def __post_init__(self) -> None:
        for field in ("block_h", "block_n"):
            value = getattr(self, field)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MLATile.{field}={value}: a power of two >= 16 (the smallest tl.dot edge)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"MLATile.num_warps={self.num_warps}: one of 1, 2, 4, 8, 16")
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"MLATile.num_stages={self.num_stages}: between 1 and 6")
        if not 1 <= self.occupancy <= 8:
            raise ValueError(f"MLATile.occupancy={self.occupancy}: between 1 and 8 programs per SM")
        if self.block_t < 1 or self.block_t & (self.block_t - 1):
            raise ValueError(f"MLATile.block_t={self.block_t}: a power of two >= 1")

    @property
    def name(self) -> str:
        form = "tm" if self.token_major else "hm"
        extend = f"t{self.block_t}" if self.block_t > 1 else ""
        return f"{form}-h{self.block_h}n{self.block_n}w{self.num_warps}s{self.num_stages}o{self.occupancy}{extend}"

    @classmethod
    def parse(cls, name: str) -> MLATile:
        """The inverse of ``name``: ``"tm-h16n64w4s3o2"`` (``t2`` at the end for extend tiles)."""
        m = re.fullmatch(r"(hm|tm)-h(\d+)n(\d+)w(\d+)s(\d+)o(\d+)(?:t(\d+))?", name)
        if not m:
            raise ValueError(f"MLA tile name {name!r}: expected like 'tm-h16n64w4s3o2' (form-h·n·w·s·o·[t·])")
        form, bh, bn, w, s, o, t = m.groups()
        return cls(form == "tm", int(bh), int(bn), int(w), int(s), int(o), int(t or 1))


# Code defaults (no rule, another card). Few heads: head-major, 16 heads x 32 tokens per step, 4
# warps, 3 stages: two tiles in flight per program while the other is multiplied; for sm_90 ptxas
# gives 190 registers and Triton 91 KiB of shared memory, so two programs fit an SM (occupancy 2).
# The first sweep (one buffer, benchmarks/results/mla.json) had this tile fastest at bs 64, ctx 4096
# (2,658 GB/s against 1,845 for 16 tokens per step). Many heads: 64 per program, so V3's 128 heads
# read each tile twice instead of 8 times (at 242 FLOPs per cache byte V3 is bound by the tensor
# cores, which need 64-row products: a Hopper warpgroup MMA); 8 warps, 228 registers, 144 KiB.
DECODE_FEW_HEADS = MLATile(False, 16, 32, 4, 3, occupancy=2)
DECODE_MANY_HEADS = MLATile(False, 64, 32, 8, 2, occupancy=1)
# extend: 2 query tokens x 16 heads per program; 8 warps keep 32 rows x 512 fp32 spill-free
EXTEND = MLATile(False, 16, 16, 8, 2, occupancy=1, block_t=2)
# fp32 (tests, CPU interpreter): twice the bytes per tile, so half the tile and no pipelining
DECODE_FP32 = MLATile(False, 16, 16, 4, 1, occupancy=2)
EXTEND_FP32 = MLATile(False, 16, 16, 8, 1, occupancy=1, block_t=2)
# The fallback when a tile does not fit a card's shared memory, for 16-bit queries: the smallest
# footprint of the candidates (sm_90: 37 KiB of shared memory, 128 registers, benchmarks/mla_ptxas.py)
# and one every GPU test runs. Not DECODE_FP32's single-stage build: in bf16 at r = 512 it takes 50 KiB
# and no test had run it on a GPU when the first sweep (which used it as its reference) died at its
# first launch with an illegal memory access.
SAFE_DECODE = MLATile(False, 16, 16, 4, 2, occupancy=2)


def fallback_decode_tile(dtype: torch.dtype) -> MLATile:
    """The decode tile run when the chosen one does not fit this card."""
    return DECODE_FP32 if dtype == torch.float32 else SAFE_DECODE


def default_decode_tile(heads: int, dtype: torch.dtype) -> MLATile:
    if dtype == torch.float32:
        return DECODE_FP32
    return DECODE_FEW_HEADS if heads <= 16 else DECODE_MANY_HEADS


def extend_tile(dtype: torch.dtype) -> MLATile:
    return EXTEND_FP32 if dtype == torch.float32 else EXTEND


def choose_num_splits(batch: int, head_blocks: int, max_context: int, num_sms: int, occupancy: int = 2) -> int:
    """Splits per sequence from static sizes only (``max_context`` is the block-table capacity).

    Programs run in waves of ``occupancy x SMs``; a last wave that is mostly empty costs as much as a
    full one, so the count is chosen for full waves (flash-decoding's heuristic): the fewest splits
    whose wave efficiency is within 85% of the best, one when the batch already fills a wave.
    """
    slots = occupancy * num_sms
    programs = batch * head_blocks
    useful = min(MAX_SPLITS, max(1, math.ceil(max_context / MIN_SPLIT_TOKENS)))
    if programs >= 0.8 * slots or useful == 1:
        return 1

    def efficiency(splits: int) -> float:
        waves = programs * splits / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, useful + 1))
    return next(s for s in range(1, useful + 1) if efficiency(s) >= 0.85 * best)


# -- the measured rule ------------------------------------------------------------------------------
RULE_PATH = Path(__file__).with_name("mla_tiles.json")


CACHE_KINDS = ("model", "fp8")  # a latent cache in the model dtype, or in fp8 e4m3 (--kv-cache-dtype fp8_e4m3)


def cache_kind(dtype: torch.dtype) -> str:
    """The rule's name for a latent cache of ``dtype``."""
    return "fp8" if dtype.itemsize == 1 else "model"


def _dist(a: int, b: int) -> float:
    return abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))


@dataclass(frozen=True)
class MLARule:
    """Measured decode tiles per (cache kind, heads, batch, context) on ``device``; calls between the measured
    points take the nearest one (in log scale: heads first, then batch and context together). A cache kind
    with no entries of its own takes the model-dtype cache's (an entry without ``cache`` is one)."""

    device: str
    entries: tuple[tuple[str, int, int, int, MLATile], ...]  # (cache kind, heads, batch, context, tile)

    def tile(self, heads: int, batch: int, max_context: int, cache: str = "model") -> MLATile | None:
        rows = self._rows(heads, cache)
        if not rows:
            return None
        return min(rows, key=lambda e: (_dist(e[1], batch) + _dist(e[2], max_context), -e[1], -e[2]))[3]

    def tiles_for(self, heads: int, cache: str = "model") -> tuple[MLATile, ...]:
        """Every tile ``tile`` may return for ``heads`` and ``cache`` at some batch and context, each once (by
        name): a served step's batch and block-table width are any the scheduler makes, so the warm-up
        (engine/warmup.py) compiles them all rather than the few its short prompts reach. Empty: no rule."""
        return tuple(sorted({e[3] for e in self._rows(heads, cache)}, key=lambda t: t.name))

    def _rows(self, heads: int, cache: str) -> list[tuple[int, int, int, MLATile]]:
        """The entries of ``cache`` (else the model dtype's) at the measured head count nearest ``heads``."""
        entries = [e[1:] for e in self.entries if e[0] == cache] or [e[1:] for e in self.entries if e[0] == "model"]
        if not entries:
            return []
        near_heads = min(_dist(h, heads) for h, _, _, _ in entries)
        return [e for e in entries if _dist(e[0], heads) == near_heads]

    @classmethod
    def from_json(cls, data: dict) -> MLARule:
        entries = []
        for i, e in enumerate(data["entries"]):
            for key in ("heads", "bs", "ctx", "tile"):
                if key not in e:
                    raise ValueError(f"{RULE_PATH.name} entries[{i}] has no {key!r}: {e}")
            if e.get("cache", "model") not in CACHE_KINDS:
                raise ValueError(f"{RULE_PATH.name} entries[{i}] cache={e['cache']!r}: one of {', '.join(CACHE_KINDS)}")
            entries.append((e.get("cache", "model"), int(e["heads"]), int(e["bs"]), int(e["ctx"]),
                            MLATile.parse(e["tile"])))
        return cls(str(data["device"]), tuple(entries))


_NO_RULE = MLARule("", ())


@tables.reader_cache
@functools.lru_cache(maxsize=1)
def load_rule(path: str = str(RULE_PATH)) -> MLARule:
    """The rule file, or no rule when it does not exist (the code defaults apply)."""
    file = Path(path)
    if not file.exists():
        return _NO_RULE
    return MLARule.from_json(json.loads(file.read_text()))


@tables.reader_cache
@functools.lru_cache(maxsize=16)
def rule_for(device: torch.device) -> MLARule:
    """This card's measured rule (kernels/tables.py: the tune cache, then the shipped tables), else none (the
    code defaults; the start-up line names the command that measures it)."""
    if device.type != "cuda":
        return _NO_RULE
    found = tables.find(RULE_PATH.name, torch.cuda.get_device_name(device), MLARule.from_json, "mla")
    return found.table if found else _NO_RULE


@tables.reader_cache
@functools.lru_cache(maxsize=4096)  # called per layer and step: eager decode must not search the rule each time
def decode_tile(heads: int, batch: int, max_context: int, dtype: torch.dtype, device: torch.device,
                cache: str = "model") -> MLATile:
    """The decode tile of a call (queries in ``dtype``, a latent cache of kind ``cache``): the measured rule's
    for this card, else the code default."""
    if dtype == torch.float32:
        return DECODE_FP32
    return rule_for(device).tile(heads, batch, max_context, cache) or default_decode_tile(heads, dtype)


def decode_tiles(heads: int, dtype: torch.dtype, device: torch.device, cache: str = "model") -> tuple[MLATile, ...]:
    """Every tile ``decode_tile`` may return for ``heads``, ``dtype`` and ``cache`` on ``device``, whatever the
    batch and context: what the warm-up compiles (kernels/mla_attention.warm_tiles)."""
    if dtype == torch.float32:
        return (DECODE_FP32,)
    return rule_for(device).tiles_for(heads, cache) or (default_decode_tile(heads, dtype),)


def warm_split_counts(max_context: int) -> list[int]:
    """Split counts that reach every specialization a decode call up to ``max_context`` tokens of block-table
    capacity compiles: one (the kernel writes the output itself) and, for the merge, whose ``BLOCK_S`` is the
    next power of two of the count, each power of two up to that of the most useful splits."""
    useful = min(MAX_SPLITS, max(1, math.ceil(max_context / MIN_SPLIT_TOKENS)))
    top = 1 << (useful - 1).bit_length()
    return [1] + [1 << i for i in range(1, top.bit_length())]
