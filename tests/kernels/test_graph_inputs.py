"""Staging a decode batch into a CUDA graph's static buffers: the one-launch kernel against the copy_/fill
sequence it replaces, through Triton's interpreter.

Buffers start full of stale random values (a previous, larger batch), so a row or column the kernel forgot
to write, or wrote when it should have left it, differs from the reference. Sources are random and cover
int32 and int64, strided block-table rows (a slice of a wider table), narrow tables and padded batches; the
GPU run inside a captured decode step is tests/gpu/test_graph_inputs_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from interp_setup import kernel_device, use_interpreter

use_interpreter()

from graphserve.engine.graphs import GraphRunner  # noqa: E402
from graphserve.kernels.graph_inputs import (  # noqa: E402
    DecodeInputs,
    stage_decode_inputs,
    stage_decode_inputs_reference,
)
from graphserve.kernels.paged_kv import DUMMY_BLOCK  # noqa: E402
from graphserve.layers.forward_batch import ForwardBatch  # noqa: E402

DEVICE = kernel_device()
ROWS, MAX_BLOCKS = 16, 37  # a width that is no power of two: the tail chunk is masked


def stale_buffers(gen: torch.Generator, rows: int = ROWS, max_blocks: int = MAX_BLOCKS) -> DecodeInputs:
    """Static buffers in the engine's dtypes, holding what an earlier batch left."""
    return DecodeInputs(
        input_ids=torch.randint(1, 1 << 40, (rows,), generator=gen).to(DEVICE),
        positions=torch.randint(1, 1 << 20, (rows,), generator=gen).to(DEVICE),
        slot_mapping=torch.randint(1, 1 << 30, (rows,), generator=gen).to(DEVICE),
        seq_lens=torch.randint(2, 1 << 20, (rows,), generator=gen, dtype=torch.int32).to(DEVICE),
        block_tables=torch.randint(1, 1 << 20, (rows, max_blocks), generator=gen, dtype=torch.int32).to(DEVICE),
    )


def batch_sources(gen: torch.Generator, bs: int, width: int, dtype: torch.dtype, strided: bool) -> DecodeInputs:
    """A random decode batch's inputs; ``strided``: every source a view with a row stride past its width."""

    def vec(hi: int) -> torch.Tensor:
        v = torch.randint(1, hi, (2 * bs if strided else bs,), generator=gen, dtype=dtype).to(DEVICE)
        return v[::2] if strided else v

    table = torch.randint(1, 1 << 20, (bs, width + 5 if strided else width), generator=gen, dtype=dtype)
    table = table.to(DEVICE)[:, 3 : 3 + width] if strided else table.to(DEVICE)
    return DecodeInputs(vec(1 << 30), vec(1 << 20), vec(1 << 30), vec(1 << 20), table)


def clone(inputs: DecodeInputs) -> DecodeInputs:
    return DecodeInputs(*(t.clone() for t in inputs))


def assert_same(out: DecodeInputs, ref: DecodeInputs) -> None:
    for name, a, b in zip(out._fields, out, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs at {(a != b).nonzero().flatten()[:8]}"


@pytest.mark.parametrize(
    "bs,ps,width,dtype,strided",
    [
        (8, 8, MAX_BLOCKS, torch.int32, False),  # bs == ps: no padding rows, the whole table width
        (5, 8, 11, torch.int32, False),  # padding rows, a table narrower than the buffers'
        (5, 8, 11, torch.int64, False),  # int64 sources cast down into the int32 buffers
        (6, 16, 20, torch.int32, True),  # strided rows: views of wider sources
        (13, 16, MAX_BLOCKS, torch.int64, True),
        (1, 1, 3, torch.int32, False),  # bs = 1
        (1, 4, 1, torch.int64, False),  # bs = 1, padded, one column
        (3, 7, 0, torch.int32, False),  # an empty table: only padding rows touch block_tables
    ],
)
def test_kernel_writes_what_the_copy_and_fill_sequence_writes(bs, ps, width, dtype, strided):
    gen = torch.Generator().manual_seed(bs * 1000 + ps * 10 + width)
    dst = stale_buffers(gen)
    src = batch_sources(gen, bs, width, dtype, strided)
    ref = clone(dst)
    num_valid = torch.tensor(-7, device=DEVICE)
    ref_valid = num_valid.clone()
    before = clone(dst)
    stage_decode_inputs(dst, num_valid, src, bs, ps)
    stage_decode_inputs_reference(ref, ref_valid, src, bs, ps)
    assert_same(dst, ref)
    assert num_valid.item() == ref_valid.item() == bs
    # what the comparison rests on, stated directly
    assert torch.equal(dst.block_tables[:bs, :width], src.block_tables.to(torch.int32))
    assert torch.equal(dst.block_tables[:bs, width:], before.block_tables[:bs, width:])  # columns past width kept
    assert (dst.block_tables[bs:ps] == DUMMY_BLOCK).all() and (dst.seq_lens[bs:ps] == 1).all()
    assert (dst.slot_mapping[bs:ps] == DUMMY_BLOCK).all() and not dst.input_ids[bs:ps].any()
    assert_same(DecodeInputs(*(t[ps:] for t in dst)), DecodeInputs(*(t[ps:] for t in before)))  # rows past ps


def test_wide_tables_span_several_column_chunks():
    """Block tables wider than one program's chunk (1024 columns): the grid's second axis covers the rest."""
    gen = torch.Generator().manual_seed(11)
    dst = stale_buffers(gen, rows=6, max_blocks=2100)
    src = batch_sources(gen, 3, 1500, torch.int32, True)
    ref = clone(dst)
    num_valid, ref_valid = torch.tensor(0, device=DEVICE), torch.tensor(0, device=DEVICE)
    stage_decode_inputs(dst, num_valid, src, 3, 5)
    stage_decode_inputs_reference(ref, ref_valid, src, 3, 5)
    assert_same(dst, ref)
    assert (dst.block_tables[3:5] == DUMMY_BLOCK).all() and dst.block_tables[5].all()


def test_kernel_casts_as_copy_does():
    """int64 sources into int32 buffers and int32 sources into int64 buffers, values near the limits."""
    gen = torch.Generator().manual_seed(5)
    dst = stale_buffers(gen)
    big = torch.tensor([(1 << 31) - 1, 1 << 35, -(1 << 33) - 3], dtype=torch.int64, device=DEVICE)
    src = DecodeInputs(big.int(), big.int(), big.int(), big, torch.stack([big, big.flip(0)], dim=1))
    ref = clone(dst)
    num_valid, ref_valid = torch.tensor(0, device=DEVICE), torch.tensor(0, device=DEVICE)
    stage_decode_inputs(dst, num_valid, src, 3, 5)
    stage_decode_inputs_reference(ref, ref_valid, src, 3, 5)
    assert_same(dst, ref)


def test_shapes_that_do_not_fit_name_the_argument():
    gen = torch.Generator().manual_seed(9)
    dst = stale_buffers(gen)
    num_valid = torch.tensor(0, device=DEVICE)
    src = batch_sources(gen, 4, 6, torch.int32, False)
    for stage in (stage_decode_inputs, stage_decode_inputs_reference):
        with pytest.raises(ValueError, match=r"bs=4 .* must lie in \[0, ps=2\]"):
            stage(dst, num_valid, src, 4, 2)
        with pytest.raises(ValueError, match=r"ps=17 .* \[1, 16\], the static buffers' rows"):
            stage(dst, num_valid, src, 4, ROWS + 1)
        wide = src._replace(block_tables=torch.zeros(4, MAX_BLOCKS + 1, dtype=torch.int32, device=DEVICE))
        with pytest.raises(ValueError, match=f"src.block_tables width {MAX_BLOCKS + 1} exceeds .* {MAX_BLOCKS}"):
            stage(dst, num_valid, wide, 4, 8)
        short = src._replace(seq_lens=src.seq_lens[:3])
        with pytest.raises(ValueError, match=r"src.seq_lens has shape \(3,\), expected \(4,\)"):
            stage(dst, num_valid, short, 4, 8)
        with pytest.raises(ValueError, match="num_valid must be a 0-d tensor"):
            stage(dst, num_valid.view(1), src, 4, 8)
        with pytest.raises(ValueError, match="src.positions is torch.float32"):
            stage(dst, num_valid, src._replace(positions=src.positions.float()), 4, 8)
        with pytest.raises(ValueError, match=r"seq_lens must be a vector of the buffers' 16 rows, got shape \(15,\)"):
            stage(dst._replace(seq_lens=dst.seq_lens[:15]), num_valid, src, 4, 8)
        with pytest.raises(ValueError, match="block_tables is torch.float32"):
            stage(dst._replace(block_tables=dst.block_tables.float()), num_valid, src, 4, 8)


class _FakeGraph:
    """Stands in for a captured graph: replay records what the static buffers held."""

    def __init__(self, runner: GraphRunner, ps: int):
        self.runner, self.ps = runner, ps
        self.seen: list[DecodeInputs] = []

    def replay(self) -> None:
        r = self.runner
        self.seen.append(clone(DecodeInputs(r.input_ids[: self.ps], r.positions[: self.ps], r.slot_mapping[: self.ps],
                                            r.seq_lens[: self.ps], r.block_tables[: self.ps])))


def test_replay_split_stages_each_piece():
    """An oversize batch replays as captured pieces; each piece's rows reach the buffers, the last one padded."""
    sizes, max_blocks = [2, 4], 9
    runner = GraphRunner(torch.nn.Identity(), None, [], sizes, max_blocks, 64, DEVICE)
    for ps in sizes:
        runner.graphs[ps] = _FakeGraph(runner, ps)
        runner.logits[ps] = torch.zeros(ps, 3, device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    bs, width = 7, 5
    src = batch_sources(gen, bs, width, torch.int64, False)
    batch = ForwardBatch(mode="decode", input_ids=src.input_ids, positions=src.positions,
                         slot_mapping=src.slot_mapping, query_start_loc=torch.arange(bs + 1, device=DEVICE),
                         seq_lens=src.seq_lens.int(), block_tables=src.block_tables.int(),
                         logits_indices=torch.arange(bs, device=DEVICE), max_query_len=1, max_seq_len=64,
                         query_lens_cpu=[1] * bs, seq_lens_cpu=src.seq_lens.tolist())
    assert runner.replay_split(batch).shape == (bs, 3)
    assert not runner.graphs[2].seen
    first, last = runner.graphs[4].seen  # 7 rows: pieces of 4 and 3, the second padded to 4
    assert torch.equal(first.input_ids, src.input_ids[:4]) and torch.equal(last.input_ids[:3], src.input_ids[4:])
    assert torch.equal(first.block_tables[:, :width], src.block_tables[:4].int())
    assert torch.equal(last.block_tables[:3, :width], src.block_tables[4:].int())
    assert (last.block_tables[3] == DUMMY_BLOCK).all() and last.seq_lens[3] == 1
    assert runner.num_valid.item() == 3
