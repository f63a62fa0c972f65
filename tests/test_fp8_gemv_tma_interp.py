"""benchmarks/fp8_gemv_tma.py's experimental TMA-fed one-row FP8 matmul against the dequantized product, whole
and split along K, on fresh random inputs (the interpreter on CPU; the benchmark checks every tile on the GPU
before it times it)."""

from __future__ import annotations

import torch
from interp_setup import use_interpreter

use_interpreter("benchmarks.fp8_gemv_tma")

import pytest  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from benchmarks.fp8_gemv_tma import tma_gemv  # noqa: E402
from graphserve.kernels.fp8_quant import quantize_weight_channels  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("split", [1, 2])
def test_tma_gemv_matches_the_dequantized_product(split: int) -> None:
    gen = torch.Generator().manual_seed(7 + split)
    n, k, bn, bk = 48, 512, 16, 128
    wq, ws = quantize_weight_channels((torch.randn(n, k, generator=gen) * 0.05).to(DEVICE))
    x = torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16)
    out = torch.empty(n, device=DEVICE)
    got = tma_gemv(x, wq, ws.reshape(-1).contiguous(), TensorDescriptor.from_tensor(wq, [bn, bk]), out, bn, bk, 4, split)
    want = x.float() @ (wq.float() * ws.reshape(-1, 1)).T
    torch.testing.assert_close(got[None], want, rtol=1e-5, atol=1e-5)


def test_tma_gemv_refuses_partial_tiles() -> None:
    wq, ws = quantize_weight_channels(torch.randn(40, 512).to(DEVICE))
    x = torch.randn(1, 512).to(DEVICE, torch.bfloat16)
    desc = TensorDescriptor.from_tensor(wq, [16, 128])
    with pytest.raises(ValueError, match=r"n a multiple of block_n=16"):
        tma_gemv(x, wq, ws.reshape(-1).contiguous(), desc, torch.empty(40, device=DEVICE), 16, 128, 4, 1)
