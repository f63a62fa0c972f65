"""The DSA Triton kernels (kernels/dsa.py) against their references (kernels/dsa_reference.py), on CPU through
Triton's interpreter.

fp32, tiny shapes whose sizes are not powers of two, shuffled block tables, fresh random inputs, outputs
poisoned with NaN: the index cache write (plain and FP8), indexer scores over both cache forms for decode,
extend and padding rows, the radix top-k (ties, rows shorter than k, rows crossing the select's step edges,
-inf and negative scores) and its torch.topk twin, and sparse MLA (one split and several, both tile layouts,
an fp8 latent cache, -1 entries, shuffled index order). The real-shape, bf16 and CUDA-graph versions live
in tests/gpu/test_dsa.py. Every access of every launch is bounds-checked (tests/support/interp_bounds.py).
"""

from __future__ import annotations

import torch
from interp_bounds import bounds_checked
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error
from paged_utils import shuffled_tables, token_slots

use_interpreter()

import pytest  # noqa: E402

from graphserve.kernels import dsa  # noqa: E402
from graphserve.kernels import dsa_reference as ref  # noqa: E402
from graphserve.kernels.dsa_topk import choose_topk_method, topk_indices_triton  # noqa: E402
from graphserve.kernels.mla_config import MLATile  # noqa: E402

DEVICE = kernel_device()
D, HI, RANK, ROPE, HEADS, PAGE = 24, 3, 24, 8, 5, 4


@pytest.fixture(autouse=True)
def _bounds():
    """Under the interpreter, every masked-in lane of every launch must fall inside the launch's tensors
    (tests/support/interp_bounds.py): a stray read there is an illegal address, or another sequence's row, on the GPU."""
    if DEVICE.type == "cuda":
        yield
        return
    with bounds_checked():
        yield


def paged(seq_lens: list[int], gen: torch.Generator):
    """(number of blocks, block tables over shuffled blocks never using the dummy block 0, each sequence's slots)."""
    num_blocks, tables = shuffled_tables(seq_lens, PAGE, gen)
    return num_blocks, tables.to(DEVICE), [s.to(DEVICE) for s in token_slots(tables, seq_lens, PAGE)]


def rows(query_lens: list[int], seq_lens: list[int], padding: int):
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return dsa.token_rows(qsl, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), sum(query_lens) + padding)


def same_sets(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.sort(-1).values.cpu(), want.sort(-1).values.cpu())


@pytest.mark.parametrize("fp8", [False, True])
def test_write_index_cache(fp8):
    gen = torch.Generator().manual_seed(10)
    k = (torch.randn(7, D, generator=gen) * torch.tensor([0.01, 1, 40, 1, 3, 1, 1])[:, None]).to(DEVICE)
    k[3] = 0.0
    slots = torch.tensor([5, 17, 2, 9, 0, 11, 23], device=DEVICE)
    shape, dtype = ref.index_cache_shape(6, PAGE, D, fp8)
    dtype = dtype or torch.float32
    cache = torch.randint(0, 255, shape, dtype=torch.uint8, generator=gen).to(DEVICE) if fp8 else \
        torch.full(shape, float("nan"), device=DEVICE)  # fmt: skip
    expected = cache.clone()
    dsa.write_index_cache(k, cache, slots)
    ref.write_index_cache(k, expected, slots)
    if not fp8:
        torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)  # untouched slots stay NaN
        return
    back, back_ref = ref.read_index_keys(cache, slots), ref.read_index_keys(expected, slots)
    assert torch.isfinite(back).all()
    # the scales agree bit for bit, and so do the values but where torch rounds up into the next binade: Triton's
    # interpreter casts to e4m3 without the exponent's carry there (127.9 gives 64, not 128). The GPU test
    # (tests/gpu/test_dsa.py) compares the compiled cast
    flat = cache.view(-1, D + 4)[slots]
    flat_ref = expected.view(-1, D + 4)[slots]
    assert torch.equal(flat[:, D:], flat_ref[:, D:])
    differ = back != back_ref
    assert differ.float().mean() < 0.05
    assert torch.equal(back[differ] * 2, back_ref[differ])
    assert ((flat_ref[:, :D][differ] & 0x07) == 0).all()  # torch's value is a power of two: a carry
    untouched = torch.ones(cache.view(-1, D + 4).shape[0], dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert torch.equal(cache.view(-1, D + 4)[untouched.to(DEVICE)], expected.view(-1, D + 4)[untouched.to(DEVICE)])


@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_scores(fp8):
    gen = torch.Generator().manual_seed(11)
    query_lens, seq_lens = [1, 5, 1, 1], [70, 9, 3, 66]
    num_blocks, tables, slots = paged(seq_lens, gen)
    shape, dtype = ref.index_cache_shape(num_blocks, PAGE, D, fp8)
    cache = torch.zeros(shape, dtype=dtype or torch.float32, device=DEVICE)
    for n, s in zip(seq_lens, slots):
        ref.write_index_cache(torch.randn(n, D, generator=gen).to(DEVICE), cache, s)
    seq, pos = rows(query_lens, seq_lens, padding=2)
    t = seq.shape[0]
    q = torch.randn(t, HI, D, generator=gen).to(DEVICE)
    weights = torch.randn(t, HI, generator=gen).to(DEVICE)
    max_len = 131  # three key tiles; the third holds no visible key of any row
    want = ref.indexer_scores(q, weights, cache, tables, seq, pos, max_len)
    got = torch.full((t, max_len), float("nan"), device=DEVICE)
    dsa.indexer_scores(q, weights, cache, tables, seq, pos, max_len, out=got)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not got.isnan().any()
    finite = torch.isfinite(want)
    assert relative_error(got[finite], want[finite]) < 1e-5


def tie_scores(t: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Few distinct values (the lower-position rule decides most picks), negatives, zeros of both signs, -inf."""
    scores = torch.randint(-3, 4, (t, length), generator=gen).float() * 0.75
    scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum()), generator=gen) < 0.5, 0.0, -0.0)
    scores[:, 1::7] = float("-inf")
    return scores


@pytest.mark.parametrize("method", ["triton", "torch"])
def test_topk_matches_reference(method):
    gen = torch.Generator().manual_seed(12)
    k, length = 9, 61
    pos = torch.tensor([60, 2, 8, 9, 0, 33, 47, 60], dtype=torch.int32)  # shorter than k, exactly k, k + 1, longer
    scores = tie_scores(pos.shape[0], length, gen)
    want = ref.topk_indices(scores, pos, k)
    scores, pos = scores.to(DEVICE), pos.to(DEVICE)
    if method == "triton":  # 16 keys a step: every pass crosses step edges
        got = topk_indices_triton(
            scores, pos, k, out=torch.full((8, k), -7, dtype=torch.int32, device=DEVICE), block=16
        )
    else:
        got = dsa.topk_indices(scores, pos, k, method="torch")
    assert got.dtype == torch.int32 and got.shape == (8, k)
    assert same_sets(got, want)


@pytest.mark.parametrize(
    ("rows", "length", "method"),
    [(1, 4096, "triton"), (64, 4096, "triton"), (1, 32768, "torch"), (16, 32768, "triton"), (1, 131072, "torch"),
     (16, 131072, "torch"), (64, 131072, "triton"), (2048, 32768, "triton")],
)  # fmt: skip
def test_topk_method_follows_measurement(rows, length, method):
    """The faster select of each point benchmarks/dsa_kernels.py measured on an H100 (132 SMs), and a prefill chunk."""
    assert choose_topk_method(rows, length, 132) == method


def test_topk_long_row_default_step():
    gen = torch.Generator().manual_seed(13)
    k, length = 40, 5000  # two 4096-key steps a pass
    pos = torch.tensor([4999, 4500, 30], dtype=torch.int32)
    scores = tie_scores(3, length, gen)
    scores[0] = torch.randn(length, generator=gen)  # distinct values: all four bytes decide
    want = ref.topk_indices(scores, pos, k)
    got = dsa.topk_indices(scores.to(DEVICE), pos.to(DEVICE), k)
    assert same_sets(got, want)


def latent_cache(seq_lens: list[int], gen: torch.Generator, fp8: bool):
    num_blocks, tables, slots = paged(seq_lens, gen)
    cache = torch.full((num_blocks, PAGE, 1, RANK + ROPE), float("nan"))
    flat = cache.view(-1, RANK + ROPE)
    for n, s in zip(seq_lens, slots):
        flat[s.cpu()] = torch.randn(n, RANK + ROPE, generator=gen)
    flat[0] = torch.randn(RANK + ROPE, generator=gen)  # the dummy block's first slot, which padding rows read
    if fp8:
        cache = cache.nan_to_num(0.0).to(torch.float8_e4m3fn)
    return cache.to(DEVICE), tables


@pytest.mark.parametrize(
    ("tile", "splits", "fp8"),
    [
        (MLATile(False, 16, 16, 4, 1), 1, False),  # head-major, the output written directly
        (MLATile(False, 16, 16, 4, 1), 3, False),  # three splits merged, one of them empty for k = 20
        (MLATile(True, 16, 16, 4, 1), 2, False),  # token-major
        (MLATile(False, 16, 16, 4, 1), 2, True),  # an fp8 latent cache
    ],
)
def test_sparse_mla_matches_reference(tile, splits, fp8):
    gen = torch.Generator().manual_seed(14)
    query_lens, seq_lens, k = [1, 4, 1], [30, 12, 5], 20
    cache, tables = latent_cache(seq_lens, gen, fp8)
    seq, pos = rows(query_lens, seq_lens, padding=2)
    t = seq.shape[0]
    scores = torch.randn(t, max(seq_lens), generator=gen).to(DEVICE)
    idx = ref.topk_indices(scores, pos, k)
    idx = idx[:, torch.randperm(k, generator=gen).to(DEVICE)].contiguous()  # -1 entries anywhere in a row
    q_lat = torch.randn(t, HEADS, RANK, generator=gen).to(DEVICE)
    q_rope = torch.randn(t, HEADS, ROPE, generator=gen).to(DEVICE)
    want = ref.sparse_mla(q_lat, q_rope, cache, tables, seq, idx, 0.4)
    out = torch.full_like(q_lat, float("nan"))
    dsa.sparse_mla(q_lat, q_rope, cache, tables, seq, idx, 0.4, out=out, tile=tile, num_splits=splits)
    assert relative_error(out, want) < 1e-5


def test_indexer_topk_exact_ties():
    """Small integers make every product and sum exact, so the kernels' scores tie exactly where the reference's do."""
    gen = torch.Generator().manual_seed(15)
    seq_lens, k = [50, 7, 33], 8
    num_blocks, tables, slots = paged(seq_lens, gen)
    cache = torch.zeros(num_blocks, PAGE, D, device=DEVICE)
    for n, s in zip(seq_lens, slots):
        ref.write_index_cache(torch.randint(-1, 2, (n, D), generator=gen).float().to(DEVICE), cache, s)
    seq, pos = rows([1, 1, 2], seq_lens, padding=1)
    q = torch.randint(-1, 2, (5, HI, D), generator=gen).float().to(DEVICE)
    weights = torch.tensor([0.5, 0.25, 1.0], device=DEVICE).expand(5, HI).contiguous()
    want = ref.indexer_topk(q, weights, cache, tables, seq, pos, 64, k)
    got = dsa.indexer_topk(q, weights, cache, tables, seq, pos, 64, k)
    assert same_sets(got, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter's accesses (CPU only)")
def test_bounds_checker_is_live():
    """A position past the block table's last column is caught, so the checks above are in force."""
    gen = torch.Generator().manual_seed(16)
    cache, tables = latent_cache([8], gen, fp8=False)
    q_lat, q_rope = torch.randn(1, HEADS, RANK, generator=gen), torch.randn(1, HEADS, ROPE, generator=gen)
    idx = torch.tensor([[0, 5, tables.shape[1] * PAGE + 64]], dtype=torch.int32)
    with pytest.raises(Exception, match="out of bounds"):
        dsa.sparse_mla(q_lat, q_rope, cache, tables, torch.zeros(1, dtype=torch.int32), idx, 0.4,
                       tile=MLATile(False, 16, 16, 4, 1), num_splits=1)  # fmt: skip
