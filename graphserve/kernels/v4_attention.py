"""DeepSeek-V4's attention as one Triton launch (and a merge): kernels/v4_reference.v4_attention.

Each row (a decode token or a row of an extend chunk) attends, in the absorbed form the layer computes (every head's
query against the one shared 512-wide K=V latent), over a virtual key list: its window, ``window`` latents of
positions ``p - window + 1 .. p`` from the latent cache, then its compressed entries from the layer's compact pages
(kernels/v4_reference.py: one entry row per group): every visible one (HCA), or the ``K`` the indexer
chose (CSA, ``idx [T, K]``, -1 none).
A key's address is computed per lane, from one of the two caches, so one tile may hold both kinds. A window latent
sits in its block's latent page, ``latent_page[block]`` (layers/kv_layout.py: the latents are paged apart from the
blocks, so only running windows hold them); an entry in its block's compact page.

A program owns one row x ``BLOCK_H`` heads x one split of that row's list. The row's length is read on the device
(``window + visible`` for HCA, ``window + K`` for CSA) and cut into ``num_splits`` equal parts there, so a short row
in a batch padded to a long ``max_len`` costs its own keys, the grid stays static and a CUDA graph captures it. Each
head's sink joins split 0's softmax as its initial state (max = sink, sum = 1, nothing accumulated), so the split
log-sum-exps carry it into kernels/decode_merge.py's merge unchanged, as kernels/decode_attention.py's split kernel
does. ``num_splits`` comes from static sizes (kernels/mla_config.choose_num_splits): at bs 1 and a long context
the key list is spread over the SMs. Tiles are kernels/mla_config.py's (the same 512-wide latent row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import interpreting, sm_count
from graphserve.kernels.decode_merge import _decode_merge_kernel
from graphserve.kernels.mla_config import MAX_SPLITS, MLATile, choose_num_splits, default_decode_tile
from graphserve.kernels.online_softmax import online_softmax_step

LOG2E = 1.4426950408889634


@triton.jit
def _keys(lat_ptr, map_ptr, rows_ptr, bt_row, idx_row, pos, visible, v, end, stride_lat, stride_row, offs_d, d_mask,
          WINDOW: tl.constexpr, RATE: tl.constexpr, ENTRY_AT: tl.constexpr, HAS_IDX: tl.constexpr,
          PAGE: tl.constexpr, ENTRY_BASE: tl.constexpr, ENTRY_WIDTH: tl.constexpr, HAS_MAP: tl.constexpr):  # fmt: skip
    """(keys ``[BLOCK_N, BLOCK_D]``, which exist) of the virtual keys ``v``: window latents (in the block's latent
    page where ``HAS_MAP``), then entries (in the block's compact page)."""
    in_list = v < end
    is_win = v < WINDOW
    win_pos = pos - WINDOW + 1 + v
    ok_win = in_list & is_win & (win_pos >= 0)
    if RATE > 0:
        e = v - WINDOW
        if HAS_IDX:
            e = tl.load(idx_row + e, mask=in_list & ~is_win, other=-1).to(tl.int64)
        ok_ent = in_list & ~is_win & (e >= 0) & (e < visible)
        tok = tl.where(is_win, win_pos, (e + 1) * RATE - 1)
        ok = ok_win | ok_ent
    else:
        tok = win_pos
        ok = ok_win
    tok = tl.where(ok, tok, 0)
    block = tl.load(bt_row + tok // PAGE, mask=ok, other=0).to(tl.int64)
    if HAS_MAP:
        slot = tl.load(map_ptr + block, mask=ok_win, other=0).to(tl.int64) * PAGE + tok % PAGE
    else:
        slot = block * PAGE + tok % PAGE
    mask = d_mask[None, :]
    k = tl.load(lat_ptr + slot[:, None] * stride_lat + offs_d[None, :], mask=ok_win[:, None] & mask, other=0.0)
    if RATE > 0:
        # the entry row of the group's last token in its block's page (kernels/v4_reference.entry_index)
        ent = block * stride_row + ENTRY_BASE + ((tok % PAGE) // RATE) * ENTRY_WIDTH + ENTRY_AT
        k += tl.load(rows_ptr + ent[:, None] + offs_d[None, :], mask=ok_ent[:, None] & mask, other=0.0)
    return k, ok


@triton.jit
def _step(q, k, ok, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """One step over ``BLOCK_N`` keys: the latent tile is the keys and the values, head-major."""
    k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [heads, BLOCK_N]
    return online_softmax_step(s, ok[None, :], k, m_i, l_i, acc, scale_log2, False, DOT_PRECISION)


# block tables are sliced per step and their width follows the batch: see engine/warmup.py
@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["bt_ptr", "pos_ptr", "row_seq_ptr"])
def _v4_attention_kernel(
    q_ptr, lat_ptr, map_ptr, rows_ptr, bt_ptr, row_seq_ptr, pos_ptr, idx_ptr, sinks_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    scale_log2, num_heads, num_idx,
    stride_qt, stride_qh, stride_lat, stride_row, stride_bt, stride_it, stride_ot, stride_oh,
    stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
    WINDOW: tl.constexpr, RATE: tl.constexpr, ENTRY_AT: tl.constexpr, HAS_IDX: tl.constexpr, DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WHILE_LOOP: tl.constexpr, ENTRY_BASE: tl.constexpr, ENTRY_WIDTH: tl.constexpr,
    HAS_MAP: tl.constexpr,
):  # fmt: skip
    n_hblocks = tl.cdiv(num_heads, BLOCK_H)
    tok = (tl.program_id(0) // n_hblocks).to(tl.int64)
    head = (tl.program_id(0) % n_hblocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    h_mask = head < num_heads
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    if RATE > 0:
        visible = (pos + 1) // RATE
    else:
        visible = pos * 0
    if HAS_IDX:
        length = WINDOW + tl.where(visible > 0, num_idx, 0)
    else:
        length = WINDOW + visible
    # a row shorter than the window starts where its first position is
    first = tl.maximum(WINDOW - 1 - pos, 0)
    split_len = tl.cdiv(tl.cdiv(length - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, length)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < DIM
    q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    # the sink joins split 0's denominator as its starting state: max = sink, sum = exp2(0), nothing accumulated
    sink = tl.load(sinks_ptr + head, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_i = tl.where(split == 0, sink, float("-inf"))
    l_i = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    seq = tl.load(row_seq_ptr + tok).to(tl.int64)
    bt_row = bt_ptr + seq * stride_bt
    idx_row = idx_ptr + tok * stride_it
    if WHILE_LOOP:  # the interpreter cannot take program-id-derived range bounds (kernels/common.py)
        n0 = start
        while n0 < end:
            k, ok = _keys(lat_ptr, map_ptr, rows_ptr, bt_row, idx_row, pos, visible, n0 + tl.arange(0, BLOCK_N),
                          end, stride_lat, stride_row, offs_d, d_mask, WINDOW, RATE, ENTRY_AT, HAS_IDX, PAGE,
                          ENTRY_BASE, ENTRY_WIDTH, HAS_MAP)
            m_i, l_i, acc = _step(q, k, ok, m_i, l_i, acc, scale_log2, DOT_PRECISION)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            k, ok = _keys(lat_ptr, map_ptr, rows_ptr, bt_row, idx_row, pos, visible, n0 + tl.arange(0, BLOCK_N),
                          end, stride_lat, stride_row, offs_d, d_mask, WINDOW, RATE, ENTRY_AT, HAS_IDX, PAGE,
                          ENTRY_BASE, ENTRY_WIDTH, HAS_MAP)
            m_i, l_i, acc = _step(q, k, ok, m_i, l_i, acc, scale_log2, DOT_PRECISION)

    inv_l = tl.where(l_i > 0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
    o = acc * inv_l[:, None]
    mask = h_mask[:, None] & d_mask[None, :]
    if DIRECT:
        tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        # an empty split (a short row in a batch sized for the longest) writes its lse alone: the merge skips it
        tl.store(mid_o_ptr + tok * stride_mo_t + head[:, None] * stride_mo_h + split * stride_mo_s + offs_d[None, :],
                 o, mask=mask & (l_i > 0)[:, None])  # fmt: skip
        tl.store(mid_lse_ptr + tok * stride_ml_t + head * stride_ml_h + split, lse, mask=h_mask)


def attention_tile(heads: int, dtype: torch.dtype) -> MLATile:
    """MLA's decode tile for the head count: its rows are as wide (512) as V4's latent."""
    return default_decode_tile(heads, dtype)


def key_count(window: int, rate: int, max_len: int, num_idx: int | None) -> int:
    """The longest key list a row can have: the window, and the chosen entries or every entry of ``max_len``."""
    if rate == 0:
        return window
    return window + (num_idx if num_idx is not None else max_len // rate)


def v4_attention(
    q: torch.Tensor, latents: torch.Tensor, rows: torch.Tensor | None, entry_at: int, block_tables: torch.Tensor,
    row_seq: torch.Tensor, positions: torch.Tensor, sinks: torch.Tensor, scale: float, window: int, rate: int,
    block_size: int, idx: torch.Tensor | None = None, state_floats: int = 0, entry_width: int = 0, *,
    out: torch.Tensor | None = None, tile: MLATile | None = None, num_splits: int | None = None,
    latent_page: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """kernels/v4_reference.v4_attention: ``[T, H, D]`` (fp32, or ``out``'s dtype); ``latents [slots, D]`` paged
    through ``latent_page [num_blocks]`` int32 (layers/kv_layout.py; None: by block id), ``rows``
    the compact pages ``[num_blocks, page]`` (None with ``rate`` 0: a sliding-only layer; entries of
    ``entry_width`` after ``state_floats`` of checkpoint), ``idx [T, K]`` int32 for CSA. ``tile`` and
    ``num_splits`` override the defaults (tests, the benchmark)."""
    tokens, heads, d = q.shape
    if latents.shape[-1] != d or latents.stride(-1) != 1 or q.stride(-1) != 1 or latents.dtype != q.dtype:
        raise ValueError(f"queries {tuple(q.shape)} {q.dtype} against latents {tuple(latents.shape)} "
                         f"{latents.dtype}: same dtype and head dim, last dims contiguous")  # fmt: skip
    entry_base = state_floats * 4 // q.dtype.itemsize
    if rate > 0 and (rows is None or rows.stride(-1) != 1 or rows.dtype != q.dtype or entry_at + d > entry_width
                     or entry_base + entry_width > rows.shape[-1]):  # fmt: skip
        raise ValueError(f"rate {rate} needs the pages in {q.dtype}, last dim contiguous, with the entry at columns "
                         f"[{entry_at}, {entry_at + d}) of {entry_width}-wide rows after {entry_base}")  # fmt: skip
    if idx is not None and (idx.dtype != torch.int32 or idx.shape[0] != tokens or idx.stride(-1) != 1 or rate == 0):
        raise ValueError(f"idx {tuple(idx.shape)} {idx.dtype}: ({tokens}, K) int32 of a compressed layer")
    if sinks.dtype != torch.float32 or tuple(sinks.shape) != (heads,) or not sinks.is_contiguous():
        raise ValueError(f"sinks {sinks.dtype} {tuple(sinks.shape)}: contiguous float32 ({heads},)")
    if latent_page is not None and (latent_page.dtype != torch.int32 or latent_page.dim() != 1):
        raise ValueError(f"latent_page {latent_page.dtype} {tuple(latent_page.shape)}: int32 [num_blocks]")
    if out is None:
        out = torch.empty(tokens, heads, d, dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out
    tile = tile or attention_tile(heads, q.dtype)
    head_blocks = triton.cdiv(heads, tile.block_h)
    num_idx = idx.shape[1] if idx is not None else None
    keys = key_count(window, rate, block_tables.shape[1] * block_size, num_idx)
    if num_splits is None:
        num_splits = choose_num_splits(tokens, head_blocks, keys, sm_count(q.device), tile.occupancy)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits}: between 1 and {MAX_SPLITS}")
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty(tokens, heads, num_splits, d, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(tokens, heads, num_splits, dtype=torch.float32, device=q.device)
    rows_arg = rows if rows is not None else latents
    idx_arg = idx if idx is not None else row_seq
    _v4_attention_kernel[(tokens * head_blocks, num_splits)](
        q, latents, latent_page if latent_page is not None else block_tables, rows_arg, block_tables, row_seq, positions, idx_arg, sinks, out, mid_o, mid_lse,
        scale * LOG2E, heads, num_idx or 0,
        q.stride(0), q.stride(1), latents.stride(0), rows_arg.stride(0), block_tables.stride(0),
        idx_arg.stride(0), out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if not direct else 0, mid_lse.stride(0), mid_lse.stride(1),
        WINDOW=window, RATE=rate, ENTRY_AT=entry_at, HAS_IDX=idx is not None, DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), PAGE=block_size, BLOCK_N=tile.block_n, BLOCK_H=tile.block_h,
        DIRECT=direct, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WHILE_LOOP=interpreting(),
        ENTRY_BASE=entry_base if rate else 0, ENTRY_WIDTH=entry_width, HAS_MAP=latent_page is not None,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    if not direct:
        _decode_merge_kernel[(tokens, heads)](
            mid_o, mid_lse, out, num_splits,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_S=triton.next_power_of_2(num_splits), PDL=False,
            num_warps=4,
        )  # fmt: skip
    return out
