"""Weights asked of L2 ahead of the launch that reads them, from a launch that leaves the memory system idle.

A decode step is a chain of launches. The large ones stream weights; between them run small ones (routing,
sums, norms, attention at small batch) that read little from DRAM. A small launch can ask L2 for the first bytes
of the weight the step streams next: each of its programs issues ``cp.async.bulk.prefetch.L2`` requests for a
share of them. Nothing waits on the requests and no register holds their data; the next weight stream then finds
its first lines in L2. A weight is never written during a step, so no request can read a stale value, and one
for bytes the step does not read costs only the bytes it moved (the floors, models/description.decode_read_bytes,
never count them). Two links (``LINKS``), each with its own budget a layer:

- ``gate``: the router's tensor-core gate (kernels/moe_gate_dot.py) asks for the first bytes of this rank's ``w13``
  stack. At decode batches past the streaming path (qwen3-30b-a3b at 64 tokens: 512 pairs over 128 experts) the
  grouped GEMM reads nearly every expert, 400 MB of fp8 gate_up a layer, after a chain of small launches (the
  norm and the activations' quantization, the gate and top-k, the sort: about 15 us a layer on an H200,
  benchmarks/RESULTS.md, decode steps by kernel). Its programs walk the sorted pairs' tiles in order and the sort
  orders the runs by expert id, so its first wave reads the lowest local experts. The routing is not known when
  the requests go out, but a given expert is touched with probability 1 - (1 - k/E)^T (0.98 at 64 tokens, top-8
  of 128): calls below ``MIN_TOUCHED`` do not ask. The requests go out before the gate's PDL wait, overlapping the
  tail of the launches before it; issued after the program's own dot products instead, they delayed the routing's
  tail more than they saved (every budget measured slower than none: results/expert_prefetch_places.json).
- ``slot_sum``: after the experts, the slot sum (kernels/moe_gemm.moe_sum_kernel) and the next layer's norm run
  before its qkv projection streams; the slot sum asks, before its wait, for that weight (``FusedMoE.read_next``,
  linked by models/moe.py), on the grouped GEMM path at any batch.

Two more links measured no gain and are not kept: decode attention asking for the output projection's weight
after its own loads (llama3-8b fp8 at batch 1 and 64, qwen3-30b-a3b fp8 at batch 64:
results/l2_prefetch_attention_bs*.json), and the down GEMM's first wave asking for its own first ``w2`` bytes before
its wait, while gate_up drains (qwen3-30b-a3b fp8 at batch 64: results/l2_prefetch_down.json).

``DEFAULT_MB`` holds the budgets measured best; ``GRAPHSERVE_L2_PREFETCH_MB`` sets every link's (0 turns them
off). Budgets are capped below L2's size so the requested lines are not evicted by each other before they are
read. ``l2_prefetch(mb, **per_link)`` sets them in a scope (benchmarks capture one graph per setting; a graph
keeps the setting it was captured with).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphserve import env
from graphserve.kernels.common import interpreting, pushed

ENV = "GRAPHSERVE_L2_PREFETCH_MB"
# The launches that ask, and for which weight: the router's gate for the experts' w13, the slot sum for the next
# layer's qkv.
LINKS = ("gate", "slot_sum")
# MB a layer each link asks for. qwen3-30b-a3b fp8, batch 64, ctx 2048, one H200 (benchmarks.expert_prefetch,
# results/expert_prefetch_budgets.json): the step took 13.270 ms with the gate asking nothing, 13.050 / 13.047 /
# 13.075 / 13.102 / 13.149 ms asking 16 / 24 / 32 / 40 / 48 MB; with the slot sum asking 24 MB as well, 12.832 ms
# against 13.100 with neither (results/expert_prefetch_links.json).
DEFAULT_MB = {"gate": 24.0, "slot_sum": 24.0}
MAX_MB = 48.0  # below an H200's 60 MB L2: more would evict its own first lines before the GEMM reads them
# a call asks only where an expert is this likely to be touched (64 tokens, top-8 of 128: 0.98; 32 tokens: 0.87)
MIN_TOUCHED = 0.9
# cp.async.bulk.prefetch takes a 16-byte aligned address and a size that is a multiple of 16 bytes; each
# request is whole 128-byte lines, at least 8 of them
LINE = 128
MIN_PIECE = 8 * LINE
_scoped: list[dict[str, int]] = []


def _parse_mb(text: str, where: str) -> int:
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not 0 <= mb <= MAX_MB:
        raise ValueError(f"{where}={text!r}: an L2 prefetch budget must be a number of MB in 0..{MAX_MB:g}")
    return int(mb * (1 << 20))


@functools.lru_cache(maxsize=1)
def env_budgets() -> dict[str, int]:
    """Bytes a layer per link: every link GRAPHSERVE_L2_PREFETCH_MB where set (read once per process), else
    ``DEFAULT_MB``."""
    if env.is_set(ENV):
        return dict.fromkeys(LINKS, _parse_mb(env.get(ENV), ENV))
    return {link: _parse_mb(str(mb), f"DEFAULT_MB[{link!r}]") for link, mb in DEFAULT_MB.items()}


def budget_bytes(link: str) -> int:
    """Bytes a layer in force for ``link`` (``LINKS``): the innermost scope's, else the environment's."""
    if link not in LINKS:
        raise ValueError(f"link={link!r} must be one of {LINKS}")
    return (_scoped[-1] if _scoped else env_budgets())[link]


@contextlib.contextmanager
def l2_prefetch(mb: float | None = None, **per_link: float) -> Iterator[None]:
    """Launches made (or captured) in this scope ask L2 for up to ``mb`` MB on every link, ``per_link`` naming a
    link's own (``l2_prefetch(slot_sum=16)``); a link named in neither keeps the budget in force outside."""
    unknown = sorted(set(per_link) - set(LINKS))
    if unknown:
        raise ValueError(f"l2_prefetch: {', '.join(unknown)} is not a link; links: {LINKS}")
    budgets = {link: budget_bytes(link) for link in LINKS}
    for link in LINKS:
        value = per_link.get(link, mb)
        if value is not None:
            budgets[link] = _parse_mb(str(value), f"l2_prefetch({link})")
    with pushed(_scoped, budgets):
        yield


def worth_prefetching(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a call of ``tokens`` tokens touches each expert with probability at least ``MIN_TOUCHED`` under
    routing spread evenly: the experts asked for are then almost surely read."""
    return 1.0 - (1.0 - top_k / num_experts) ** tokens >= MIN_TOUCHED


@functools.lru_cache(maxsize=8)
def _capable(device: torch.device) -> bool:
    # the bulk prefetch is Hopper's (sm_90); the interpreter runs no PTX
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


@dataclass(frozen=True)
class PrefetchPlan:
    """``programs`` x ``threads`` requests of ``piece`` bytes each cover ``weight``'s first ``nbytes``."""

    weight: torch.Tensor
    nbytes: int
    piece: int

    def kernel_args(self) -> dict:
        return {"pf_ptr": self.weight, "pf_bytes": self.nbytes, "pf_piece": self.piece, "PREFETCH": True}


def plan(weight: torch.Tensor | None, programs: int, threads: int, link: str) -> PrefetchPlan | None:
    """How a launch of ``programs`` programs of ``threads`` threads asks for the first bytes of ``weight`` under
    ``link``'s budget in force; None where there is nothing to ask (no weight, no budget, a device without the bulk
    prefetch)."""
    budget = budget_bytes(link)
    if weight is None or budget <= 0 or programs <= 0 or not _capable(weight.device):
        return None
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        raise ValueError(f"L2 prefetch ({link}): the weight must be contiguous and 16-byte aligned, got strides "
                         f"{weight.stride()} at {weight.data_ptr():#x}")  # fmt: skip
    total = min(budget, weight.numel() * weight.element_size())
    piece = max(MIN_PIECE, triton.cdiv(triton.cdiv(total, programs * threads), LINE) * LINE)
    nbytes = total // piece * piece  # whole pieces only: no request reaches past the weight
    return PrefetchPlan(weight, nbytes, piece) if nbytes else None


def no_prefetch_args(like: torch.Tensor) -> dict:
    """The kernel arguments of a launch that asks for nothing."""
    return {"pf_ptr": like, "pf_bytes": 0, "pf_piece": LINE, "PREFETCH": False}


@triton.jit
def issue_l2_prefetch(pf_ptr, pf_bytes, pf_piece, program, THREADS: tl.constexpr):
    """Program ``program`` (its linear index in the grid) asks L2 for its pieces of ``pf_ptr``'s first
    ``pf_bytes``: one bulk request per thread (``THREADS``: 32 x num_warps, one element each)."""
    offs = (program * THREADS + tl.arange(0, THREADS)).to(tl.int64) * pf_piece
    want = (offs < pf_bytes).to(tl.int32)
    ptrs = pf_ptr.to(tl.pointer_type(tl.int8)) + offs
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $3;\n\t"
        "mov.u32 $0, 0;\n\t}",
        "=r,l,r,r", [ptrs, want, tl.full([THREADS], 0, tl.int32) + pf_piece], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip
