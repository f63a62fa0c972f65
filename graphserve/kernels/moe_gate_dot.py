"""The router's gate projection and softmax top-k on the tensor cores, in one launch, for decode batches
past kernels/moe_gate.py's FMA kernel (16-bit activations, up to ``DOT_MAX_ROWS`` rows).

``moe_gate_dot_softmax_topk`` tiles the logits into row blocks of ``DOT_BLOCK_T`` rows and expert blocks,
each program a ``tl.dot`` over its share of H (fp32 accumulate), and the last program of a row block sums
the shares in a fixed order, rounds them as the projection would, and runs the top-k of its rows. Unfused,
at 64 rows that is a cuBLAS GEMM (5.3 us on an H200 for qwen3-30b-a3b) and the top-k launch (2.35 us) with
a gap between them, per layer (benchmarks/RESULTS.md, decode steps by kernel at batch 64). Each row block
has its own done-counter: ``GATE_COUNTERS`` of them.

The argument checks both gate kernels share are here too (``checked_gate_args``, ``check_counter``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.l2_prefetch import issue_l2_prefetch, no_prefetch_args
from graphserve.kernels.l2_prefetch import plan as prefetch_plan
from graphserve.kernels.moe_routing import MAX_EXPERTS, _softmax_topk_store, topk_select
from graphserve.kernels.pdl import pdl_args, pdl_enter

# The tensor-core path takes 16-bit activations up to this many rows (a decode batch); past it the gate is a
# prefill chunk's GEMM, cuBLAS's job, and the top-k its own launch.
DOT_MAX_ROWS = 64
DOT_DTYPES = (torch.bfloat16, torch.float16)
# Rows per program there: tl.dot's smallest M. The last program of a row block runs the top-k of its rows, a
# chain of k argmax rounds over [rows, E] after all the dots: small row blocks run more of those side by side.
DOT_BLOCK_T = 16
GATE_COUNTERS = DOT_MAX_ROWS // DOT_BLOCK_T  # a layer's done-counters: one per row block of the largest batch
# Programs the tile choice aims at: about one per SM of an H200 (132).
DOT_PROGRAMS = 128
# The most splits of H: the last program of a row block reads every split's partial logits back ([16, E] fp32
# each, 8 KB at 128 experts) before its top-k, on the launch's critical path.
DOT_MAX_SPLIT_K = 4
DOT_BLOCK_K = 256  # columns per K step: 16 KB of x and weight tile a step at 16 rows and 16 experts


@triton.jit(do_not_specialize=["T"])  # batch-sized ints: see engine/warmup.py
def moe_gate_dot_softmax_topk_kernel(
    x_ptr, gate_ptr, partial_ptr, counter_ptr, weights_ptr, ids_ptr, T, stride_xt, stride_ge,
    pf_ptr, pf_bytes, pf_piece,
    E: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_EP: tl.constexpr, SPLIT_K: tl.constexpr, K_SPAN: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, EVEN_H: tl.constexpr, SELECT: tl.constexpr,
    PREFETCH: tl.constexpr, PF_THREADS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (row block, expert block, split): the fp32 partial logits of its rows and experts over columns
    [split * K_SPAN, (split + 1) * K_SPAN) of H, into ``partial_ptr`` [SPLIT_K, T, E]. The row block's last
    program sums the splits in order (the same sum at every launch and replay), rounds them as the gate
    projection writes its output, and runs the softmax top-k of the row block. ``PREFETCH``: first the program
    asks L2 for its share of the experts' first weights (kernels/l2_prefetch.py), before its PDL wait: no launch
    writes a weight."""
    if PREFETCH:
        issue_l2_prefetch(pf_ptr, pf_bytes, pf_piece,
                          (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2)
                          + tl.program_id(2), PF_THREADS)  # fmt: skip
    pdl_enter(PDL)
    pid_t, pid_e, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    experts = pid_e * BLOCK_EP + tl.arange(0, BLOCK_EP)
    # rows past T and experts past E re-read the last real ones, so the loads need no mask across them; never stored
    x_rows = tl.minimum(rows, T - 1).to(tl.int64)
    g_rows = tl.minimum(experts, E - 1).to(tl.int64)
    offs_k = pid_s * K_SPAN + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_EP), dtype=tl.float32)
    for k0 in range(0, K_SPAN, BLOCK_K):
        cols = k0 + offs_k
        x_ptrs = x_ptr + x_rows[:, None] * stride_xt + cols[None, :]
        w_ptrs = gate_ptr + g_rows[None, :] * stride_ge + cols[:, None]  # [BLOCK_K, BLOCK_EP]: the weight transposed
        if EVEN_H:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(cols < H)[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=(cols < H)[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
    out_mask = row_mask[:, None] & (experts < E)[None, :]
    tl.store(partial_ptr + (pid_s * T + rows[:, None]) * E + experts[None, :], acc, mask=out_mask)
    tl.debug_barrier()  # every thread's partials are written before the block counts itself done
    done = tl.atomic_add(counter_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(1) * tl.num_programs(2) - 1:
        cols = tl.arange(0, BLOCK_E)
        mask = row_mask[:, None] & (cols[None, :] < E)
        offs = rows[:, None] * E + cols[None, :]
        summed = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            # .cg: from L2, where the other programs' stores are, never from a stale L1 line
            summed += tl.load(partial_ptr + s * T * E + offs, mask=mask, other=0.0, cache_modifier=".cg")
        # rounded where the separate gate projection would write its output
        logits = summed.to(x_ptr.dtype.element_ty).to(tl.float32)
        _softmax_topk_store(logits, rows, row_mask, cols, weights_ptr, ids_ptr,
                            E, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_TOPK, SELECT)  # fmt: skip
        tl.atomic_xchg(counter_ptr + pid_t, 0, sem="relaxed", scope="gpu")


def dot_tiles(rows: int, num_experts: int) -> tuple[int, int]:
    """(BLOCK_EP, SPLIT_K) of the tensor-core path: experts per program, splits of H.

    At decode sizes the gate is a chain of loads, not arithmetic (qwen3-30b-a3b at 64 rows: 33 MFLOP against
    0.5 MB of weight and 256 KB of activations): a program's time is its bytes, (16 rows + BLOCK_EP experts) x
    H / SPLIT_K, so the choice is the most programs, up to about one per SM (``DOT_PROGRAMS``).
    - BLOCK_EP 16, tl.dot's smallest N: the most expert blocks (8 at 128 experts).
    - SPLIT_K, a power of two, as many as keep the programs within ``DOT_PROGRAMS`` and at most
      ``DOT_MAX_SPLIT_K``: each split costs the row block's tail one more [16, E] fp32 read before its top-k.
    The launch steps through a split ``DOT_BLOCK_K`` columns at a time (fewer if the split is narrower): a split
    of 512 columns is two steps, both in flight in the pipeline's three stages.

    The rows enter as their power-of-two bucket (row blocks of 16, 32, 64 rows): the warm-up runs a power of
    two in every bucket, so it compiles every variant (engine/warmup.py). At qwen3-30b-a3b's router (E 128,
    H 2048) that is 4 splits of 512 columns, 32 / 64 / 128 programs at 16 / 32 / 64 rows. On an H200 (a device
    log at d3a3710: block_ep 16, 32, 64 x splits 1, 2, 4, 8 through the overrides of
    ``moe_gate_dot_softmax_topk``, each timed as a CUDA graph of back-to-back calls without PDL) this pick was
    the fastest at 16, 32 and 64 rows, 8.9-9.2 us a call, where cuBLAS's gate GEMM, the logits' fp32 copy and
    moe_softmax_topk took 9.1-10.4 us timed the same way.
    """
    block_ep = 16
    row_blocks = triton.cdiv(triton.next_power_of_2(rows), DOT_BLOCK_T)
    room = max(1, DOT_PROGRAMS // (row_blocks * triton.cdiv(num_experts, block_ep)))
    return block_ep, min(DOT_MAX_SPLIT_K, 1 << (room.bit_length() - 1))


def moe_gate_dot_softmax_topk(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool, counter: torch.Tensor,
    *, block_ep: int | None = None, split_k: int | None = None, select: str | None = None,
    prefetch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``moe_gate_softmax_topk`` on the tensor cores, for 16-bit x [T, H] with T <= DOT_MAX_ROWS: one launch.

    ``counter`` is int32 with one entry per row block of ``DOT_BLOCK_T`` rows (``GATE_COUNTERS`` cover any T),
    zero before the call; the kernel leaves it zero. ``block_ep`` (experts per program, a power of two >= 16)
    and ``split_k`` (splits of H) override ``dot_tiles`` (tests, benchmarks); ``select``: the top-k's selection
    (kernels/moe_routing.TOPK_SELECTS, default ``TOPK_SELECT``). ``prefetch``: a weight whose first bytes the
    launch asks L2 for under the setting in force (kernels/l2_prefetch.py: the experts' ``w13``, which the
    grouped GEMM after the routing reads first).
    """
    t, h, e = checked_gate_args(x, gate_weight, top_k, DOT_MAX_ROWS)
    if x.dtype not in DOT_DTYPES:
        raise ValueError(f"the tensor-core gate takes x of {DOT_DTYPES}, got {x.dtype}")
    row_blocks = triton.cdiv(t, DOT_BLOCK_T)
    check_counter(counter, row_blocks, x.device)
    tile_ep, tile_split = dot_tiles(t, e)
    block_ep = tile_ep if block_ep is None else block_ep
    split_k = tile_split if split_k is None else split_k
    if block_ep < 16 or block_ep & (block_ep - 1):
        raise ValueError(f"block_ep={block_ep} must be a power of two >= 16 (tl.dot's smallest N)")
    if split_k < 1:
        raise ValueError(f"split_k={split_k} must be >= 1")
    consts = dot_constants(h, e, top_k, renormalize, block_ep, split_k, select)
    if x.stride(1) != 1:
        x = x.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    partial = torch.empty(consts["SPLIT_K"], t, e, dtype=torch.float32, device=x.device)
    grid = (row_blocks, triton.cdiv(e, block_ep), consts["SPLIT_K"])
    warps = dot_warps(e)
    pf = prefetch_plan(prefetch, grid[0] * grid[1] * grid[2], 32 * warps, "gate")
    moe_gate_dot_softmax_topk_kernel[grid](
        x, gate_weight, partial, counter, weights, ids, t, x.stride(0), gate_weight.stride(0),
        **(pf.kernel_args() if pf is not None else no_prefetch_args(x)), PF_THREADS=32 * warps, **consts,
        # the tail holds [16, E] fp32 a few times over: at 1024 experts 4 warps spill (256 bytes, sm_90 ptxas), 8 do not
        num_warps=warps, num_stages=3, **pdl_args(x.device, "moe_gate_dot_softmax_topk_kernel"),
    )  # fmt: skip
    return weights, ids


def dot_constants(h: int, e: int, top_k: int, renormalize: bool, block_ep: int, split_k: int,
                  select: str | None = None) -> dict:  # fmt: skip
    """The kernel's constexprs for a gate of ``e`` experts over ``h`` columns in ``split_k`` splits (fewer where a
    split would start past H, which would only add zeros); benchmarks/kernel_ptxas.py compiles the same ones."""
    block_k = max(16, min(DOT_BLOCK_K, triton.next_power_of_2(triton.cdiv(h, split_k))))
    k_span = triton.cdiv(triton.cdiv(h, block_k), split_k) * block_k
    splits = triton.cdiv(h, k_span)
    return {"E": e, "H": h, "TOP_K": top_k, "RENORMALIZE": renormalize, "BLOCK_T": DOT_BLOCK_T, "BLOCK_EP": block_ep,
            "SPLIT_K": splits, "K_SPAN": k_span, "BLOCK_K": block_k, "BLOCK_E": triton.next_power_of_2(e),
            "BLOCK_TOPK": triton.next_power_of_2(top_k), "EVEN_H": splits * k_span == h, "SELECT": topk_select(select)}


def dot_warps(e: int) -> int:
    return 4 if triton.next_power_of_2(e) <= 512 else 8


def checked_gate_args(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, max_rows: int) -> tuple[int, int, int]:
    """(T, H, E) of a call both kernels take, refused by name and limit otherwise."""
    if x.dim() != 2 or gate_weight.dim() != 2 or gate_weight.shape[1] != x.shape[1]:
        raise ValueError(f"need x [T, H] and gate weight [E, H], got {tuple(x.shape)} and {tuple(gate_weight.shape)}")
    t, h = x.shape
    e = gate_weight.shape[0]
    if not 0 < t <= max_rows:
        raise ValueError(f"fused gate takes 1..{max_rows} rows, got {t}; use the gate projection and moe_softmax_topk")
    if not 0 < e <= MAX_EXPERTS:
        raise ValueError(f"num_experts={e} must be in 1..{MAX_EXPERTS} for the routing kernel")
    if not 0 < top_k <= e:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={e}")
    if x.dtype != gate_weight.dtype or gate_weight.stride(1) != 1:
        raise ValueError(f"x {x.dtype} and gate weight {gate_weight.dtype} must match, the weight contiguous along H "
                         f"(got strides {gate_weight.stride()})")
    return t, h, e


def check_counter(counter: torch.Tensor, needed: int, device: torch.device) -> None:
    if counter.dtype != torch.int32 or counter.dim() != 1 or counter.numel() < needed or counter.device != device:
        raise ValueError(
            f"counter must be int32 [>= {needed}] (one per row block) on {device}, "
            f"got {counter.dtype} {tuple(counter.shape)} on {counter.device}"
        )
    if needed > 1 and counter.stride(0) != 1:
        raise ValueError(f"counter must be contiguous, got stride {counter.stride(0)}")
