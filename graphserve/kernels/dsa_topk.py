"""Top-k selection of the DSA indexer's scores on the device, with no host sync: a Triton radix select, and
``torch.topk`` over keys that make the tie rule exact; ``choose_topk_method`` picks the faster for the shape.

Both take each row's positions ``0..row_pos[t]`` only and break ties toward the lower position, so the
selected SET is the reference's (kernels/dsa_reference.topk_indices); the order inside a row is free.

Radix select (``_radix_topk_kernel``, one program a row): a score's fp32 bits are mapped to a uint32 that
orders as the floats do; four passes over the row each histogram one byte of the keys that still match
the prefix chosen so far (256 bins) and fix the next byte of the k-th largest key, so after the fourth the
threshold key is exact and the count of its equals still to take is known. A last pass writes every
position above the threshold and the lowest-positioned equals, compacted by a running count. A row with
at most k positions writes them all and -1 after. The row (512 KiB at 128k) is read five times by one program,
so the select's time grows with the row and stays flat with the row count while rows fit one wave (H100: 16 us
at 4k, 104 at 32k, ~420 at 128k for bs 1 to 64).

``torch.topk`` form (``topk_indices_torch``): the score's ordered bits in the high 32 bits of an int64 and
the inverted position in the low 32, so equal scores order by position and ``torch.topk`` on the int64
keys returns exactly the reference's set.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import interpreting

RADIX_BLOCK = 4096  # keys per step of a pass: 16 KiB of fp32, 16 per thread at 8 warps
TOPK_METHODS = ("auto", "triton", "torch")

# Cost models of the two selects at k = 2048, fitted to benchmarks/results/dsa_kernels.json (H100, commit 0db958d,
# CUDA-graph replay): the radix select runs one program a row, so its time grows with the row and not with the row
# count while rows fill one wave (16 us at 4k, 104 at 32k, 420 at 128k, the same at bs 1, 16, 64); torch.topk over
# the int64 keys grows with the elements (50-62 us at 4k, 97/119/192 at 32k and 125/202/650 at 128k for bs 1/16/64)
RADIX_US_PER_KEY = 3.25e-3
TORCH_US = 90.0
TORCH_US_PER_ELEMENT = 6.3e-5


def choose_topk_method(rows: int, length: int, sms: int) -> str:
    """The faster select by the cost models above, from static sizes only (a captured step keeps its choice):
    the radix select for short rows and for batches that fill the SMs, torch.topk for long rows of few sequences
    (bs 1 at 32k, bs 1-16 at 128k). torch's choice also bounds its int64 temporaries: it only wins below ~50 rows."""
    radix = RADIX_US_PER_KEY * length * -(-rows // max(sms, 1))
    torch_us = TORCH_US + TORCH_US_PER_ELEMENT * rows * length
    return "torch" if torch_us < radix else "triton"


@triton.jit
def _ordered(x):
    """fp32 -> uint32 that orders as the floats do (negative floats reversed, above them the positives)."""
    bits = x.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648  # all ones for a negative float, else just the sign bit
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def _hist_step(row, c0, n, prefix, hist, SHIFT: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """``hist`` plus the byte at ``SHIFT`` of the keys in [c0, c0 + BLOCK) whose higher bytes equal ``prefix``."""
    idx = c0 + tl.arange(0, BLOCK)
    match = idx < n
    key = _ordered(tl.load(row + idx, mask=match, other=0.0))
    if not FIRST:
        match = match & ((key >> (SHIFT + 8)) == prefix)
    return hist + tl.histogram(((key >> SHIFT) & 255).to(tl.int32), 256, mask=match)


@triton.jit
def _take_step(row, out_row, c0, n, threshold, need, taken, equal_seen, BLOCK: tl.constexpr):
    """Write the positions in [c0, c0 + BLOCK) above ``threshold``, and those equal to it while fewer than
    ``need`` equals were taken, after the ``taken`` written so far."""
    idx = c0 + tl.arange(0, BLOCK)
    inside = idx < n
    key = _ordered(tl.load(row + idx, mask=inside, other=0.0))
    eq = inside & (key == threshold)
    eq_rank = equal_seen + tl.cumsum(eq.to(tl.int32), 0)
    take = (inside & (key > threshold)) | (eq & (eq_rank <= need))
    slot = taken + tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(out_row + slot, idx.to(tl.int32), mask=take)
    return taken + tl.sum(take.to(tl.int32)), equal_seen + tl.sum(eq.to(tl.int32))


@triton.jit
def _radix_topk_kernel(
    scores_ptr, row_pos_ptr, out_ptr, length, stride_st, stride_ot, K: tl.constexpr,
    BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr, WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(row_pos_ptr + t) + 1, length)
    row = scores_ptr + t * stride_st
    out_row = out_ptr + t * stride_ot
    if n <= K:  # every position, then -1
        for c0 in range(0, K, OUT_BLOCK):
            o = c0 + tl.arange(0, OUT_BLOCK)
            tl.store(out_row + o, tl.where(o < n, o, -1), mask=o < K)
    else:
        bins = tl.arange(0, 256)
        prefix = tl.full([], 0, tl.uint32)  # the threshold key's bytes fixed so far
        need = tl.full([], K, tl.int32)  # positions still to take among the keys matching the prefix
        for p in tl.static_range(4):
            hist = tl.zeros([256], tl.int32)
            if WHILE_LOOP:  # the interpreter cannot take a loaded bound in range (kernels/common.py)
                c0 = 0
                while c0 < n:
                    hist = _hist_step(row, c0, n, prefix, hist, 24 - 8 * p, p == 0, BLOCK)
                    c0 += BLOCK
            else:
                for c0 in range(0, n, BLOCK):
                    hist = _hist_step(row, c0, n, prefix, hist, 24 - 8 * p, p == 0, BLOCK)
            # at_least[b]: matching keys whose byte is >= b; the threshold's byte is the largest b with
            # at_least[b] >= need
            at_least = tl.sum(hist) - tl.cumsum(hist, 0) + hist
            digit = tl.sum((at_least >= need).to(tl.int32)) - 1
            need -= tl.sum(tl.where(bins > digit, hist, 0))
            prefix = (prefix << 8) | digit.to(tl.uint32)
        # prefix is now the k-th largest key: everything above it and the first `need` equal to it
        taken = tl.full([], 0, tl.int32)
        equal_seen = tl.full([], 0, tl.int32)
        if WHILE_LOOP:
            c0 = 0
            while c0 < n:
                taken, equal_seen = _take_step(row, out_row, c0, n, prefix, need, taken, equal_seen, BLOCK)
                c0 += BLOCK
        else:
            for c0 in range(0, n, BLOCK):
                taken, equal_seen = _take_step(row, out_row, c0, n, prefix, need, taken, equal_seen, BLOCK)


def topk_indices_triton(
    scores: torch.Tensor, row_pos: torch.Tensor, k: int, out: torch.Tensor | None = None, block: int = RADIX_BLOCK,
) -> torch.Tensor:  # fmt: skip
    """The radix select; ``block`` (keys a step) is smaller in tests, to cross step edges in short rows."""
    tokens, length = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"scores {scores.dtype} with last stride {scores.stride(-1)}: float32, last dim contiguous")
    if out is None:
        out = torch.empty(tokens, k, dtype=torch.int32, device=scores.device)
    if tokens == 0:
        return out
    _radix_topk_kernel[(tokens,)](
        scores, row_pos, out, length, scores.stride(0), out.stride(0), K=k,
        BLOCK=block,  # not sized by the row's length: one compile serves every context (engine/warmup.py)
        OUT_BLOCK=min(1024, triton.next_power_of_2(k)), WHILE_LOOP=interpreting(), num_warps=8,
    )  # fmt: skip
    return out


def topk_indices_torch(scores: torch.Tensor, row_pos: torch.Tensor, k: int) -> torch.Tensor:
    """``torch.topk`` on int64 keys (ordered score bits, then the inverted position): the exact tie rule."""
    tokens, length = scores.shape
    bits = scores.float().contiguous().view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()  # signed order equals the floats'
    pos = torch.arange(length, device=scores.device)
    valid = pos[None, :] <= row_pos.long()[:, None]
    ordered = torch.where(valid, ordered, torch.iinfo(torch.int32).min)
    keys = ordered * (1 << 32) + ((1 << 32) - 1 - pos)[None, :]
    picked = torch.topk(keys, min(k, length), dim=-1, sorted=False).indices
    picked = torch.where(torch.gather(valid, 1, picked), picked, -1).to(torch.int32)
    if picked.shape[1] == k:
        return picked
    out = torch.full((tokens, k), -1, dtype=torch.int32, device=scores.device)
    out[:, : picked.shape[1]] = picked
    return out
