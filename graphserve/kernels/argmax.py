"""Greedy sampling's argmax over the vocabulary: ``torch.argmax(logits, dim=-1)``, bit for bit, in two short launches.

torch's reduction takes 26-38 us on an H200 for bf16 logits [1 | 64, 128256], where reading them takes
at most 4 us, and a greedy decode step pays it every step. Here each row is split into chunks of whole
``BLOCK``-wide tiles so that even one row keeps dozens of SMs loading (one tile per program where the
batch allows). Program (row, chunk) reduces its chunk to one int64 partial; a second launch, one program
per row, takes the largest of the row's partials. The partials come from the caching allocator at a size
that depends on the shape alone, there is no atomic counter to keep zeroed between calls, and nothing is
read back to the host, so the pair is safe inside CUDA-graph capture; a last-program-combines variant
(kernels/fp8_gemv.py's split-K) would save the second launch at the price of a counter buffer per stream.
Graph-timed on an H200 (bf16, V = 128256): 2.8 us at batch 1 (torch 26.6), 8.7 at 64 (38.5; the read
alone 3.8), 29 at 256 (47; 15); fp32 at 256 rows 36 us (48).

Each lane keeps its running maximum in fp32 (exact from bf16 and fp16) with its first index: a value
replaces the lane's best only when greater, or a NaN while the lane holds none (torch's argmax takes NaN
as the maximum and returns the first NaN's index). A lane's best and index are then packed into one
int64 whose order is the argmax's: the value's order-preserving int32 key (-0.0 folded into +0.0, which
torch sees as equal; every NaN the largest; a negative value's magnitude bits flipped) above the index's
low 31 bits flipped, so among equal values the smaller index wins. A plain integer max over lanes, then
over chunks, gives the first index of the maximum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import interpreting, sm_count

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements per tile: with 4 warps, 16 per thread (two 16-byte loads in 16-bit, four in fp32). Against 4096-wide
# tiles, 8 warps and 4-8 programs per SM it was as fast or faster at batch 1-256 (within ~1 us at 1-64 rows,
# fp32 [256, 128256] 36 us against 41-48).
BLOCK = 2048
NUM_WARPS = 4
PROGRAMS_PER_SM = 16  # partial programs aimed at per SM (16 of 4 warps fill its 64 warp slots); fewer where
# the rows hold fewer tiles: batch 1 of 128256 runs 63 programs of one tile
KEY_MIN = tl.constexpr(-(2**31))  # below every value's key (-inf's is -0x7F800001)
KEY_NAN = tl.constexpr(2**31 - 1)  # above +inf's key (0x7F800000): NaN wins, as in torch.argmax
LAST_INDEX = tl.constexpr(2**31 - 1)  # an index is packed as LAST_INDEX - index (its low 31 bits flipped)
MAX_CHUNKS = 1024  # partials per row: the combine holds them all in one program's registers
MAX_VOCAB = 2**30  # lanes past the row's end index up to a chunk beyond it: all of them stay below 2**31


@triton.jit
def _pack(v, idx):
    """(value, index) as one int64 whose order is the argmax's: the value's order-preserving int32 key (-0.0
    folded into +0.0, every NaN the largest) above ``LAST_INDEX - index``, so a larger index loses a tie.
    ``index ^ LAST_INDEX`` is that difference for 0 <= index < 2**31 (and keeps the tensor on the left, which
    the interpreter's constexpr arithmetic needs)."""
    v = tl.where(v == 0.0, 0.0, v)
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(v != v, KEY_NAN, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits))
    return (key.to(tl.int64) << 32) | (idx ^ LAST_INDEX).to(tl.int64)


@triton.jit
def _lane_best(row_ptr, cols, V, best, best_idx):
    """A lane's running (maximum, its first index) after the values at ``cols``."""
    # each logit is read once: keep it from pushing the step's weights out of L2
    v = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
    # greater, or a NaN while the lane holds none yet: the lane's earlier index keeps a tie and its first NaN
    better = ~(v <= best) & (best == best)
    return tl.where(better, v, best), tl.where(better, cols, best_idx)


# The split follows the batch (``chunking``): CHUNKS and CHUNK stay unspecialized runtime values, so one compile
# serves every batch size and a batch the warm-up did not sample compiles nothing (engine/warmup.py).
@triton.jit(do_not_specialize=["CHUNKS", "CHUNK"])
def _argmax_partial_kernel(x_ptr, part_ptr, V, stride_row, CHUNKS, CHUNK, BLOCK: tl.constexpr,
                           WHILE_LOOP: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = x_ptr + row.to(tl.int64) * stride_row
    offs = chunk * CHUNK + tl.arange(0, BLOCK)
    # a lane that never moves holds -inf at its first index (a lane of -inf keeps its first); lanes past the
    # row's end load -inf and hold an index >= V, so they lose every tie with a real one
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = offs
    if WHILE_LOOP:  # the interpreter takes no runtime range bound (kernels/common.interpreting)
        start = tl.program_id(0) * 0
        while start < CHUNK:
            best, best_idx = _lane_best(row_ptr, offs + start, V, best, best_idx)
            start += BLOCK
    else:
        for start in range(0, CHUNK, BLOCK):
            best, best_idx = _lane_best(row_ptr, offs + start, V, best, best_idx)
    tl.store(part_ptr + row * CHUNKS + chunk, tl.max(_pack(best, best_idx), axis=0))


@triton.jit(do_not_specialize=["CHUNKS"])
def _argmax_combine_kernel(part_ptr, out_ptr, CHUNKS, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    lowest = tl.full((BLOCK_C,), KEY_MIN, tl.int64) << 32
    parts = tl.load(part_ptr + row * CHUNKS + offs, mask=offs < CHUNKS, other=0)
    top = tl.max(tl.where(offs < CHUNKS, parts, lowest), axis=0)
    tl.store(out_ptr + row, (top & LAST_INDEX) ^ LAST_INDEX)


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"greedy_argmax: logits must be a 2-D [batch, vocab] tensor of {FLOAT_DTYPES}, got shape "
                         f"{tuple(logits.shape)} dtype {logits.dtype}")
    if not 0 < logits.shape[1] <= MAX_VOCAB:
        raise ValueError(f"greedy_argmax: logits {tuple(logits.shape)} must have a vocab of 1 to {MAX_VOCAB} entries")


def chunking(batch: int, vocab: int, programs: int, block: int = BLOCK) -> tuple[int, int]:
    """(chunks per row, elements per chunk) for a [batch, vocab] launch aiming at ``programs`` partial programs:
    whole ``block``-wide tiles per chunk and no empty chunk, so a row's partials cover it in order."""
    tiles = triton.cdiv(vocab, block)
    per_chunk = triton.cdiv(tiles, max(1, min(tiles, triton.cdiv(programs, batch), MAX_CHUNKS)))
    chunk = per_chunk * block
    return triton.cdiv(vocab, chunk), chunk


def argmax_triton(logits: torch.Tensor, *, programs: int | None = None, block: int = BLOCK) -> torch.Tensor:
    """[B] int64: the index of each row's maximum through the two Triton launches, on any device Triton runs on
    (the interpreter's CPU too). Rows need unit stride along the vocab; any other layout is copied first.
    ``programs`` (partial programs aimed at; default PROGRAMS_PER_SM per SM) and ``block`` (a power of two)
    change the split, for tests that want many chunks of a short row and for timing other splits."""
    _check(logits)
    if block < 1 or block & (block - 1):
        raise ValueError(f"greedy_argmax: block must be a power of two, got {block}")
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if programs is None:
        programs = PROGRAMS_PER_SM * sm_count(logits.device)
    chunks, chunk = chunking(batch, vocab, programs, block)
    parts = torch.empty(batch, chunks, dtype=torch.int64, device=logits.device)
    _argmax_partial_kernel[(batch, chunks)](logits, parts, vocab, logits.stride(0), chunks, chunk, BLOCK=block,
                                            WHILE_LOOP=interpreting(), num_warps=NUM_WARPS)  # fmt: skip
    # every row's partials in one tile of MAX_CHUNKS lanes, whatever the split: one compile
    _argmax_combine_kernel[(batch,)](parts, out, chunks, BLOCK_C=MAX_CHUNKS, num_warps=4)
    return out


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """What the kernels compute: torch's argmax over the vocab (first index of the maximum, NaN the largest)."""
    _check(logits)
    return torch.argmax(logits, dim=-1)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64 greedy token ids of logits [B, V] (bf16, fp16 or fp32): the Triton pair on CUDA, torch's argmax
    elsewhere; the same ids either way, ties to the first index."""
    if logits.is_cuda:
        return argmax_triton(logits)
    return argmax_reference(logits)
