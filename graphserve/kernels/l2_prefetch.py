"""Warming the next projection's weights in L2 from the tail of the one before it.

A decode step at small batch is a chain of weight streams (an FP8 llama3-8b layer at batch 1: qkv 25 MB,
o_proj 17 MB, gate_up 117 MB, down 59 MB), each its own launch. A launch's first microsecond issues its
first loads and waits for them, and its last programs finish while most SMs sit idle: at 17-25 MB the
streaming matmul reaches about 58% of the read bandwidth the same run measured (benchmarks/RESULTS.md,
decode steps by kernel), where the 117 MB gate_up reaches 86%. Between qkv and o_proj run the rotary
embedding and decode attention, which at batch 1 read a few MB in several microseconds.

So a streaming matmul that knows which weight is read next (``Linear.l2_next``, linked by
``link_weight_stream``) asks L2 for its first bytes once its own main loop is done: the programs of its
last wave each issue one ``cp.async.bulk.prefetch.L2`` per thread for their share. Nothing waits on
those requests and no register holds their data; the next launch then finds its first lines in L2.
A weight is never written during a step, so an early request can never read a stale value, and a
prefetch that L2 drops only costs the bytes it moved.

The budget, bytes per link (``GRAPHSERVE_L2_PREFETCH_MB``; 0 turns it off, the default until a
measurement says otherwise), caps how much of the next weight is asked for: more than the tail can
move just shifts the next launch's reads earlier. ``l2_prefetch(mb)`` sets it in a scope (the
benchmark captures one graph per budget); a graph keeps the setting it was captured with.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import interpreting

ENV = "GRAPHSERVE_L2_PREFETCH_MB"
MODES = ("bulk", "lines")  # one cp.async.bulk.prefetch.L2 per thread, or prefetch.global.L2 per 128-byte line
LINKS = ("all", "attention")  # every link, or only those across attention (latency-bound kernels between)
# cp.async.bulk.prefetch takes a 16-byte aligned address and a multiple of 16 bytes; pieces are whole 128-byte
# lines, each at least 8 of them (a request per thread, the requests spread over one wave's programs)
PIECE_ALIGN = 16
LINE = 128
MIN_PIECE = 8 * LINE
_scoped: list[int] = []
_options: list[tuple[str, str]] = []


def options() -> tuple[str, str]:
    return _options[-1] if _options else ("bulk", "all")


def _parse_mb(text: str, where: str) -> int:
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not 0 <= mb <= 1024:
        raise ValueError(f"{where}={text!r}: the L2 prefetch budget must be a number of MB in 0..1024")
    return int(mb * (1 << 20))


@functools.lru_cache(maxsize=1)
def env_budget() -> int:
    """Bytes per link from GRAPHSERVE_L2_PREFETCH_MB (read once per process); 0 when unset."""
    return _parse_mb(os.environ.get(ENV, "0"), ENV)


def budget_bytes() -> int:
    return _scoped[-1] if _scoped else env_budget()


@contextlib.contextmanager
def l2_prefetch(mb: float, mode: str = "bulk", links: str = "all") -> Iterator[None]:
    """Streaming matmuls launched (or captured) in this scope warm up to ``mb`` MB of the next weight."""
    if mode not in MODES or links not in LINKS:
        raise ValueError(f"l2_prefetch: mode={mode!r} must be one of {MODES}, links={links!r} one of {LINKS}")
    _scoped.append(_parse_mb(str(mb), "l2_prefetch(mb)"))
    _options.append((mode, links))
    try:
        yield
    finally:
        _scoped.pop()
        _options.pop()


@functools.lru_cache(maxsize=8)
def _capable(device: torch.device) -> bool:
    # the bulk prefetch is Hopper's (sm_90); the interpreter runs no PTX
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


@dataclass(frozen=True)
class PrefetchPlan:
    """Launch arguments of one link: ``programs`` programs, the grid's last, each issue ``threads`` requests of
    ``piece`` bytes from ``weight``'s start, ``nbytes`` in all (a whole number of pieces, within the weight)."""

    weight: torch.Tensor
    nbytes: int
    piece: int
    first: int  # the first prefetching program, in launch order

    def kernel_args(self) -> dict:
        return {"pf_ptr": self.weight, "pf_bytes": self.nbytes, "pf_piece": self.piece, "pf_first": self.first}


def plan(next_weight: torch.Tensor | None, programs: int, threads: int, budget: int, resident: int) -> PrefetchPlan | None:
    """How a launch of ``programs`` programs of ``threads`` threads warms ``budget`` bytes of ``next_weight``:
    the last ``resident`` programs (about one wave: they finish last) share it. None where there is nothing
    to do (no link, no budget, no capable device)."""
    if next_weight is None or budget <= 0 or programs <= 0 or not _capable(next_weight.device):
        return None
    if not next_weight.is_contiguous():
        raise ValueError(f"l2 prefetch: the next weight must be contiguous, got strides {next_weight.stride()}")
    if next_weight.data_ptr() % PIECE_ALIGN:
        raise ValueError(f"l2 prefetch: the next weight's address must be {PIECE_ALIGN}-byte aligned")
    issuers = max(1, min(programs, resident))
    total = min(budget, next_weight.numel() * next_weight.element_size())
    piece = triton.cdiv(total, issuers * threads)
    piece = max(MIN_PIECE, triton.cdiv(piece, LINE) * LINE)
    nbytes = (total // piece) * piece  # whole pieces only: no request reaches past the weight
    if nbytes == 0:
        return None
    return PrefetchPlan(next_weight, nbytes, piece, programs - issuers)


@triton.jit
def issue_l2_prefetch(pf_ptr, pf_bytes, pf_piece, pf_first, lin, THREADS: tl.constexpr, LINES: tl.constexpr):
    """Program ``lin`` (launch order) of those from ``pf_first`` on asks L2 for its pieces of ``pf_ptr``'s
    first ``pf_bytes``: one bulk request per thread (``THREADS``: 32 x num_warps, one element each)."""
    if lin >= pf_first:
        t = tl.arange(0, THREADS)
        offs = ((lin - pf_first) * THREADS + t).to(tl.int64) * pf_piece
        want = (offs < pf_bytes).to(tl.int32)
        ptrs = pf_ptr.to(tl.pointer_type(tl.int8)) + offs
        if LINES:
            for i in range(0, pf_piece, 128):
                tl.inline_asm_elementwise(
                    "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\t@p prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;\n\t}",
                    "=r,l,r", [ptrs + i, want], dtype=tl.int32, is_pure=False, pack=1)
            return
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\t"
            "@p cp.async.bulk.prefetch.L2.global [$1], $3;\n\tmov.u32 $0, 0;\n\t}",
            "=r,l,r,r", [ptrs, want, tl.full([THREADS], 0, tl.int32) + pf_piece], dtype=tl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip
