"""Every memory access of the MLA attention kernels lies inside the tensors they were given.

Triton's interpreter reads and writes raw addresses without checking them, so a pointer past a
tensor reads a neighbour (or crashes) where the GPU raises an illegal memory access. Here each
interpreted launch records the storage ranges of its tensor arguments, and every load or store
whose mask lets a lane through must fall inside one of them. Shapes: the decode tile sweep's first
point (16 heads, batch 1, context 1024, r 512, block tables exactly as wide as the context) at its
split count and at the most splits (many of them past the end of the context), and extend over a
cached prefix. The checker itself is shown to catch a read past the block table.
"""

from __future__ import annotations

import pytest
import test_mla_interp  # noqa: F401  (runs the kernels under the interpreter when there is no GPU)
import torch
from interp_bounds import bounds_checked

from graphserve.kernels.mla_attention import mla_attention
from graphserve.kernels.mla_config import DECODE_FEW_HEADS, DECODE_FP32, SAFE_DECODE, MLATile
from graphserve.layers.mla_reference import absorbed_attention_reference

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter's accesses (CPU only)")
RANK, ROPE, PAGE = 512, 64, 16


@pytest.fixture
def bounds():
    """Every interpreted launch in the test checked by tests/support/interp_bounds.py: a masked-in lane outside the
    launch's tensors raises IndexError."""
    with bounds_checked() as launched:
        yield launched


def sweep_point(heads: int, batch: int, ctx: int, seed: int):
    """benchmarks/mla.py's setup in fp32: block tables exactly ``ctx / PAGE`` wide, shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-ctx // PAGE)
    cache = torch.randn(batch * blocks + 1, PAGE, 1, RANK + ROPE, generator=gen).mul_(0.5)
    tables = (torch.randperm(batch * blocks, generator=gen).int() + 1).view(batch, blocks)
    q_lat = torch.randn(batch, heads, RANK, generator=gen).mul_(0.1)
    q_rope = torch.randn(batch, heads, ROPE, generator=gen).mul_(0.1)
    return cache, tables, torch.full((batch,), ctx, dtype=torch.int32), q_lat, q_rope


def test_the_checker_catches_a_read_past_the_block_table(bounds):
    cache, tables, lens, q_lat, q_rope = sweep_point(16, 1, 256, seed=1)
    with pytest.raises(Exception, match="load out of bounds"):
        mla_attention(q_lat, q_rope, cache, tables, lens + 40, torch.arange(2, dtype=torch.int32), 0.1,
                      max_query_len=1, tile=DECODE_FP32, num_splits=1)  # fmt: skip


# 14 splits: what the first point's occupancy-2 tiles get on 132 SMs (splits 13 and 14 start past the
# context at 16 tokens per step); 128: the most, all but 16 of them empty
@pytest.mark.parametrize("tile", [SAFE_DECODE, DECODE_FP32, DECODE_FEW_HEADS, MLATile(True, 16, 64, 4, 2)],
                         ids=lambda t: t.name)  # fmt: skip
@pytest.mark.parametrize("num_splits", [14, 128])
def test_decode_at_the_sweeps_first_point_stays_in_bounds(bounds, tile, num_splits):
    cache, tables, lens, q_lat, q_rope = sweep_point(16, 1, 1024, seed=num_splits)
    out = torch.full_like(q_lat, float("nan"))
    mla_attention(q_lat, q_rope, cache, tables, lens, torch.arange(2, dtype=torch.int32), 0.1, max_query_len=1,
                  out=out, tile=tile, num_splits=num_splits)  # fmt: skip
    ref = absorbed_attention_reference(q_lat, q_rope, cache, tables, [1], [1024], 0.1)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_extend_over_a_prefix_stays_in_bounds(bounds):
    cache, tables, _, _, _ = sweep_point(16, 2, 96, seed=3)
    gen = torch.Generator().manual_seed(4)
    query_lens, seq_lens = [5, 1], [96, 40]  # a chunk on a prefix ending at the table's edge, a decode row
    q_lat = torch.randn(6, 16, RANK, generator=gen).mul_(0.1)
    q_rope = torch.randn(6, 16, ROPE, generator=gen).mul_(0.1)
    qsl = torch.tensor([0, 5, 6], dtype=torch.int32)
    out = mla_attention(q_lat, q_rope, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, 0.1,
                        max_query_len=5)  # fmt: skip
    ref = absorbed_attention_reference(q_lat, q_rope, cache, tables, query_lens, seq_lens, 0.1)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
