"""Multi-head latent attention in the absorbed form, over the paged latent cache (decode and extend).

Inputs are in latent space: ``q_lat [T, H, r]`` (the query's no-rope part already multiplied by
``W_UK``), ``q_rope [T, H, d]`` (rotated) and the cache ``[num_blocks, page, 1, r + d]`` whose rows
are the latent ``c`` then the rope key; bf16/fp16, or fp8 e4m3 (scale 1.0, layers/kv_layout.py)
widened as it loads: to the query's dtype, or, for bf16 queries, to fp16 with the queries rounded to fp16
(clamped to its range) and the probabilities in fp16, as the dense decode kernel does
(kernels/decode_attention.py: the e4m3 -> fp16 conversion is one instruction per two elements and exact).
Scores are ``q_lat·c + q_rope·k_rope``; the values are
the latents themselves, so one loaded tile ``[BLOCK_N, r + d]`` serves both products and every
head of the program: a program owns ``BLOCK_T`` query tokens x ``BLOCK_H`` heads of one sequence
(all of a model's heads when they fit one block) and reads each tile of its context once. The
output ``o_lat [T, H, r]`` goes back through ``W_UV`` outside.

Two layouts of the same math (kernels/mla_config.MLATile): head-major, scores ``[heads, tokens]``;
token-major, the transposed products ``c·qᵀ`` and ``cᵀ·pᵀ``, whose MMA rows are context tokens.
The latent dim is not cut into chunks for ``P·V``: both products need the whole 576-wide row, so
every chunk stays resident until the probabilities exist and a stage's shared memory (``BLOCK_N x
576``) would not shrink; ``BLOCK_N`` and the stage count trade footprint against loads in flight.

Decode (``BLOCK_T = 1``) splits each context into ``num_splits`` pieces ("flash-decoding"): the
grid is (head block, sequence, split), each split writes (log-sum-exp, normalised partial) and a
second kernel merges them; at one split the program writes the output itself and no merge is
launched. Tile and split count come from kernels/mla_config.py, from static sizes only (batch,
heads, block-table width), never from ``seq_lens`` values, so a decode step captures in a CUDA graph.

The extend path (causal, ``BLOCK_T`` query tokens per program, one split) reads the paged cache in
place. The engine does not use it: on the H200 the expanded form (``kv_b_proj`` over the context,
then SDPA, layers/mla_expanded.py) was faster at every chunk size measured, 16 to 2048 tokens on a
4096-token prefix, by 1.02-1.25x (benchmarks/results/mla.json: 0.73 against 0.91 ms at 16 tokens, 6.11
against 7.45 ms at 2048, 10.3 against 12.2 ms for V3's 128 heads at 512), so layers/mla_expanded.py runs
prefill and extend and this path stays as the absorbed form's reference point, timed beside it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from graphserve.kernels.common import interpreting, sm_count
from graphserve.kernels.fp8_quant import fp16_saturated
from graphserve.kernels.mla_config import (
    MAX_SPLITS,
    MLATile,
    cache_kind,
    choose_num_splits,
    decode_tile,
    extend_tile,
    fallback_decode_tile,
    warm_split_counts,
)
from graphserve.kernels.online_softmax import online_softmax_step
from graphserve.kernels.pdl import pdl_args, pdl_enter

LOG2E = 1.4426950408889634
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
logger = logging.getLogger("graphserve.mla")


@triton.jit
def _block_ids(bt_row, n0, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache block of each context token in [n0, n0 + BLOCK_N) (0, the dummy block, past ``end``)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(bt_row + offs_n // PAGE, mask=offs_n < end, other=0)


@triton.jit
def _mla_step(
    q_lat, q_rope, q_pos, m_i, l_i, acc, n0, end, block, cache_ptr, stride_cblk, stride_coff, scale_log2,
    offs_r, r_mask, offs_d, d_mask, RANK: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    TOKEN_MAJOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over context tokens [n0, n0 + BLOCK_N): one cache tile, both products.

    Head-major: ``q_lat [R, r]``, ``acc [R, r]``; token-major: ``q_lat [r, R]``, ``acc [r, R]``
    (R = the program's rows, BLOCK_T x BLOCK_H). ``m_i``, ``l_i`` and ``q_pos`` are ``[R]`` either way.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    base = block.to(tl.int64) * stride_cblk + (offs_n % PAGE) * stride_coff
    # fp8 caches widen here (to fp16 where the queries are bf16: one instruction per two elements, where the
    # chain to bf16 takes several); for a cache in the query's dtype the casts are no-ops
    c = tl.load(cache_ptr + base[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                other=0.0).to(q_lat.dtype)
    k_rope = tl.load(cache_ptr + base[:, None] + RANK + offs_d[None, :],
                     mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(q_lat.dtype)
    if TOKEN_MAJOR:
        s = tl.dot(c, q_lat, input_precision=DOT_PRECISION)  # [BLOCK_N, R]
        s += tl.dot(k_rope, q_rope, input_precision=DOT_PRECISION)
        visible = n_mask[:, None] & (offs_n[:, None] <= q_pos[None, :])
    else:
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)  # [R, BLOCK_N]
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
    # the latent is the values too (MLA's K = V = c)
    return online_softmax_step(s, visible, c, m_i, l_i, acc, scale_log2, TOKEN_MAJOR, DOT_PRECISION)


# Batch- and context-sized ints (the split count, the block-table width, the lse strides that follow the split
# count) stay unspecialized, and so does the alignment of the per-sequence int32 rows (an eager decode step's block
# table and query starts are views into one upload at offsets that follow the batch, engine/runner.py): a compile
# per tile then serves every batch and context (engine/warmup.py)
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_ml_t", "stride_ml_h"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "q_start_ptr"])
def _mla_attention_kernel(
    q_lat_ptr, q_rope_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, q_start_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    scale_log2, num_splits, num_heads,
    stride_qlt, stride_qlh, stride_qrt, stride_qrh,
    stride_cblk, stride_coff, stride_bt,
    stride_ot, stride_oh,
    stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, ROPE: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
    TOKEN_MAJOR: tl.constexpr, DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr, WHILE_LOOP: tl.constexpr,
    WIDEN_FP16: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    # token/head blocks on axis 0 (up to 2^31 programs: a long chunk of V3's 128 heads exceeds the
    # 65535 that axes 1 and 2 allow), sequences on axis 1
    seq = tl.program_id(1)
    n_hblocks = tl.cdiv(num_heads, BLOCK_H)
    tblock = tl.program_id(0) // n_hblocks
    hblock = tl.program_id(0) % n_hblocks
    split = tl.program_id(2)
    q_start = tl.load(q_start_ptr + seq)
    qlen = tl.load(q_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    t_local = tblock * BLOCK_T + rows // BLOCK_H
    head = hblock * BLOCK_H + rows % BLOCK_H
    row_mask = (t_local < qlen) & (head < num_heads)
    tok = (q_start + t_local).to(tl.int64)
    q_pos = seq_len - qlen + t_local  # each row's absolute position: it sees keys 0 .. q_pos
    # keys this program needs: up to its last real token's position
    last = tl.minimum((tblock + 1) * BLOCK_T, qlen)
    ctx_end = tl.where(tblock * BLOCK_T < qlen, seq_len - qlen + last, 0)
    split_len = tl.cdiv(tl.cdiv(ctx_end, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx_end)

    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < ROPE
    m_i = tl.full([BLOCK_T * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T * BLOCK_H], dtype=tl.float32)
    q_lat_rows = q_lat_ptr + tok * stride_qlt + head * stride_qlh
    q_rope_rows = q_rope_ptr + tok * stride_qrt + head * stride_qrh
    if TOKEN_MAJOR:  # the queries as [r, rows]: the right-hand operand of c·qᵀ
        q_lat = tl.load(q_lat_rows[None, :] + offs_r[:, None], mask=row_mask[None, :] & r_mask[:, None], other=0.0)
        q_rope = tl.load(q_rope_rows[None, :] + offs_d[:, None], mask=row_mask[None, :] & d_mask[:, None], other=0.0)
        acc = tl.zeros([BLOCK_R, BLOCK_T * BLOCK_H], dtype=tl.float32)
    else:
        q_lat = tl.load(q_lat_rows[:, None] + offs_r[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        q_rope = tl.load(q_rope_rows[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_R], dtype=tl.float32)
    if WIDEN_FP16:  # an fp8 cache widens to fp16 in the steps: the queries too, clamped to fp16's range
        q_lat, q_rope = fp16_saturated(q_lat), fp16_saturated(q_rope)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Each step's block ids are loaded one step ahead and carried into the next: when the tile's
    # address depends on a load in the same step, Triton's pipeliner gives the tile one shared-memory
    # buffer whatever num_stages is (the next tile can only start once this one is consumed); carried,
    # num_stages - 1 tiles stay in flight (for sm_90: 91 KiB of buffers at 32 tokens and 3 stages,
    # against 55 KiB at any stage count before).
    if WHILE_LOOP:  # the interpreter cannot take loaded values as range bounds (kernels/common.py)
        n0 = start
        block = _block_ids(bt_row, n0, end, PAGE, BLOCK_N)
        while n0 < end:
            next_block = _block_ids(bt_row, n0 + BLOCK_N, end, PAGE, BLOCK_N)
            m_i, l_i, acc = _mla_step(
                q_lat, q_rope, q_pos, m_i, l_i, acc, n0, end, block, cache_ptr, stride_cblk, stride_coff,
                scale_log2, offs_r, r_mask, offs_d, d_mask, RANK, PAGE, BLOCK_N, TOKEN_MAJOR, DOT_PRECISION,
            )  # fmt: skip
            block = next_block
            n0 += BLOCK_N
    else:
        block = _block_ids(bt_row, start, end, PAGE, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            next_block = _block_ids(bt_row, n0 + BLOCK_N, end, PAGE, BLOCK_N)
            m_i, l_i, acc = _mla_step(
                q_lat, q_rope, q_pos, m_i, l_i, acc, n0, end, block, cache_ptr, stride_cblk, stride_coff,
                scale_log2, offs_r, r_mask, offs_d, d_mask, RANK, PAGE, BLOCK_N, TOKEN_MAJOR, DOT_PRECISION,
            )  # fmt: skip
            block = next_block

    inv_l = tl.where(l_i > 0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)  # no visible key (padding): output 0
    if TOKEN_MAJOR:
        o = acc * inv_l[None, :]
        col = offs_r[:, None]
        mask = row_mask[None, :] & r_mask[:, None]
        out_rows = (tok * stride_ot + head * stride_oh)[None, :]
        mid_rows = (tok * stride_mo_t + head * stride_mo_h + split * stride_mo_s)[None, :]
    else:
        o = acc * inv_l[:, None]
        col = offs_r[None, :]
        mask = row_mask[:, None] & r_mask[None, :]
        out_rows = (tok * stride_ot + head * stride_oh)[:, None]
        mid_rows = (tok * stride_mo_t + head * stride_mo_h + split * stride_mo_s)[:, None]
    if DIRECT:
        tl.store(out_ptr + out_rows + col, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(mid_o_ptr + mid_rows + col, o, mask=mask)
        tl.store(mid_lse_ptr + tok * stride_ml_t + head * stride_ml_h + split, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_ml_t", "stride_ml_h"])  # as the attention kernel's
def _mla_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, num_splits,
    stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, stride_ot, stride_oh,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Merge the splits of one (token, head): weights from every split's log-sum-exp, then the
    partials summed CHUNK_S splits at a time (a [128, 512] fp32 tile would not fit in registers)."""
    pdl_enter(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    lse_base = mid_lse_ptr + tok * stride_ml_t + head * stride_ml_h
    lse = tl.load(lse_base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (a padding row): output 0
    total = tl.sum(tl.exp2(lse - m), 0)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    s0 = 0
    while s0 < num_splits:  # a while loop: the interpreter cannot take a scalar argument as a range bound
        offs_c = s0 + tl.arange(0, CHUNK_S)
        c_mask = offs_c < num_splits
        w = tl.exp2(tl.load(lse_base + offs_c, mask=c_mask, other=float("-inf")) - m)
        o = tl.load(mid_o_ptr + tok * stride_mo_t + head * stride_mo_h + offs_c[:, None] * stride_mo_s
                    + offs_r[None, :], mask=c_mask[:, None] & r_mask[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        s0 += CHUNK_S
    merged = acc / tl.maximum(total, 1e-30)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_r, merged.to(out_ptr.dtype.element_ty), mask=r_mask)


_UNFIT: set[MLATile] = set()  # tiles whose launch ran out of shared memory on this card


def mla_attention(
    q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *, max_query_len: int,
    out: torch.Tensor | None = None, num_splits: int | None = None, tile: MLATile | None = None,
) -> torch.Tensor:  # fmt: skip
    """``o_lat [T, H, r]`` of absorbed causal attention (see the module doc).

    ``q_lat [T, H, r]`` and ``q_rope [T, H, d]`` may be strided views (the last dim contiguous);
    ``cache [num_blocks, page, 1, r + d]`` in the query's dtype or fp8 e4m3; ``block_tables
    [B, max_blocks]`` int32; ``seq_lens [B]`` context lengths including the new tokens;
    ``query_start_loc [B + 1]``. ``max_query_len == 1`` selects the split-KV decode path. ``tile`` and
    ``num_splits`` override the choice of kernels/mla_config.py (tests and the sweep).
    """
    tokens, num_heads, rank = q_lat.shape
    rope = q_rope.shape[-1]
    if cache.shape[-1] != rank + rope or cache.shape[2] != 1:
        raise ValueError(f"cache rows are {tuple(cache.shape[2:])}, expected (1, {rank + rope}) for r={rank}, d={rope}")
    if q_lat.stride(-1) != 1 or q_rope.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError(f"mla_attention needs the last dim of q_lat, q_rope and cache contiguous (stride 1), got "
                         f"{q_lat.stride(-1)}, {q_rope.stride(-1)}, {cache.stride(-1)}")
    if cache.dtype not in CACHE_DTYPES or (cache.dtype.itemsize > 1 and cache.dtype != q_lat.dtype):
        raise ValueError(f"cache dtype {cache.dtype} with queries in {q_lat.dtype}: the cache is in the "
                         f"queries' dtype or float8_e4m3fn")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits}: between 1 and {MAX_SPLITS} (the merge loads every split's lse)")
    if out is None:
        out = torch.empty_like(q_lat)
    batch = seq_lens.shape[0]
    if tokens == 0 or batch == 0:
        return out
    decode = max_query_len == 1
    if tile is None:
        capacity = block_tables.shape[1] * cache.shape[1]
        tile = decode_tile(num_heads, batch, capacity, q_lat.dtype, q_lat.device, cache_kind(cache.dtype)) \
            if decode else extend_tile(q_lat.dtype)
    fallback = fallback_decode_tile(q_lat.dtype) if decode else extend_tile(torch.float32)
    if tile in _UNFIT:
        tile = fallback
    args = (q_lat, q_rope, cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, out, num_splits)
    try:
        _launch(*args, tile)
    except OutOfResources as e:
        if tile == fallback:
            raise
        logger.warning("MLA tile %s does not fit this GPU (%s); using %s", tile.name, e, fallback.name)
        _UNFIT.add(tile)
        _launch(*args, fallback)
    return out


def _launch(q_lat, q_rope, cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, out, num_splits,
            tile: MLATile) -> None:  # fmt: skip
    tokens, num_heads, rank = q_lat.shape
    batch = seq_lens.shape[0]
    decode = max_query_len == 1
    block_t = 1 if decode else tile.block_t
    head_blocks = triton.cdiv(num_heads, tile.block_h)
    if not decode:
        num_splits = 1
    elif num_splits is None:
        num_splits = choose_num_splits(batch, head_blocks, block_tables.shape[1] * cache.shape[1],
                                       sm_count(q_lat.device), tile.occupancy)
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = out  # unused when DIRECT
    else:
        mid_o = torch.empty(tokens, num_heads, num_splits, rank, dtype=torch.float32, device=q_lat.device)
        mid_lse = torch.empty(tokens, num_heads, num_splits, dtype=torch.float32, device=q_lat.device)
    block_r = triton.next_power_of_2(rank)
    grid = (triton.cdiv(max_query_len, block_t) * head_blocks, batch, num_splits)
    _mla_attention_kernel[grid](
        q_lat, q_rope, cache, block_tables, seq_lens, query_start_loc, out, mid_o, mid_lse,
        scale * LOG2E, num_splits, num_heads,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1),
        cache.stride(0), cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if not direct else 0,
        mid_lse.stride(0), mid_lse.stride(1),
        RANK=rank, BLOCK_R=block_r, ROPE=q_rope.shape[-1], BLOCK_D=max(16, triton.next_power_of_2(q_rope.shape[-1])),
        PAGE=cache.shape[1], BLOCK_N=tile.block_n, BLOCK_H=tile.block_h, BLOCK_T=block_t,
        TOKEN_MAJOR=tile.token_major, DIRECT=direct, DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        WHILE_LOOP=interpreting(), WIDEN_FP16=cache.dtype.itemsize == 1 and q_lat.dtype == torch.bfloat16,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_args(q_lat.device, "_mla_attention_kernel"),
    )  # fmt: skip
    if not direct:
        _mla_merge_kernel[(tokens, num_heads)](
            mid_o, mid_lse, out, num_splits,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            RANK=rank, BLOCK_R=block_r, BLOCK_S=triton.next_power_of_2(num_splits), CHUNK_S=8, num_warps=4, **pdl_args(mid_o.device, "_mla_merge_kernel"),
        )  # fmt: skip


def warm_tiles(tiles: Sequence[MLATile], num_heads: int, nope: int, rank: int, rope: int, page: int,
               dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device, max_context: int) -> int:  # fmt: skip
    """Compile the decode kernel for each of ``tiles`` before serving: one launch per tile and split count of
    ``warm_split_counts(max_context)`` over one sequence of one block, fresh random inputs laid out as the MLA
    layer passes them (``q_lat`` a transposed ``[H, T, r]``, ``q_rope`` a slice of the ``[T, H, nope + rope]``
    query). Triton compiles a kernel per tile, and per written-directly or merged; the merge kernel, per
    power of two of the split count. A tile that does not fit this card falls back here, as it would in a
    served step. Returns the launches made."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, num_heads, nope + rope, generator=gen, device=device, dtype=dtype)
    q_lat = torch.randn(num_heads, 1, rank, generator=gen, device=device, dtype=dtype)
    cache = torch.randn(2, page, 1, rank + rope, generator=gen, device=device, dtype=dtype).to(cache_dtype)
    block_tables = torch.ones(1, 1, dtype=torch.int32, device=device)  # block 1: block 0 is the dummy
    seq_lens = torch.full((1,), page, dtype=torch.int32, device=device)
    qsl = torch.arange(2, dtype=torch.int32, device=device)
    o_lat = torch.empty_like(q_lat)
    launches = 0
    for tile in tiles:
        for splits in warm_split_counts(max_context):
            mla_attention(q_lat.transpose(0, 1), q[..., nope:], cache, block_tables, seq_lens, qsl, 0.1,
                          max_query_len=1, out=o_lat.transpose(0, 1), num_splits=splits, tile=tile)  # fmt: skip
            launches += 1
    return launches
