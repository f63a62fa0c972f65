"""The greedy argmax kernels against torch.argmax, through Triton's interpreter.

Fresh random logits in bf16, fp16 and fp32, vocabularies that are and are not multiples of the tile,
splits of several chunks per row; each row's maximum planted at several indices, on both sides of
chunk boundaries, so the first index must win across lanes, tiles and chunks; rows of -inf with one
finite entry, NaNs (torch takes the first NaN), signed zeros and infinities. The ids must be equal,
not close. The model-shape and CUDA-graph versions live in tests/gpu/test_argmax_gpu.py.
"""

from __future__ import annotations

import torch
from interp_setup import kernel_device, use_interpreter

use_interpreter()

import pytest  # noqa: E402

from graphserve.kernels.argmax import argmax_triton, chunking, greedy_argmax  # noqa: E402

DEVICE = kernel_device()
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INF, NAN = float("inf"), float("nan")
# quiet NaNs with the sign bit set (0xFFC0, 0xFE00, 0xFFC00000): torch.argmax takes them as the maximum too
NEGATIVE_NAN = {torch.bfloat16: (torch.int16, -64), torch.float16: (torch.int16, -512),
                torch.float32: (torch.int32, -4194304)}  # fmt: skip


def split(batch: int, vocab: int) -> dict:
    """A split of about four chunks per row with tiles small enough to loop a few times in each (the widest
    tile where the interpreter would otherwise take long)."""
    block = 4096 if batch * vocab > 10**6 else 256 if vocab < 8192 else 1024
    return {"programs": 4 * batch, "block": block}


def planted(batch: int, vocab: int, dtype: torch.dtype, chunk: int, gen: torch.Generator) -> torch.Tensor:
    """Random logits whose rows repeat their maximum at random indices and either side of chunk boundaries."""
    x = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype)
    top = x.float().max().item() + 1.0
    boundaries = [c for c in range(chunk, vocab, chunk)]
    for r in range(batch):
        cols = torch.randint(0, vocab, (3,), generator=gen).tolist()
        if boundaries:
            b = boundaries[r % len(boundaries)]
            cols += [b, b - 1] if r % 2 else [b]  # the first either side of the boundary
        x[r, cols] = top
    return x


def check(x: torch.Tensor, **kw) -> None:
    out = argmax_triton(x.to(DEVICE), **kw)
    assert out.dtype == torch.int64 and out.shape == (x.shape[0],)
    assert out.cpu().tolist() == torch.argmax(x, dim=-1).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,vocab", [(1, 1000), (1, 4099), (1, 32000), (3, 1000), (3, 4099), (3, 32000),
                                         (64, 1000), (64, 4099), (64, 32000)])  # fmt: skip
def test_matches_torch_argmax_with_ties(batch, vocab, dtype):
    gen = torch.Generator().manual_seed(batch * 100003 + vocab)
    kw = split(batch, vocab)
    chunks, chunk = chunking(batch, vocab, **kw)
    assert vocab <= 1000 or chunks > 1  # the ties straddle real chunk boundaries
    x = planted(batch, vocab, dtype, chunk, gen)
    if batch > 1:
        x[1] = -INF
        x[1, vocab - 1] = -3.0  # the only finite entry, in the last (partial) tile
        x[-1, vocab // 2] = NAN
    check(x, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_split(dtype):
    gen = torch.Generator().manual_seed(7)
    x = planted(3, 4099, dtype, 4096, gen)
    check(x)


def test_greedy_argmax_dispatch(monkeypatch):
    """Off CUDA greedy_argmax never reaches the Triton pair; on CUDA it runs it (the spy records the call)."""
    import graphserve.kernels.argmax as argmax_mod

    calls = []

    def spy(logits, **kw):
        calls.append(logits.device.type)
        return argmax_triton(logits, **kw)

    monkeypatch.setattr(argmax_mod, "argmax_triton", spy)
    x = planted(3, 4099, torch.float32, 4096, torch.Generator().manual_seed(8))
    assert greedy_argmax(x).tolist() == torch.argmax(x, dim=-1).tolist() and calls == []
    if torch.cuda.is_available():
        assert greedy_argmax(x.cuda()).cpu().tolist() == torch.argmax(x, dim=-1).tolist() and calls == ["cuda"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(dtype):
    """NaN of either sign beats +inf and the first NaN wins; all -inf gives 0; -0.0 ties +0.0; +inf ties +inf."""
    vocab = 700
    rows = torch.randn(8, vocab, generator=torch.Generator().manual_seed(3)).to(dtype)
    rows[0, 650] = NAN
    int_dtype, bits = NEGATIVE_NAN[dtype]
    rows[0, 20] = torch.tensor(bits, dtype=int_dtype).view(dtype)
    assert rows[0, 20].isnan() and rows[0, 20].signbit()
    rows[0, 10] = INF
    rows[1] = -INF
    rows[2] = -1.0
    rows[2, [300, 5]] = torch.tensor([0.0, -0.0], dtype=dtype)  # -0.0 first: it wins the tie
    rows[3, [699, 400, 401]] = INF
    rows[4] = NAN
    rows[5] = -INF
    rows[5, 699] = NAN
    rows[6, :] = 0.0
    rows[7] = -INF
    rows[7, [512, 513]] = -1e4 if dtype != torch.float16 else -6e4  # ties across a tile boundary
    for kw in ({"programs": 1, "block": 64}, {"programs": 40, "block": 128}, {}):
        check(rows, **kw)


def test_row_views():
    gen = torch.Generator().manual_seed(5)
    wide = planted(5, 3000, torch.bfloat16, 512, gen)
    check(wide[:, 100:2900], programs=20, block=256)  # rows of a wider buffer: unit stride, row stride 3000
    check(wide[:, :300].t(), programs=8, block=64)  # vocab along the buffer's rows: copied first
    assert argmax_triton(torch.empty(0, 10, device=DEVICE)).shape == (0,)


@pytest.mark.parametrize(
    "bad,message",
    [
        (torch.zeros(10), r"2-D \[batch, vocab\].*shape \(10,\) dtype torch.float32"),
        (torch.zeros(2, 3, 4), r"shape \(2, 3, 4\)"),
        (torch.zeros(2, 10, dtype=torch.int64), r"dtype torch.int64"),
        (torch.zeros(2, 10, dtype=torch.float64), r"dtype torch.float64"),
        (torch.zeros(2, 0), r"logits \(2, 0\) must have a vocab of 1"),
    ],
)
def test_bad_logits_are_refused(bad, message):
    for fn in (greedy_argmax, argmax_triton):
        with pytest.raises(ValueError, match=message):
            fn(bad.to(DEVICE))


def test_block_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="block must be a power of two, got 96"):
        argmax_triton(torch.zeros(2, 10, device=DEVICE), block=96)


def test_step_breakdown_counts_the_kernels_as_sampling():
    """benchmarks/step_breakdown.py files kernels by name: these must land in the sampling family."""
    from benchmarks.step_breakdown import family
    from graphserve.kernels import argmax

    for kernel in (argmax._argmax_partial_kernel, argmax._argmax_combine_kernel):
        assert family(kernel.__name__) == "sampling (argmax)"
