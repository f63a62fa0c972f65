"""Sort/align: group the (token, slot) pairs by expert into runs padded to the GEMM's BLOCK_M.

The grouped GEMM gives each BLOCK_M-row tile one expert, so the pairs of expert e must occupy
whole tiles. No launch reads anything back to the host.

Up to SINGLE_PROGRAM_MAX_PAIRS pairs (decode batches) it is one launch, ``moe_align_offsets_kernel``
with COUNT: every program counts all the pairs itself (they are read from L2), takes the padded run
starts by a cumulative sum, writes the expert and the padding of its own tiles, and places one slice
of the pairs without atomics: a pair's slot is its expert's run start plus the routed pairs of that
expert with a lower index: a histogram of the pairs before its slice plus a comparison within it.
Within a run the pairs are in pair order, as in the reference. This folds in the atomic scatter launch, which took about 1.5 us
plus a 0.7 us gap after the offsets kernel per MoE layer on an H200 (qwen3-30b-a3b, batch 64).

Beyond that, three launches, so no loop of one program grows with the batch:
1. ``moe_count_kernel``: pairs per global expert, atomics of per-program histograms.
2. ``moe_align_offsets_kernel`` without COUNT: run starts from those counts, also stored as the
   scatter's cursors, and each tile's expert and padding.
3. ``moe_align_scatter_kernel``: each routed pair claims a slot in its expert's run with an atomic
   increment. Order within a run is arbitrary; every row of a tile is computed independently,
   so the results do not depend on it.
The counts are also the layer's ``expert_counts`` telemetry, so padding rows are masked out. The
sentinel goes only to the slots past each run's pairs: pair stores and sentinel stores touch disjoint
slots, each slot is written once, and no ordering between programs or launches is needed. Every
buffer is sized from T * k alone (worst case T * k + E_local * (BLOCK_M - 1) slots), so the sort lives
inside CUDA graphs. Reference: kernels/moe_reference.moe_align_reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphserve.kernels.pdl import pdl_args, pdl_enter

_BLOCK_P = 128  # pairs per program in the count and scatter kernels
# Up to this many pairs (a decode batch of 128 at k = 8) the offsets kernel counts them all (each of its
# programs the same) and places them, one launch in all; beyond it the count is a grid of atomic
# per-program histograms into a zeroed buffer and the placing an atomic scatter, so no single loop grows
# with the batch.
SINGLE_PROGRAM_MAX_PAIRS = 1024
HISTOGRAM_PAIRS = 512  # pairs per step of a one-program histogram: a decode batch of 64 at k = 8 in one
# the offsets kernel's warps and tiles a program: benchmarks.step_breakdown reports the kernel per launch
_OFFSETS_WARPS = 8
OWNER_TILES = 32
# pairs a program places at small batches: up to SINGLE_PROGRAM_MAX_PAIRS / _PAIR_SLICE programs, each with
# [_PAIR_SLICE, E_local] and [_PAIR_SLICE, _PAIR_SLICE] comparisons besides its histograms
_PAIR_SLICE = 64


@triton.jit
def _routed(ids_ptr, valid_ptr, offs, num_pairs, expert_start, TOP_K: tl.constexpr, E_LOCAL: tl.constexpr,
            HAS_VALID: tl.constexpr):  # fmt: skip
    """(local expert id, routed mask) of pairs ``offs``: a real token, an expert on this rank."""
    mask = offs < num_pairs
    local = tl.load(ids_ptr + offs, mask=mask, other=-1) - expert_start
    mask = mask & (local >= 0) & (local < E_LOCAL)
    if HAS_VALID:
        mask = mask & (tl.load(valid_ptr + offs // TOP_K, mask=offs < num_pairs, other=0) != 0)
    return local, mask


@triton.jit
def pair_histogram(ids_ptr, valid_ptr, num_pairs, expert_start, TOP_K: tl.constexpr, NUM_BINS: tl.constexpr,
                   HAS_VALID: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """Routed pairs [0, num_pairs) per expert in [expert_start, expert_start + NUM_BINS), read by one program.

    No atomics in memory and no zeroed buffer, so a small batch's count costs no extra launch;
    ``tl.histogram`` bins each step of BLOCK_P pairs. A while loop: the interpreter cannot take a runtime
    scalar as a range bound (kernels/common.py); the counter starts as an int32 tensor, not a Python 0,
    so its loop-carried type never changes.
    """
    hist = tl.zeros((BLOCK_E,), dtype=tl.int32)
    p0 = tl.program_id(0) * 0
    while p0 < num_pairs:
        offs = p0 + tl.arange(0, BLOCK_P)
        ids, mask = _routed(ids_ptr, valid_ptr, offs, num_pairs, expert_start, TOP_K, NUM_BINS, HAS_VALID)
        hist += tl.histogram(tl.where(mask, ids, 0), BLOCK_E, mask=mask)
        p0 += BLOCK_P
    return hist


@triton.jit(do_not_specialize=["num_pairs"])  # batch-sized ints: see engine/warmup.py
def moe_count_kernel(ids_ptr, valid_ptr, counts_ptr, num_pairs, TOP_K: tl.constexpr, E: tl.constexpr,
                     HAS_VALID: tl.constexpr, SINGLE: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_E: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Pairs per global expert: one program storing the whole histogram (SINGLE), or per-program
    histograms added atomically into a zeroed buffer (large batches)."""
    pdl_enter(PDL)
    experts = tl.arange(0, BLOCK_E)
    if SINGLE:
        hist = pair_histogram(ids_ptr, valid_ptr, num_pairs, 0, TOP_K, E, HAS_VALID, BLOCK_P, BLOCK_E)
        tl.store(counts_ptr + experts, hist, mask=experts < E)
    else:
        offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        ids, mask = _routed(ids_ptr, valid_ptr, offs, num_pairs, 0, TOP_K, E, HAS_VALID)
        hist = tl.histogram(tl.where(mask, ids, 0), BLOCK_E, mask=mask)
        tl.atomic_add(counts_ptr + experts, hist, mask=(experts < E) & (hist > 0))


@triton.jit
def _place_pairs(ids_ptr, valid_ptr, sorted_ids_ptr, run_starts, num_pairs, expert_start, TOP_K: tl.constexpr,
                 E_LOCAL: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                 SLICE: tl.constexpr):  # fmt: skip
    """Store pairs [p * SLICE, (p + 1) * SLICE) of program p at their slots, with no atomics.

    A pair's slot is its expert's run start plus the routed pairs of that expert with a lower index:
    those before the slice by a histogram of pairs [0, p * SLICE), those in it by a [SLICE, SLICE]
    comparison. The work of a program is thus bounded by one pass over the pairs, not by one over
    every earlier pair for each of its own; the order within a run is pair order.
    """
    first = tl.program_id(0) * SLICE
    if first < num_pairs:  # the grid also covers the tiles, which may outnumber the slices
        pairs = first + tl.arange(0, SLICE)
        local, routed = _routed(ids_ptr, valid_ptr, pairs, num_pairs, expert_start, TOP_K, E_LOCAL, HAS_VALID)
        before = pair_histogram(ids_ptr, valid_ptr, first, expert_start, TOP_K, E_LOCAL, HAS_VALID, BLOCK_P,
                                BLOCK_E)  # fmt: skip
        # the reductions run along axis 0: a thread then sums its own rows before any exchange between threads
        slot = tl.sum(tl.where(tl.arange(0, BLOCK_E)[:, None] == local[None, :], (run_starts + before)[:, None], 0),
                      axis=0)  # fmt: skip
        earlier = routed[:, None] & (local[:, None] == local[None, :]) & (pairs[:, None] < pairs[None, :])
        slot += tl.sum(earlier.to(tl.int32), axis=0)
        tl.store(sorted_ids_ptr + slot, pairs, mask=routed)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])  # batch-sized ints: see engine/warmup.py
def moe_align_offsets_kernel(
    ids_ptr, valid_ptr, counts_ptr, cursor_ptr, expert_ids_ptr, sorted_ids_ptr, num_post_ptr,
    expert_start, num_pairs, max_blocks,
    TOP_K: tl.constexpr, E: tl.constexpr, E_LOCAL: tl.constexpr, HAS_VALID: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EG: tl.constexpr, BLOCK_P: tl.constexpr,
    OWNER_BLOCK: tl.constexpr, PAIR_SLICE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program p: every run's padded end, then the expert of tiles [p * OWNER_BLOCK, (p + 1) * OWNER_BLOCK)
    and the sentinel in their slots past their run's pairs. Every program derives the ends itself (the
    pairs are read from L2 by each), so the tile and slot writes, which grow with the batch, need no serial
    loop and no second launch. With COUNT (a small batch) program p also counts the pairs and places slice
    p of them (``_place_pairs``; the grid covers both the tiles and the slices); without, the scatter
    places them and program 0 stores the run starts as its cursors. Program 0 stores the counts (with
    COUNT) and the padded total."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    in_range = experts < E_LOCAL
    if COUNT:  # a small batch: count here too, saving the count launch
        hist = pair_histogram(ids_ptr, valid_ptr, num_pairs, 0, TOP_K, E, HAS_VALID, BLOCK_P, BLOCK_EG)
        if pid == 0:
            tl.store(counts_ptr + tl.arange(0, BLOCK_EG), hist, mask=tl.arange(0, BLOCK_EG) < E)
        if E_LOCAL == E:
            counts = hist
        else:
            counts = pair_histogram(ids_ptr, valid_ptr, num_pairs, expert_start, TOP_K, E_LOCAL, HAS_VALID,
                                    BLOCK_P, BLOCK_E)  # fmt: skip
    else:
        counts = tl.load(counts_ptr + expert_start + experts, mask=in_range, other=0)
    padded = tl.where(in_range, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)  # inclusive: where each run ends
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    if pid == 0:
        if not COUNT:
            tl.store(cursor_ptr + experts, starts, mask=in_range)
        tl.store(num_post_ptr, total)
    blocks = pid * OWNER_BLOCK + tl.arange(0, OWNER_BLOCK)
    start = blocks * BLOCK_M
    # a tile's expert is the number of runs that end at or before its start (empty runs included)
    owner = tl.sum(((ends[None, :] <= start[:, None]) & in_range[None, :]).to(tl.int32), axis=1)
    owner = tl.where(start < total, owner, -1)
    tl.store(expert_ids_ptr + blocks, owner, mask=blocks < max_blocks)
    # the sentinel only past the pairs of the tile's run (all of a tile past the total): a pair's slot is
    # written by whichever program placed the pair (or by the scatter), and a sentinel stored there too could
    # land after it and erase it
    pairs_end = tl.sum(tl.where(owner[:, None] == experts[None, :], (starts + counts)[None, :], 0), axis=1)
    slots = start[:, None] + tl.arange(0, BLOCK_M)[None, :]
    sentinel = tl.zeros((OWNER_BLOCK, BLOCK_M), dtype=tl.int32) + num_pairs
    tl.store(sorted_ids_ptr + slots, sentinel, mask=(slots >= pairs_end[:, None]) & (blocks < max_blocks)[:, None])
    if COUNT:
        _place_pairs(ids_ptr, valid_ptr, sorted_ids_ptr, starts, num_pairs, expert_start, TOP_K, E_LOCAL, HAS_VALID,
                     BLOCK_E, BLOCK_P, PAIR_SLICE)  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])  # batch-sized ints: see engine/warmup.py
def moe_align_scatter_kernel(
    ids_ptr, valid_ptr, cursor_ptr, sorted_ids_ptr, num_pairs, expert_start,
    TOP_K: tl.constexpr, E_LOCAL: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    local, mask = _routed(ids_ptr, valid_ptr, offs, num_pairs, expert_start, TOP_K, E_LOCAL, HAS_VALID)
    slot = tl.atomic_add(cursor_ptr + local, 1, mask=mask)
    tl.store(sorted_ids_ptr + slot, offs.to(tl.int32), mask=mask)


@dataclass(frozen=True)
class MoeAlignment:
    """The sort the grouped GEMM reads. ``num_post_padded`` is a 1-element device tensor."""

    sorted_ids: torch.Tensor  # int32 [max_blocks * block_m], pair ids, sentinel T * k in the padding
    expert_ids: torch.Tensor  # int32 [max_blocks], local expert of each tile, -1 past the padded total
    num_post_padded: torch.Tensor  # int32 [1]
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.expert_ids.numel()


def max_padded_pairs(num_pairs: int, num_local_experts: int, block_m: int) -> int:
    """Worst-case slots of the sorted list: every expert's run may end with block_m - 1 padding."""
    return triton.cdiv(num_pairs + num_local_experts * (block_m - 1), block_m) * block_m


def _valid_arg(valid: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like if valid is None else valid.view(torch.uint8)


def moe_count(topk_ids: torch.Tensor, valid: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
    """Fill ``counts`` (int32 [E]) with the routed pairs per global expert; padding rows excluded."""
    num_pairs, top_k, e = topk_ids.numel(), topk_ids.shape[1], counts.numel()
    single = num_pairs <= SINGLE_PROGRAM_MAX_PAIRS
    if not single:
        counts.zero_()
    block_e = triton.next_power_of_2(e)
    grid = (1,) if single else (triton.cdiv(num_pairs, _BLOCK_P),)
    moe_count_kernel[grid](
        topk_ids, _valid_arg(valid, topk_ids), counts, num_pairs,
        TOP_K=top_k, E=e, HAS_VALID=valid is not None, SINGLE=single,
        BLOCK_P=HISTOGRAM_PAIRS if single else _BLOCK_P, BLOCK_E=block_e, **pdl_args(topk_ids.device, "moe_count_kernel"),
    )  # fmt: skip
    return counts


def moe_align(
    topk_ids: torch.Tensor,
    valid: torch.Tensor | None,
    counts: torch.Tensor,
    expert_start: int,
    num_local_experts: int,
    block_m: int,
) -> MoeAlignment:
    """Count (into ``counts``, global experts) and sort the routed pairs into BLOCK_M tiles per local expert."""
    if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous int32, got {topk_ids.dtype} strides {topk_ids.stride()}")
    if valid is not None and (valid.dtype != torch.bool or valid.shape != topk_ids.shape[:1]):
        raise ValueError(f"valid must be a bool mask [{topk_ids.shape[0]}], got {valid.dtype} {tuple(valid.shape)}")
    if expert_start + num_local_experts > counts.numel():
        raise ValueError(f"experts {expert_start}..{expert_start + num_local_experts} exceed counts [{counts.numel()}]")
    device, num_pairs, top_k = topk_ids.device, topk_ids.numel(), topk_ids.shape[1]
    slots = max_padded_pairs(num_pairs, num_local_experts, block_m)
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=device)
    expert_ids = torch.empty(slots // block_m, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    count_here = num_pairs <= SINGLE_PROGRAM_MAX_PAIRS
    programs = triton.cdiv(slots // block_m, OWNER_TILES)
    if count_here:  # one launch: the offsets kernel places the pairs itself and never writes a cursor
        cursor = num_post
        programs = max(programs, triton.cdiv(num_pairs, _PAIR_SLICE))
    else:
        moe_count(topk_ids, valid, counts)
        cursor = torch.empty(num_local_experts, dtype=torch.int32, device=device)
    block_e, block_eg = triton.next_power_of_2(num_local_experts), triton.next_power_of_2(counts.numel())
    moe_align_offsets_kernel[(programs,)](
        topk_ids, _valid_arg(valid, topk_ids), counts, cursor, expert_ids, sorted_ids, num_post,
        expert_start, num_pairs, slots // block_m,
        TOP_K=top_k, E=counts.numel(), E_LOCAL=num_local_experts, HAS_VALID=valid is not None, COUNT=count_here,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_EG=block_eg, BLOCK_P=HISTOGRAM_PAIRS, OWNER_BLOCK=OWNER_TILES,
        PAIR_SLICE=_PAIR_SLICE, num_warps=_OFFSETS_WARPS,
        **pdl_args(topk_ids.device, "moe_align_offsets_kernel"),
    )  # fmt: skip
    if not count_here:
        moe_align_scatter_kernel[(triton.cdiv(num_pairs, _BLOCK_P),)](
            topk_ids, _valid_arg(valid, topk_ids), cursor, sorted_ids, num_pairs, expert_start,
            TOP_K=top_k, E_LOCAL=num_local_experts, HAS_VALID=valid is not None, BLOCK_P=_BLOCK_P, **pdl_args(topk_ids.device, "moe_align_scatter_kernel"),
        )  # fmt: skip
    return MoeAlignment(sorted_ids, expert_ids, num_post, block_m)
