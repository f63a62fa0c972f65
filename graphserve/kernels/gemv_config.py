"""How a gemv call is tiled: a pure function of (M, N, K, SM count), chosen once per shape; and
where gemv is used at all: the measured routing rule (gemv_rule.json, written by benchmarks/gemv.py).

Kept apart from the kernel (kernels/gemv.py) so the choice can be read, tested and swept without the
launch code. No runtime autotuning: tuning inside a CUDA-graph capture is unsafe, and the kernel's
cost model is simple enough to state (bytes in flight per SM, registers per thread).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from graphserve.kernels import tables

MAX_M = 16
DOT_MIN_M = 5  # from 5 rows on, M fp32 FMAs per weight element approach the CUDA cores' peak
DOT_BLOCK_M = 16  # the smallest tile edge tl.dot accepts
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GemvConfig:
    """Tile sizes and launch shape of one gemv call."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool

    def num_programs(self, n: int) -> int:
        return triton.cdiv(n, self.block_n)


def _even_block_k(k: int, cap: int, floor: int) -> int:
    """The largest power of two <= cap that divides K (no masked tail), else cap itself."""
    cap = min(cap, triton.next_power_of_2(k))
    bk = cap
    while bk >= floor:
        if k % bk == 0:
            return bk
        bk //= 2
    return cap


def choose_config(m: int, n: int, k: int, sms: int) -> GemvConfig:
    """Tiles for an [m, k] x [n, k]^T product on a device with ``sms`` multiprocessors.

    Two resident programs per SM keep one slab's loads in flight while the other reduces, so
    ``block_n`` is the largest candidate that still yields ``2 * sms`` programs. tl.dot needs
    16-row weight tiles; where that leaves SMs idle (N = 1024 on 132 SMs gives 64 programs) the
    FMA product runs instead: even at M = 16 its multiply-adds cost about as much time as the
    weight read, while idle SMs would cap the read near half the card's bandwidth.
    """
    target = 2 * sms
    use_dot = m >= DOT_MIN_M and triton.cdiv(n, 16) >= sms
    if use_dot:
        # 4-8K-element weight tiles, 3 stages: at most ~75 KB of bf16 shared memory (weight + x
        # tiles), which far smaller GPUs than an H200 also have
        block_n = next((bn for bn in (64, 32) if triton.cdiv(n, bn) >= target), 16)
        block_k = _even_block_k(k, min(256, 8192 // block_n), 64)
        return GemvConfig(block_n, block_k, num_warps=4, num_stages=3, use_dot=True)
    # FMA: 4 warps. Its loads are not software-pipelined, so the bytes in flight per SM are the
    # tiles of its resident programs: each thread loads up to 128 weight elements per tile (16
    # loads of 16 bytes) at M <= 2, 64 at larger M where the per-row products need the registers.
    # A slab that fits one tile is loaded whole, its masked tail costing registers but no traffic.
    # At M <= 2 slabs of at most 8 columns: on an H200 Qwen3-0.6B's gate_up [6144 x 1024] ran in
    # 5.7 us with 768 programs of 8 columns against 6.1 us with 384 of 16 (benchmarks/gemv.py --sweep).
    tile = (128 if m <= 2 else 64) * 32 * 4
    widths = (8,) if m <= 2 else (32, 16, 8)
    block_n = next((bn for bn in widths if triton.cdiv(n, bn) >= target), 4)
    whole = triton.next_power_of_2(k)
    block_k = whole if block_n * whole <= tile else _even_block_k(k, tile // block_n, 256)
    return GemvConfig(block_n, block_k, num_warps=4, num_stages=2, use_dot=False)


# -- routing: where gemv beats cuBLAS, as measured ---------------------------------------------------
# benchmarks/gemv.py times each projection shape at 1-16 rows against cuBLAS and writes, per shape and
# kind of call, the largest row count up to which gemv won at every measured count, with the card it
# ran on, into gemv_rule.json beside this file (``graphserve tune``: into the per-user cache, kernels/tables.py).
# layers/linear.py routes by this card's table alone: a shape or card it does not list stays on cuBLAS.
RULE_PATH = Path(__file__).with_name("gemv_rule.json")
RULE_KINDS = ("linear", "silu_mul", "norm")  # plain projection; SiLU·mul fused in its loads; RMSNorm fused


@dataclass(frozen=True)
class GemvRule:
    """Largest row count per (kind, N, K) at which gemv is used on ``device``; 0 (cuBLAS) for the rest."""

    device: str
    limits: dict[tuple[str, int, int], int]

    def max_rows(self, kind: str, n: int, k: int) -> int:
        return self.limits.get((kind, n, k), 0)

    @classmethod
    def from_json(cls, data: dict) -> GemvRule:
        limits = {}
        for shape in data["shapes"]:
            for kind in RULE_KINDS:
                if shape.get(kind):
                    limits[(kind, int(shape["n"]), int(shape["k"]))] = int(shape[kind])
        return cls(str(data["device"]), limits)


@tables.reader_cache
@functools.lru_cache(maxsize=1)
def load_rule(path: str = str(RULE_PATH)) -> GemvRule:
    return GemvRule.from_json(json.loads(Path(path).read_text()))


_NO_RULE = GemvRule("", {})


@tables.reader_cache
@functools.lru_cache(maxsize=16)
def rule_for(device: torch.device) -> GemvRule:
    """This card's measured rule (kernels/tables.py: the tune cache, then the shipped tables); where none
    serves it, every call on cuBLAS (the start-up line names the command that measures it)."""
    found = tables.find(RULE_PATH.name, torch.cuda.get_device_name(device), GemvRule.from_json, "gemv")
    return found.table if found else _NO_RULE
