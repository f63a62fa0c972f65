"""DeepSeek-V4's Triton kernels (kernels/v4_compress.py, kernels/v4_attention.py, the compressed indexer scores of
kernels/dsa_indexer.py) against kernels/v4_reference.py, on CPU through Triton's interpreter.

fp32, tiny shapes (entry dims of 16 and 8, windows of 6, rates 4 and 16), shuffled block tables, fresh random rows,
decode rows, an extend chunk closing several groups (the first group of a sequence among them, which has no
previous group in CSA), padding rows on the dummy block, one split and several. Every access of every launch is
bounds-checked (tests/support/interp_bounds.py). The real shapes, bf16 and CUDA graphs are tests/gpu/test_deepseek_v4_gpu.py.
"""

from __future__ import annotations

import torch
from interp_bounds import bounds_checked
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error

use_interpreter()

import pytest  # noqa: E402

from graphserve.kernels import dsa_indexer, v4_attention, v4_compress  # noqa: E402
from graphserve.kernels import v4_reference as ref  # noqa: E402

DEVICE = kernel_device()
PAGE, D, DI, ROPE_PAIRS = 4, 16, 8, 3


@pytest.fixture(autouse=True)
def _bounds():
    if DEVICE.type == "cuda":
        yield
        return
    with bounds_checked():
        yield


def paged(seq_lens: list[int], gen: torch.Generator) -> tuple[int, torch.Tensor]:
    """(number of blocks, block tables over shuffled blocks never using the dummy block 0, one spare column)."""
    per_seq = [(n + PAGE - 1) // PAGE for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).int()
    tables = torch.zeros(len(seq_lens), max(per_seq) + 1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = order[used : used + nb]
        used += nb
    return num_blocks, tables.to(DEVICE)


def step_rows(query_lens: list[int], seq_lens: list[int], tables: torch.Tensor, padding: int):
    """(row_seq, positions, slot_mapping) of a step's rows, padding rows last (last sequence, position 0, slot 0)."""
    seq, pos = [], []
    for i, (q, n) in enumerate(zip(query_lens, seq_lens)):
        seq += [i] * q
        pos += range(n - q, n)
    row_seq = torch.tensor(seq + [len(seq_lens) - 1] * padding, dtype=torch.int32, device=DEVICE)
    positions = torch.tensor(pos + [0] * padding, dtype=torch.int64, device=DEVICE)
    slots = ref.token_slots(tables, row_seq.long(), positions[:, None], PAGE)[:, 0]
    slots[len(pos):] = 0
    return row_seq, positions, slots


def branches(kind: str) -> list[ref.CompressorBranch]:
    """The layer's layout (models/deepseek_v4_attention.py): CSA's two overlapping series, HCA's one."""
    if kind == "csa":
        state = 4 * D + 4 * DI
        return [ref.CompressorBranch(0, 2 * D, state, D, True), ref.CompressorBranch(4 * D, 2 * DI, state + D, DI, True)]
    return [ref.CompressorBranch(0, D, 2 * D, D, False)]


def row_width(kind: str) -> int:
    return 4 * D + 4 * DI + D + DI if kind == "csa" else 3 * D


@pytest.mark.parametrize("kind,rate", [("csa", 4), ("hca", 16)])
@pytest.mark.parametrize("extend", [False, True])
def test_compression_writes_every_closed_group_as_the_reference(kind, rate, extend):
    gen = torch.Generator().manual_seed(20 + rate + extend)
    seq_lens = [2 * rate, 3 * rate + 1, rate, 5 * rate]
    query_lens = [2 * rate, 3, rate - 1, 1] if extend else [1, 1, 1, 1]
    num_blocks, tables = paged(seq_lens, gen)
    rows = torch.randn(num_blocks * PAGE, row_width(kind), generator=gen).to(DEVICE)
    row_seq, positions, slots = step_rows(query_lens, seq_lens, tables, padding=2)
    inv_freq = (1.0 / 10000 ** (torch.arange(ROPE_PAIRS) / ROPE_PAIRS)).to(DEVICE)
    want, before = rows.clone(), rows.clone()
    for branch in branches(kind):
        series = 2 if branch.overlap else 1
        bias = torch.randn(rate, series * branch.dim, generator=gen).to(DEVICE)
        weight = (1 + 0.3 * torch.randn(branch.dim, generator=gen)).to(DEVICE)
        ref.compress_groups(want, branch, tables, row_seq, positions, slots, rate, bias, weight, 1e-6, inv_freq, PAGE)
        v4_compress.compress_groups(rows, branch, tables, row_seq, positions, slots, rate, bias, weight, 1e-6,
                                    inv_freq, PAGE)  # fmt: skip
    closing = slots[(positions + 1) % rate == 0]
    assert closing.numel() >= (3 if extend else 1)
    region = torch.zeros_like(rows, dtype=torch.bool)
    for branch in branches(kind):
        region[closing, branch.entry_at : branch.entry_at + branch.dim] = True
    assert not torch.isclose(want[region], before[region]).any()  # the reference did write every entry
    assert torch.equal(rows[~region], want[~region])  # state and other rows untouched, padding rows included
    assert relative_error(rows[region], want[region]) < 1e-5


def attention_case(seed: int, extend: bool):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [37, 5, 23, 50]
    query_lens = [6, 5, 1, 2] if extend else [1, 1, 1, 1]
    num_blocks, tables = paged(seq_lens, gen)
    row_seq, positions, _ = step_rows(query_lens, seq_lens, tables, padding=2)
    latents = torch.randn(num_blocks * PAGE, D, generator=gen).to(DEVICE)
    rows = torch.randn(num_blocks * PAGE, row_width("csa"), generator=gen).to(DEVICE)
    q = torch.randn(row_seq.shape[0], HEADS, D, generator=gen).to(DEVICE)
    sinks = torch.randn(HEADS, generator=gen).to(DEVICE)
    return gen, tables, row_seq, positions, latents, rows, q, sinks


HEADS, WINDOW, RATE = 5, 6, 4


def test_compressed_indexer_scores_match_the_reference():
    gen, tables, row_seq, positions, _, rows, _, _ = attention_case(30, extend=True)
    t, hi = row_seq.shape[0], 3
    key_at = 4 * D + 4 * DI + D  # CSA's indexer key, after the entry (models/deepseek_v4_attention.py)
    n = tables.shape[1] * PAGE // RATE  # the block tables hold a spare column: columns past every row
    q = torch.randn(t, hi, DI, generator=gen).to(DEVICE)
    weights = torch.randn(t, hi, generator=gen).to(DEVICE)
    visible = (positions + 1) // RATE
    keys = rows[ref.entry_slots(tables, row_seq, RATE, n, PAGE), key_at : key_at + DI]
    want = ref.indexer_scores(q, weights, keys, visible)
    got = torch.full((t, n), float("nan"), device=DEVICE)
    dsa_indexer.compressed_indexer_scores(q, weights, rows, key_at, RATE, PAGE, tables, row_seq,
                                          (visible - 1).int(), n, out=got)  # fmt: skip
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not got.isnan().any()
    finite = torch.isfinite(want)
    assert int(finite.sum()) > t and relative_error(got[finite], want[finite]) < 1e-5


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
@pytest.mark.parametrize("extend,splits", [(False, 1), (False, 3), (True, 2)])
def test_attention_matches_the_reference(kind, extend, splits):
    gen, tables, row_seq, positions, latents, rows, q, sinks = attention_case(40 + splits, extend)
    entry_at = 4 * D + 4 * DI
    rate = {"sliding": 0, "hca": RATE, "csa": RATE}[kind]
    idx = None
    if kind == "csa":  # a selection with -1 holes and some entries not yet visible, which must be skipped
        k = 5
        n = (positions + 1) // RATE
        idx = (torch.rand(row_seq.shape[0], k, generator=gen).to(DEVICE) * (n[:, None] + 2)).int() - 1
        idx[0, 0] = -1
    args = (q, latents, rows if rate else None, entry_at, tables, row_seq, positions, sinks, D**-0.5, WINDOW, rate,
            PAGE, idx)  # fmt: skip
    want = ref.v4_attention(*args)
    got = torch.full_like(want, float("nan"))
    v4_attention.v4_attention(*args, out=got, num_splits=splits)
    assert relative_error(got, want) < 1e-5
