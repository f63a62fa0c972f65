"""Sparse MLA in the absorbed form: each query row attends to its own selected latent rows only.

The math and the tiles are kernels/mla_attention.py's (scores ``q_lat·c + q_rope·k_rope``, the latents as
values, one loaded tile ``[BLOCK_N, r + d]`` serving both products and every head of the program, head-major
or token-major layouts, fp8 caches widened to fp16 beside bf16 queries), with one change: a step's
``BLOCK_N`` context rows are not consecutive positions but ``BLOCK_N`` entries of the row's index list
``idx[t]``, gathered through the block table (an entry of ``-1`` loads nothing and gets probability 0).
No causal mask is applied: the indexer selected only visible positions.

A program owns one row x ``BLOCK_H`` heads x one split of the ``K`` entries (rows do not share tiles, since
each row selects its own set, so decode and prefill/extend rows run the same program). Splits write
(log-sum-exp, normalised partial) and mla_attention's merge kernel combines them; with one split the
program writes the output. The split count comes from static sizes (rows, head blocks, K), so a call
captures in a CUDA graph. The slot offsets of a step are computed one step ahead and carried, as the dense
kernel carries its block ids, so a tile's address never waits on a load issued in the same step.

Measured (H100, benchmarks/results/dsa_kernels.json): at bs 64 and ctx 32k, 11x (GLM-5, 64 heads) and 13x
(DeepSeek-V3.2, 128 heads) faster than the dense kernel, but reading its bytes at only 33% and 22% of the read
bandwidth (58% at 16 heads), with the tensor cores at 16-19% of their peak: the step loop, not memory or the
MMAs, bounds it. The tile is the dense kernel's code default; token-major 64 x 32 with 3 stages measured 3-11%
faster there and is left for when a GPU test runs it at these shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import interpreting, sm_count
from graphserve.kernels.fp8_quant import fp16_saturated
from graphserve.kernels.mla_attention import LOG2E, _mla_merge_kernel
from graphserve.kernels.mla_config import MAX_SPLITS, MLATile, choose_num_splits, default_decode_tile
from graphserve.kernels.online_softmax import online_softmax_step


def sparse_tile(heads: int, dtype: torch.dtype) -> MLATile:
    """The dense decode kernel's code default for the head count: a sparse step reads the same row shape."""
    return default_decode_tile(heads, dtype)


@triton.jit
def _selected_rows(idx_row, bt_row, n0, end, stride_cblk, stride_coff, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(cache offsets, selected mask) of the entries [n0, n0 + BLOCK_N) of a row's index list."""
    offs = n0 + tl.arange(0, BLOCK_N)
    pos = tl.load(idx_row + offs, mask=offs < end, other=-1)
    sel = pos >= 0
    block = tl.load(bt_row + pos // PAGE, mask=sel, other=0).to(tl.int64)
    return block * stride_cblk + (pos % PAGE).to(tl.int64) * stride_coff, sel


@triton.jit
def _sparse_step(
    q_lat, q_rope, m_i, l_i, acc, base, sel, cache_ptr, scale_log2, offs_r, r_mask, offs_d, d_mask,
    RANK: tl.constexpr, TOKEN_MAJOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over ``BLOCK_N`` selected rows (kernels/mla_attention._mla_step's layouts)."""
    c = tl.load(cache_ptr + base[:, None] + offs_r[None, :], mask=sel[:, None] & r_mask[None, :],
                other=0.0).to(q_lat.dtype)  # fmt: skip
    k_rope = tl.load(cache_ptr + base[:, None] + RANK + offs_d[None, :], mask=sel[:, None] & d_mask[None, :],
                     other=0.0).to(q_lat.dtype)  # fmt: skip
    if TOKEN_MAJOR:
        s = tl.dot(c, q_lat, input_precision=DOT_PRECISION)  # [BLOCK_N, heads]
        s += tl.dot(k_rope, q_rope, input_precision=DOT_PRECISION)
        visible = sel[:, None]
    else:
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)  # [heads, BLOCK_N]
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        visible = sel[None, :]
    return online_softmax_step(s, visible, c, m_i, l_i, acc, scale_log2, TOKEN_MAJOR, DOT_PRECISION)


# block tables are sliced per step and their width follows the batch: see engine/warmup.py
@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["block_tables_ptr", "row_seq_ptr"])
def _sparse_mla_kernel(
    q_lat_ptr, q_rope_ptr, cache_ptr, block_tables_ptr, row_seq_ptr, idx_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    scale_log2, num_heads, num_selected,
    stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_cblk, stride_coff, stride_bt, stride_it,
    stride_ot, stride_oh, stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, ROPE: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, TOKEN_MAJOR: tl.constexpr,
    DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_FP16: tl.constexpr, WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    # rows x head blocks on axis 0 (2^31 programs: a prefill chunk's rows exceed axis 1's 65535), splits on 1
    n_hblocks = tl.cdiv(num_heads, BLOCK_H)
    tok = (tl.program_id(0) // n_hblocks).to(tl.int64)
    head = (tl.program_id(0) % n_hblocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    h_mask = head < num_heads
    split_len = tl.cdiv(tl.cdiv(num_selected, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, num_selected)

    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < ROPE
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    q_lat_rows = q_lat_ptr + tok * stride_qlt + head * stride_qlh
    q_rope_rows = q_rope_ptr + tok * stride_qrt + head * stride_qrh
    if TOKEN_MAJOR:  # the queries as [r, heads]: the right-hand operand of c·qᵀ
        q_lat = tl.load(q_lat_rows[None, :] + offs_r[:, None], mask=h_mask[None, :] & r_mask[:, None], other=0.0)
        q_rope = tl.load(q_rope_rows[None, :] + offs_d[:, None], mask=h_mask[None, :] & d_mask[:, None], other=0.0)
        acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    else:
        q_lat = tl.load(q_lat_rows[:, None] + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
        q_rope = tl.load(q_rope_rows[:, None] + offs_d[None, :], mask=h_mask[:, None] & d_mask[None, :], other=0.0)
        acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    if WIDEN_FP16:
        q_lat, q_rope = fp16_saturated(q_lat), fp16_saturated(q_rope)
    seq = tl.load(row_seq_ptr + tok).to(tl.int64)
    bt_row = block_tables_ptr + seq * stride_bt
    idx_row = idx_ptr + tok * stride_it
    base, sel = _selected_rows(idx_row, bt_row, start, end, stride_cblk, stride_coff, PAGE, BLOCK_N)
    if WHILE_LOOP:  # the interpreter cannot take program-id-derived range bounds (kernels/common.py)
        n0 = start
        while n0 < end:
            next_base, next_sel = _selected_rows(idx_row, bt_row, n0 + BLOCK_N, end, stride_cblk, stride_coff, PAGE,
                                                 BLOCK_N)  # fmt: skip
            m_i, l_i, acc = _sparse_step(q_lat, q_rope, m_i, l_i, acc, base, sel, cache_ptr, scale_log2, offs_r,
                                         r_mask, offs_d, d_mask, RANK, TOKEN_MAJOR, DOT_PRECISION)  # fmt: skip
            base, sel = next_base, next_sel
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            next_base, next_sel = _selected_rows(idx_row, bt_row, n0 + BLOCK_N, end, stride_cblk, stride_coff, PAGE,
                                                 BLOCK_N)  # fmt: skip
            m_i, l_i, acc = _sparse_step(q_lat, q_rope, m_i, l_i, acc, base, sel, cache_ptr, scale_log2, offs_r,
                                         r_mask, offs_d, d_mask, RANK, TOKEN_MAJOR, DOT_PRECISION)  # fmt: skip
            base, sel = next_base, next_sel

    inv_l = tl.where(l_i > 0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)  # nothing selected: output 0
    if TOKEN_MAJOR:
        o = acc * inv_l[None, :]
        col = offs_r[:, None]
        mask = h_mask[None, :] & r_mask[:, None]
        out_rows = (tok * stride_ot + head * stride_oh)[None, :]
        mid_rows = (tok * stride_mo_t + head * stride_mo_h + split * stride_mo_s)[None, :]
    else:
        o = acc * inv_l[:, None]
        col = offs_r[None, :]
        mask = h_mask[:, None] & r_mask[None, :]
        out_rows = (tok * stride_ot + head * stride_oh)[:, None]
        mid_rows = (tok * stride_mo_t + head * stride_mo_h + split * stride_mo_s)[:, None]
    if DIRECT:
        tl.store(out_ptr + out_rows + col, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(mid_o_ptr + mid_rows + col, o, mask=mask)
        tl.store(mid_lse_ptr + tok * stride_ml_t + head * stride_ml_h + split, lse, mask=h_mask)


def sparse_num_splits(rows: int, head_blocks: int, selected: int, device: torch.device, tile: MLATile) -> int:
    """Splits of each row's ``selected`` entries, from static sizes only (kernels/mla_config.choose_num_splits)."""
    return choose_num_splits(rows, head_blocks, selected, sm_count(device), tile.occupancy)


def sparse_mla(
    q_lat: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
    row_seq: torch.Tensor, idx: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
    tile: MLATile | None = None, num_splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``o_lat [T, H, r]`` of each row over its selected positions ``idx [T, K]`` (kernels/dsa_reference.py).

    ``tile`` and ``num_splits`` override the defaults (tests, the benchmark)."""
    tokens, num_heads, rank = q_lat.shape
    rope = q_rope.shape[-1]
    if latent_cache.shape[-1] != rank + rope or latent_cache.shape[2] != 1:
        raise ValueError(f"latent cache rows {tuple(latent_cache.shape[2:])}: expected (1, {rank + rope}) for "
                         f"r={rank}, dr={rope}")  # fmt: skip
    if q_lat.stride(-1) != 1 or q_rope.stride(-1) != 1 or latent_cache.stride(-1) != 1 or idx.stride(-1) != 1:
        raise ValueError("sparse_mla needs the last dim of q_lat, q_rope, the latent cache and idx contiguous")
    if latent_cache.dtype.itemsize > 1 and latent_cache.dtype != q_lat.dtype:
        raise ValueError(f"latent cache {latent_cache.dtype} with queries in {q_lat.dtype}: the cache is in the "
                         "queries' dtype or float8_e4m3fn")  # fmt: skip
    if idx.shape[0] != tokens or idx.dtype != torch.int32:
        raise ValueError(f"idx {tuple(idx.shape)} {idx.dtype}: expected ({tokens}, K) int32")
    if out is None:
        out = torch.empty_like(q_lat)
    selected = idx.shape[1]
    if tokens == 0 or selected == 0:
        return out.zero_()
    tile = tile or sparse_tile(num_heads, q_lat.dtype)
    head_blocks = triton.cdiv(num_heads, tile.block_h)
    if num_splits is None:
        num_splits = sparse_num_splits(tokens, head_blocks, selected, q_lat.device, tile)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits}: between 1 and {MAX_SPLITS} (the merge loads every split's lse)")
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty(tokens, num_heads, num_splits, rank, dtype=torch.float32, device=q_lat.device)
        mid_lse = torch.empty(tokens, num_heads, num_splits, dtype=torch.float32, device=q_lat.device)
    block_r = triton.next_power_of_2(rank)
    _sparse_mla_kernel[(tokens * head_blocks, num_splits)](
        q_lat, q_rope, latent_cache, block_tables, row_seq, idx, out, mid_o, mid_lse,
        scale * LOG2E, num_heads, selected,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0), idx.stride(0),
        out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if not direct else 0,
        mid_lse.stride(0), mid_lse.stride(1),
        RANK=rank, BLOCK_R=block_r, ROPE=rope, BLOCK_D=max(16, triton.next_power_of_2(rope)),
        PAGE=latent_cache.shape[1], BLOCK_N=tile.block_n, BLOCK_H=tile.block_h, TOKEN_MAJOR=tile.token_major,
        DIRECT=direct, DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        WIDEN_FP16=latent_cache.dtype.itemsize == 1 and q_lat.dtype == torch.bfloat16, WHILE_LOOP=interpreting(),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    if not direct:
        _mla_merge_kernel[(tokens, num_heads)](
            mid_o, mid_lse, out, num_splits,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            RANK=rank, BLOCK_R=block_r, BLOCK_S=triton.next_power_of_2(num_splits), CHUNK_S=8, PDL=False,
            num_warps=4,
        )  # fmt: skip
    return out
