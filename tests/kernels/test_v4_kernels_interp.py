"""DeepSeek-V4's Triton kernels (kernels/v4_compress.py, kernels/v4_attention.py, the compressed indexer scores of
kernels/dsa_indexer.py) against kernels/v4_reference.py, on CPU through Triton's interpreter.

fp32, tiny shapes (entry dims of 16 and 8, windows of 6, rates 4 and 16, blocks of 4 and 8), shuffled block tables,
fresh random pages (entries and real accumulators), decode rows, extend chunks closing several groups (the first
group of a sequence among them, which has no previous group in CSA) and ending mid-group, padding rows, one split
and several. Every access of every launch is
bounds-checked (tests/support/interp_bounds.py). The real shapes, bf16 and CUDA graphs are tests/gpu/test_deepseek_v4_gpu.py.
"""

from __future__ import annotations

import itertools

import torch
from interp_bounds import bounds_checked
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error
from paged_utils import shuffled_tables

use_interpreter()

import pytest  # noqa: E402

from graphserve.kernels import dsa_indexer, v4_attention, v4_compress  # noqa: E402
from graphserve.kernels import v4_reference as ref  # noqa: E402
from graphserve.layers.kv_layout import CompactCache  # noqa: E402

DEVICE = kernel_device()
PAGE, D, DI, ROPE_PAIRS = 4, 16, 8, 3


@pytest.fixture(autouse=True)
def _bounds():
    if DEVICE.type == "cuda":
        yield
        return
    with bounds_checked():
        yield


def paged(seq_lens: list[int], gen: torch.Generator, page: int = PAGE) -> tuple[int, torch.Tensor]:
    """(number of blocks, block tables over shuffled blocks never using the dummy block 0, one spare column)."""
    num_blocks, tables = shuffled_tables(seq_lens, page, gen)
    return num_blocks, tables.to(DEVICE)


def step_rows(query_lens: list[int], seq_lens: list[int], padding: int):
    """(row_seq, positions, query_start_loc) of a step's rows, padding rows last (last sequence, position 0)."""
    seq, pos = [], []
    for i, (q, n) in enumerate(zip(query_lens, seq_lens)):
        seq += [i] * q
        pos += range(n - q, n)
    row_seq = torch.tensor(seq + [len(seq_lens) - 1] * padding, dtype=torch.int32, device=DEVICE)
    positions = torch.tensor(pos + [0] * padding, dtype=torch.int64, device=DEVICE)
    qsl = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32, device=DEVICE)
    return row_seq, positions, qsl


def branches(kind: str) -> list[ref.CompressorBranch]:
    """The layer's layout (models/deepseek_v4_attention.py): CSA's two overlapping series, HCA's one."""
    if kind == "csa":
        return [ref.CompressorBranch(2 * D, D, True, 0, 0), ref.CompressorBranch(2 * DI, DI, True, D, 4 * D)]
    return [ref.CompressorBranch(D, D, False, 0, 0)]


def layout(kind: str) -> tuple[int, int]:
    """(checkpoint floats, entry width): models/deepseek_v4_shape.V4Shape's state_floats and entry_width."""
    return (4 * (D + DI), D + DI) if kind == "csa" else (2 * D, D)


def random_pages(kind: str, rate: int, num_blocks: int, page: int, gen: torch.Generator) -> torch.Tensor:
    """Fresh random entries behind fresh random checkpoints (any log-sum-exp and weighted mean is an accumulator)."""
    sf, ew = layout(kind)
    return torch.randn(num_blocks, CompactCache(rate, ew, 4 * sf).page_width(page, 4), generator=gen).to(DEVICE)


def projections(kind: str, rate: int, t: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """Per branch: (kv, gate, position bias, norm weight), fresh random."""
    out = []
    for b in branches(kind):
        kv, gate = (torch.randn(t, b.width, generator=gen).to(DEVICE) for _ in range(2))
        bias = torch.randn(rate, b.width, generator=gen).to(DEVICE)
        out.append((kv, gate, bias, (1 + 0.3 * torch.randn(b.dim, generator=gen)).to(DEVICE)))
    return out


def compress(impl, kind: str, rate: int, pages: torch.Tensor, proj, tables, row_seq, positions, qsl, page: int,
             inv_freq: torch.Tensor) -> None:  # fmt: skip
    sf, ew = layout(kind)
    init = ref.start_checkpoints(ref.checkpoints(pages, sf), tables, positions, qsl, page)
    for b, (kv, gate, bias, weight) in zip(branches(kind), proj):
        impl.compress_groups(pages, b, kv, gate, init, tables, row_seq, positions, qsl, rate, bias, weight, 1e-6,
                             inv_freq, page, sf, ew)  # fmt: skip


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal infinities (an empty accumulator's max), finite values within fp32 rounding."""
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not got.isnan().any()
    finite = torch.isfinite(want)
    assert relative_error(got[finite], want[finite]) < 1e-5


INV_FREQ = 1.0 / 10000 ** (torch.arange(ROPE_PAIRS) / ROPE_PAIRS)


@pytest.mark.parametrize("kind,rate,page", [("csa", 4, 8), ("hca", 16, 4)])
@pytest.mark.parametrize("extend", [False, True])
def test_compression_writes_entries_and_checkpoints_as_the_reference(kind, rate, page, extend):
    """One step over pages already holding entries and checkpoints: a block with several entry rows (CSA at 8) and
    blocks shorter than a group (HCA at 4); decode rows, an extend chunk closing several groups (a sequence's first
    among them, which has no previous group in CSA), padding rows."""
    gen = torch.Generator().manual_seed(20 + rate + extend)
    seq_lens = [2 * rate, 3 * rate + 1, rate, 5 * rate]
    query_lens = [2 * rate, 3, rate - 1, 1] if extend else [1, 1, 1, 1]
    num_blocks, tables = paged(seq_lens, gen, page)
    row_seq, positions, qsl = step_rows(query_lens, seq_lens, padding=2)
    pages = random_pages(kind, rate, num_blocks, page, gen)
    proj = projections(kind, rate, row_seq.shape[0], gen)
    want, got = pages.clone(), pages.clone()
    compress(ref, kind, rate, want, proj, tables, row_seq, positions, qsl, page, INV_FREQ.to(DEVICE))
    compress(v4_compress, kind, rate, got, proj, tables, row_seq, positions, qsl, page, INV_FREQ.to(DEVICE))
    # a written max may keep its old value, so writes are told by block: every sequence's last one, and entries
    touched = (want != pages).any(dim=1)
    assert int(touched.sum()) >= 4
    assert torch.equal(got[~touched], pages[~touched])  # no other block written, padding rows' dummy block included
    same(got, want)


@pytest.mark.parametrize("kind,rate,page", [("csa", 4, 8), ("csa", 4, 4), ("hca", 16, 4)])
def test_chunked_steps_pool_every_group_as_one_softmax_over_its_tokens(kind, rate, page):
    """Two sequences fed in uneven chunks beside each other (one token a step for a while, a chunk spanning groups
    and blocks, a chunk ending mid-group): every entry equals transformers' pooling of its group's projections all
    at once (kernels/v4_reference.pool_groups), on the kernel and on the reference. The checkpoints carry each open
    group across steps, so this is what proves them."""
    gen = torch.Generator().manual_seed(50 + rate + page)
    n = 3 * rate + 3
    chunks = [[1, 1, rate + 1, 2, n], [rate + 2, 1, 1, 1, n]]
    num_blocks, tables = paged([n, n], gen, page)
    proj = projections(kind, rate, 2 * n, gen)  # rows [0, n) the first sequence's tokens, [n, 2n) the second's
    inv_freq = INV_FREQ.to(DEVICE)
    for impl in (ref, v4_compress):
        pages = random_pages(kind, rate, num_blocks, page, gen)
        done = [0, 0]
        for step in range(len(chunks[0])):
            lens = [min(c[step], n - d) for c, d in zip(chunks, done)]
            live = [i for i in range(2) if lens[i]]
            if not live:
                break
            row_seq, positions, qsl = step_rows([lens[i] for i in live], [done[i] + lens[i] for i in live], 1)
            rows = torch.cat([torch.arange(i * n + done[i], i * n + done[i] + lens[i]) for i in live] + [
                torch.tensor([0])]).to(DEVICE)  # fmt: skip
            step_proj = [tuple(x[rows] for x in p[:2]) + p[2:] for p in proj]
            compress(impl, kind, rate, pages, step_proj, tables[live], row_seq, positions, qsl, page, inv_freq)
            done = [d + x for d, x in zip(done, lens)]
        sf, ew = layout(kind)
        groups = n // rate
        first = torch.arange(groups, device=DEVICE) * rate
        for i in range(2):
            for b, (kv, gate, bias, weight) in zip(branches(kind), proj):
                tok = (i * n + first[:, None] + torch.arange(rate, device=DEVICE)).long()
                g = gate[tok] + bias
                prev = (tok - rate).clamp(min=i * n)
                want = ref.pool_groups(kv[tok], g, kv[prev], gate[prev] + bias, first > 0, weight, 1e-6, first,
                                       inv_freq) if b.overlap else \
                    ref.pool_groups(kv[tok], g, None, None, None, weight, 1e-6, first, inv_freq)  # fmt: skip
                got = ref.entries(pages, tables, torch.tensor([i], device=DEVICE), torch.arange(groups)[None].to(DEVICE),
                                  rate, page, sf, ew, b.entry_at, b.dim)[0]  # fmt: skip
                assert relative_error(got, want) < 1e-5, (impl.__name__, i, b.entry_at)


def attention_case(seed: int, extend: bool):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [37, 5, 23, 50]
    query_lens = [6, 5, 1, 2] if extend else [1, 1, 1, 1]
    num_blocks, tables = paged(seq_lens, gen)
    row_seq, positions, _ = step_rows(query_lens, seq_lens, padding=2)
    latents = torch.randn(num_blocks * PAGE, D, generator=gen).to(DEVICE)
    pages = random_pages("csa", RATE, num_blocks, PAGE, gen)
    q = torch.randn(row_seq.shape[0], HEADS, D, generator=gen).to(DEVICE)
    sinks = torch.randn(HEADS, generator=gen).to(DEVICE)
    return gen, tables, row_seq, positions, latents, pages, q, sinks


HEADS, WINDOW, RATE = 5, 6, 4


def test_compressed_indexer_scores_match_the_reference():
    gen, tables, row_seq, positions, _, pages, _, _ = attention_case(30, extend=True)
    t, hi = row_seq.shape[0], 3
    sf, ew = layout("csa")
    n = tables.shape[1] * PAGE // RATE  # the block tables hold a spare column: columns past every row
    q = torch.randn(t, hi, DI, generator=gen).to(DEVICE)
    weights = torch.randn(t, hi, generator=gen).to(DEVICE)
    visible = (positions + 1) // RATE
    every = torch.arange(n, device=DEVICE).expand(t, -1)
    keys = ref.entries(pages, tables, row_seq, every, RATE, PAGE, sf, ew, D, DI)  # CSA's key after the latent
    want = ref.indexer_scores(q, weights, keys, visible)
    got = torch.full((t, n), float("nan"), device=DEVICE)
    dsa_indexer.compressed_indexer_scores(q, weights, pages, D, RATE, PAGE, tables, row_seq, (visible - 1).int(), n,
                                          out=got, state_floats=sf, entry_width=ew)  # fmt: skip
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not got.isnan().any()
    finite = torch.isfinite(want)
    assert int(finite.sum()) > t and relative_error(got[finite], want[finite]) < 1e-5


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
@pytest.mark.parametrize("extend,splits", [(False, 1), (False, 3), (True, 2)])
def test_attention_matches_the_reference(kind, extend, splits):
    gen, tables, row_seq, positions, latents, pages, q, sinks = attention_case(40 + splits, extend)
    sf, ew = layout("csa")
    rate = {"sliding": 0, "hca": RATE, "csa": RATE}[kind]
    idx = None
    if kind == "csa":  # a selection with -1 holes and some entries not yet visible, which must be skipped
        k = 5
        n = (positions + 1) // RATE
        idx = (torch.rand(row_seq.shape[0], k, generator=gen).to(DEVICE) * (n[:, None] + 2)).int() - 1
        idx[0, 0] = -1
    args = (q, latents, pages if rate else None, 0, tables, row_seq, positions, sinks, D**-0.5, WINDOW, rate,
            PAGE, idx, sf, ew)  # fmt: skip
    want = ref.v4_attention(*args)
    got = torch.full_like(want, float("nan"))
    v4_attention.v4_attention(*args, out=got, num_splits=splits)
    assert relative_error(got, want) < 1e-5


def window_pages(tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor, num_blocks: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """(a latent page map ``[num_blocks]`` int32, the page count): the blocks some row's window reaches get distinct
    shuffled pages; the others (before every window of their sequence, the dummy block) the dummy page 0, as the
    block manager leaves them (layers/kv_layout.py)."""
    first = torch.full((tables.shape[0],), 1 << 30, dtype=torch.int64)
    first.scatter_reduce_(0, row_seq.long().cpu(), positions.cpu(), "amin")
    needed = set()
    for s in range(tables.shape[0]):
        lo = max(0, int(first[s]) - WINDOW + 1) // PAGE
        needed |= {int(b) for b in tables[s, lo:].cpu() if int(b) != 0}
    pages = len(needed) + 3  # spare pages nobody maps
    order = (torch.randperm(pages - 1, generator=gen) + 1).int()
    page_map = torch.zeros(num_blocks, dtype=torch.int32)
    page_map[sorted(needed)] = order[: len(needed)]
    return page_map.to(DEVICE), pages


@pytest.mark.parametrize("kind", ["sliding", "csa"])
@pytest.mark.parametrize("extend,splits", [(False, 3), (True, 2)])
def test_attention_reads_the_window_through_a_latent_page_map(kind, extend, splits):
    """Latents in their own shuffled pages, fewer than the blocks: the kernel reads the pages the map names, and the
    dummy page 0 (what blocks outside every window map to) holds NaN, so a read of it would show."""
    gen, tables, row_seq, positions, by_block, pages, q, sinks = attention_case(60 + splits, extend)
    num_blocks = by_block.shape[0] // PAGE
    page_map, n_pages = window_pages(tables, row_seq, positions, num_blocks, gen)
    assert n_pages < num_blocks and int((page_map == 0).sum()) > 1  # some real blocks hold no latent page
    latents = torch.full((n_pages * PAGE, D), float("nan"), device=DEVICE)
    latents[PAGE:] = torch.randn((n_pages - 1) * PAGE, D, generator=gen).to(DEVICE)
    sf, ew = layout("csa")
    rate, idx = (RATE, None) if kind == "csa" else (0, None)
    if kind == "csa":
        n = (positions + 1) // RATE
        idx = (torch.rand(row_seq.shape[0], 5, generator=gen).to(DEVICE) * (n[:, None] + 2)).int() - 1
    args = (q, latents, pages if rate else None, 0, tables, row_seq, positions, sinks, D**-0.5, WINDOW, rate,
            PAGE, idx, sf, ew)  # fmt: skip
    want = ref.v4_attention(*args, latent_page=page_map)
    assert not want.isnan().any()
    got = torch.full_like(want, float("nan"))
    v4_attention.v4_attention(*args, out=got, num_splits=splits, latent_page=page_map)
    assert relative_error(got, want) < 1e-5
    # the same latents laid out by block id give the same answer: the map changes where they live, nothing else
    flat = torch.zeros(num_blocks * PAGE, D, device=DEVICE)
    mapped = page_map.nonzero().flatten().long()
    blocks = (mapped[:, None] * PAGE + torch.arange(PAGE, device=DEVICE)).flatten()
    flat[blocks] = latents[(page_map.long()[mapped][:, None] * PAGE + torch.arange(PAGE, device=DEVICE)).flatten()]
    assert relative_error(ref.v4_attention(q, flat, *args[2:]), want) < 1e-6
