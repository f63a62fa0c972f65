"""benchmarks/fp8_layer_stream.py's experimental one-launch decoder stream against its PyTorch reference, on fresh
random weights. The interpreter runs programs one after another, so here one program takes every item of the list
in order (its waits always find the counters full); the benchmark checks the many-program launch, every layer
against the reference, on the GPU before it times it.

Tolerance 5e-2 relative for each stage, from the launch's own inputs to it (``check``; the GPU run holds 2e-2):
Triton 3.6's interpreter truncates fp32 to bf16 where PyTorch rounds to nearest, always toward zero, so the
roundings' errors add rather than cancel: the norm rounds twice and gate and up once before silu(gate) * up rounds
again, and the product's element-wise error reaches 2.6% on these random weights (up to four ulps of bf16)."""

from __future__ import annotations

import torch
from interp_setup import use_interpreter

use_interpreter("benchmarks.fp8_layer_stream")

import pytest  # noqa: E402

from benchmarks.fp8_layer_stream import LayerStream, StreamTile, check, random_weights, reference_layer  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("tile", [StreamTile((8, 8, 4, 2), 4, 1, 1), StreamTile((16, 4, 8, 8), 2, 1, 3)])
def test_one_program_matches_the_reference_layer_by_layer(tile) -> None:
    """Three layers of a small llama-shaped stack (down's K not a power of two: the padded, masked tile)."""
    w = random_weights(3, 64, 96, 96, DEVICE, seed=tile.bn[0])
    stream = LayerStream(w, tile, programs=1)
    gen = torch.Generator().manual_seed(tile.bn[1])
    stream.down[0].copy_(torch.randn(64, generator=gen).to(DEVICE, torch.bfloat16))
    stream.rm[0].copy_(torch.randn(64, generator=gen).to(DEVICE, torch.bfloat16))
    stream()
    assert int(stream.err.item()) == 0
    assert stream.cnt.tolist() == [[96, 64, 96, 64]] * 3  # rows counted
    assert check(stream, tolerance=5e-2) < 5e-2
    last = reference_layer(w, 2, stream.down[2], stream.rm[2], stream.eps)["down"]
    assert last.abs().sum() > 0 and not stream.down.isnan().any()


def test_a_wait_that_never_opens_is_counted_not_hung() -> None:
    """Two programs under the interpreter: program 0 waits for program 1's qkv tiles, which run after it; the
    poll cap lets it give up and count the timeout, which ``check`` refuses."""
    w = random_weights(2, 64, 96, 96, DEVICE)
    stream = LayerStream(w, StreamTile((8, 8, 4, 2), 4, 1), programs=2)
    stream(spin_cap=3)
    assert int(stream.err.item()) > 0
    with pytest.raises(AssertionError, match="timed out"):
        check(stream)


def test_tiles_must_divide_the_projections() -> None:
    w = random_weights(1, 64, 96, 96, DEVICE)
    with pytest.raises(ValueError, match="must divide"):
        LayerStream(w, StreamTile((64, 8, 4, 2), 4, 1), programs=1)
