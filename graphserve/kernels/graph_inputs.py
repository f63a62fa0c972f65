"""Stage a decode batch into a CUDA graph's static input buffers in one launch.

Before a captured decode step replays, the batch's inputs go into the buffers the graph reads: five copies,
then for a padded batch five fills, then the real-row count. Issued one by one from Python, those 6-11 small
launches made ``GraphRunner.replay`` 50-190 us slower than the graph's replay alone on an H200 (llama3-8b FP8
decode), the GPU idle while the host issued each. One launch writes them all.

For rows ``r < ps`` (the padded size):
- ``r < bs``: the batch's row, cast to the buffer's dtype as ``copy_`` casts; block-table columns at and past
  the batch's width keep what they held (attention reads a row only up to its sequence length);
- ``bs <= r < ps``: input id and position 0, slot 0 and the whole block-table row on the dummy block, sequence
  length 1, so a padding row reads and writes only the dummy block;
and ``num_valid`` (the real-row count MoE layers route by) becomes ``bs``. Nothing is allocated and nothing
waits for the host, so it is safe right before a replay. ``stage_decode_inputs_reference`` is the same through
``copy_`` and ``fill_``: the path for sources on another device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import interpreting
from graphserve.kernels.paged_kv import DUMMY_BLOCK
from graphserve.kernels.pdl import pdl_args, pdl_enter

INDEX_DTYPES = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})


class DecodeInputs(NamedTuple):
    """The per-row inputs of a decode step: [rows] vectors and a [rows, width] block table."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


# Everything that follows the batch stays unspecialized (pointer alignment and integer values alike), so one
# compile serves every batch size and table width: see engine/warmup.py.
@triton.jit(do_not_specialize=["src_ids_ptr", "src_pos_ptr", "src_slot_ptr", "src_lens_ptr", "src_table_ptr",
                               "src_ids_stride", "src_pos_stride", "src_slot_stride", "src_lens_stride",
                               "src_table_stride_r", "src_table_stride_c", "bs", "width"])
def _stage_decode_inputs_kernel(
    ids_ptr, pos_ptr, slot_ptr, lens_ptr, table_ptr, num_valid_ptr,
    src_ids_ptr, src_pos_ptr, src_slot_ptr, src_lens_ptr, src_table_ptr,
    ids_stride, pos_stride, slot_stride, lens_stride, table_stride_r, table_stride_c,
    src_ids_stride, src_pos_stride, src_slot_stride, src_lens_stride, src_table_stride_r, src_table_stride_c,
    bs, width, max_blocks,
    PAD_BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    # program (r, j) writes row r's block-table columns [j * BLOCK_W, (j + 1) * BLOCK_W); j == 0 also its
    # vector entries. No loop: a table of any width is a wider grid.
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    cols = j * BLOCK_W + tl.arange(0, BLOCK_W)
    row = table_ptr + r * table_stride_r + cols * table_stride_c
    if r < bs:
        mask = cols < width
        blocks = tl.load(src_table_ptr + r * src_table_stride_r + cols * src_table_stride_c, mask=mask)
        tl.store(row, blocks.to(table_ptr.dtype.element_ty), mask=mask)
        if j == 0:
            ids = tl.load(src_ids_ptr + r * src_ids_stride)
            pos = tl.load(src_pos_ptr + r * src_pos_stride)
            slot = tl.load(src_slot_ptr + r * src_slot_stride)
            seq_len = tl.load(src_lens_ptr + r * src_lens_stride)
            tl.store(ids_ptr + r * ids_stride, ids.to(ids_ptr.dtype.element_ty))
            tl.store(pos_ptr + r * pos_stride, pos.to(pos_ptr.dtype.element_ty))
            tl.store(slot_ptr + r * slot_stride, slot.to(slot_ptr.dtype.element_ty))
            tl.store(lens_ptr + r * lens_stride, seq_len.to(lens_ptr.dtype.element_ty))
    else:
        tl.store(row, tl.full((BLOCK_W,), PAD_BLOCK, table_ptr.dtype.element_ty), mask=cols < max_blocks)
        if j == 0:
            tl.store(ids_ptr + r * ids_stride, tl.zeros((), ids_ptr.dtype.element_ty))
            tl.store(pos_ptr + r * pos_stride, tl.zeros((), pos_ptr.dtype.element_ty))
            # slot PAD_BLOCK is slot 0, which lies in the dummy block (block 0)
            tl.store(slot_ptr + r * slot_stride, tl.full((), PAD_BLOCK, slot_ptr.dtype.element_ty))
            tl.store(lens_ptr + r * lens_stride, tl.full((), 1, lens_ptr.dtype.element_ty))
    if (r == 0) & (j == 0):
        tl.store(num_valid_ptr, bs.to(num_valid_ptr.dtype.element_ty))


def stage_decode_inputs(dst: DecodeInputs, num_valid: torch.Tensor, src: DecodeInputs, bs: int, ps: int) -> None:
    """Write ``src``'s ``bs`` rows and ``ps - bs`` padding rows into the static buffers ``dst`` and ``bs`` into
    ``num_valid`` (a 0-d tensor beside them): one launch where every tensor is on the buffers' device, else (a
    caller that hands sources from elsewhere, or buffers no Triton runs on) the ``copy_``/``fill_`` writes of
    ``stage_decode_inputs_reference``."""
    check_buffers(dst, num_valid)
    stage_checked(dst, num_valid, src, bs, ps)


def stage_checked(dst: DecodeInputs, num_valid: torch.Tensor, src: DecodeInputs, bs: int, ps: int) -> None:
    """``stage_decode_inputs`` for buffers that passed ``check_buffers`` once (engine/graphs.GraphRunner's own,
    fixed for its life): a step checks only its batch."""
    _check_batch(dst, src, bs, ps)
    device = dst.input_ids.device
    if (device.type != "cuda" and not interpreting()) or any(t.device != device for t in (*src, num_valid)):
        _copy_and_fill(dst, num_valid, src, bs, ps)
        return
    max_blocks = dst.block_tables.shape[1]
    block_w = max(16, min(triton.next_power_of_2(max_blocks), 1024))
    _stage_decode_inputs_kernel[(ps, max(1, triton.cdiv(max_blocks, block_w)))](
        dst.input_ids, dst.positions, dst.slot_mapping, dst.seq_lens, dst.block_tables, num_valid,
        src.input_ids, src.positions, src.slot_mapping, src.seq_lens, src.block_tables,
        dst.input_ids.stride(0), dst.positions.stride(0), dst.slot_mapping.stride(0), dst.seq_lens.stride(0),
        dst.block_tables.stride(0), dst.block_tables.stride(1),
        src.input_ids.stride(0), src.positions.stride(0), src.slot_mapping.stride(0), src.seq_lens.stride(0),
        src.block_tables.stride(0), src.block_tables.stride(1),
        bs, src.block_tables.shape[1], max_blocks,
        PAD_BLOCK=DUMMY_BLOCK, BLOCK_W=block_w,
        num_warps=1 if block_w <= 128 else 4, **pdl_args(device, "_stage_decode_inputs_kernel"),
    )


def pad_decode_rows(dst: DecodeInputs, start: int, stop: int) -> None:
    """Rows [start, stop) of the static buffers as padding rows (on the dummy block)."""
    if stop <= start:
        return
    dst.input_ids[start:stop].zero_()
    dst.positions[start:stop].zero_()
    dst.slot_mapping[start:stop].fill_(DUMMY_BLOCK)  # slot 0 lies in the dummy block
    dst.seq_lens[start:stop].fill_(1)
    dst.block_tables[start:stop].fill_(DUMMY_BLOCK)


def stage_decode_inputs_reference(
    dst: DecodeInputs, num_valid: torch.Tensor, src: DecodeInputs, bs: int, ps: int
) -> None:
    """Plain PyTorch: the same writes as ``copy_`` and ``fill_`` launches; sources may live on any device."""
    check_buffers(dst, num_valid)
    _check_batch(dst, src, bs, ps)
    _copy_and_fill(dst, num_valid, src, bs, ps)


def _copy_and_fill(dst: DecodeInputs, num_valid: torch.Tensor, src: DecodeInputs, bs: int, ps: int) -> None:
    dst.input_ids[:bs].copy_(src.input_ids, non_blocking=True)
    dst.positions[:bs].copy_(src.positions, non_blocking=True)
    dst.slot_mapping[:bs].copy_(src.slot_mapping, non_blocking=True)
    dst.seq_lens[:bs].copy_(src.seq_lens, non_blocking=True)
    dst.block_tables[:bs, : src.block_tables.shape[1]].copy_(src.block_tables, non_blocking=True)
    pad_decode_rows(dst, bs, ps)
    num_valid.fill_(bs)


def check_buffers(dst: DecodeInputs, num_valid: torch.Tensor) -> None:
    """The static buffers: integer vectors of one length, a block table of as many rows, a 0-d integer count."""
    rows = dst.input_ids.shape[0] if dst.input_ids.dim() == 1 else -1
    for name, t in _named(dst, "")[:4]:
        if t.dim() != 1 or t.shape[0] != rows:
            raise ValueError(f"{name} must be a vector of the buffers' {rows} rows, got shape {tuple(t.shape)}")
    if dst.block_tables.dim() != 2 or dst.block_tables.shape[0] != rows:
        raise ValueError(f"block_tables must be [{rows} rows, max_blocks], got shape {tuple(dst.block_tables.shape)}")
    if num_valid.dim() != 0:
        raise ValueError(f"num_valid must be a 0-d tensor, got shape {tuple(num_valid.shape)}")
    for name, t in [*_named(dst, ""), ("num_valid", num_valid)]:
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} is {t.dtype}; staging needs integer tensors ({_names(INDEX_DTYPES)})")


def _check_batch(dst: DecodeInputs, src: DecodeInputs, bs: int, ps: int) -> None:
    rows = dst.input_ids.shape[0]
    if not 1 <= ps <= rows:
        raise ValueError(f"ps={ps} (the padded size) must lie in [1, {rows}], the static buffers' rows")
    if not 0 <= bs <= ps:
        raise ValueError(f"bs={bs} (the batch's rows) must lie in [0, ps={ps}]")
    if any(t.shape != (bs,) for t in src[:4]):  # the names are built only for the error
        name, t = next((n, t) for n, t in _named(src, "src.")[:4] if t.shape != (bs,))
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({bs},): one value per row, bs={bs}")
    table = src.block_tables
    if table.dim() != 2 or table.shape[0] != bs:
        raise ValueError(f"src.block_tables has shape {tuple(table.shape)}, expected ({bs}, width)")
    if table.shape[1] > dst.block_tables.shape[1]:
        raise ValueError(f"src.block_tables width {table.shape[1]} exceeds the static block_tables width "
                         f"{dst.block_tables.shape[1]} (max blocks per sequence)")
    if any(t.dtype not in INDEX_DTYPES for t in src):
        name, t = next((n, t) for n, t in _named(src, "src.") if t.dtype not in INDEX_DTYPES)
        raise ValueError(f"{name} is {t.dtype}; staging needs integer tensors ({_names(INDEX_DTYPES)})")


def _named(inputs: DecodeInputs, prefix: str) -> list[tuple[str, torch.Tensor]]:
    return [(prefix + name, t) for name, t in zip(inputs._fields, inputs)]


def _names(dtypes: frozenset[torch.dtype]) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
