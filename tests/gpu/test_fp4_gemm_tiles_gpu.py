"""The dense FP4 GEMM under every variant and tile ``graphserve tune --tables fp4`` may write into its table
(graphserve/tuning/fp4_gemm.candidates, at this card's SM count), compiled, at real shapes: Llama-3-8B's o_proj
(NVFP4) and gpt-oss's fused q/k/v (MXFP4; K 2880, not whole 128-column steps), at a decode batch below 64 rows (x
the MMA's first operand), at 64 rows and at a prefill-sized batch (a tile needing more shared memory or registers
than the card has may be refused, as the tuner then times it inf; the default tile never); and fp4_linear captured
in a CUDA graph with a split-K tile, replayed equal to eager.

Fresh random bf16 activations and random FP4 bytes with random block scales, against ``fp4_gemm_reference`` (for the
fp8 variant x quantized per token as the kernel's input is; for dequant_fp8 the load-time FP8 conversion too); bf16
output rounding sets the thresholds.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import capture, rel_err
from test_fp4 import fp4_weight
from triton.runtime.errors import OutOfResources

from graphserve.kernels import fp4_gemm as gemm_mod
from graphserve.kernels.common import sm_count
from graphserve.kernels.fp4_gemm import fp4_gemm, fp4_gemm_reference, fp4_linear
from graphserve.kernels.fp4_gemm_config import DEQUANT_VARIANTS, VARIANTS, Fp4GemmConfig, Fp4GemmTile
from graphserve.kernels.fp4_layout import GROUP
from graphserve.tuning.fp4_gemm import DEQUANT_ROWS, candidates

DT = torch.bfloat16
SHAPES = {"nvfp4": (4096, 4096), "mxfp4": (5120, 2880)}  # llama3-8b o_proj, gpt-oss q/k/v
ROWS = (13, 64, 300)  # x first (16-row tiles); 64 rows; past 256 rows (128-row tiles and the 64-row alternative)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_every_tuner_candidate_matches_the_reference(fmt, variant):
    n, k = SHAPES[fmt]
    gen = torch.Generator("cuda").manual_seed(n + k + len(variant))
    packed, scale, gs = fp4_weight((), n, k, fmt, gen)
    bias = torch.randn(n, device="cuda", dtype=DT, generator=gen)
    sms = sm_count(torch.device("cuda"))
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=DT, generator=gen)
        ref = fp4_gemm_reference(x, packed, scale, gs, fmt, bias, variant=variant)
        tiles = candidates(variant, m, n, k, GROUP[fmt], sms, quick=False)
        assert tiles or (variant in DEQUANT_VARIANTS and m < DEQUANT_ROWS), (fmt, variant, m)
        for i, cfg in enumerate(tiles):
            out = torch.full((m, n), float("nan"), device="cuda", dtype=DT)
            try:
                fp4_gemm(x, packed, scale, gs, fmt, bias, out, variant=variant, config=cfg)
            except OutOfResources:  # more shared memory or registers than this card has: the tuner times it inf
                assert i > 0, f"the default tile does not fit this card: {fmt} {variant} m={m} {cfg}"
                continue
            assert rel_err(out, ref) < 1e-2, (fmt, variant, m, cfg)


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_fp4_linear_with_a_split_k_tile_replays_equal_to_eager(monkeypatch, variant):
    """The table's tile taken through fp4_linear inside a capture: the partials' buffer comes from the graph's pool
    and the second launch sums them in the same order on every replay, so replay equals eager bit for bit."""
    tile = Fp4GemmTile(variant, Fp4GemmConfig(16 if variant == "bf16" else 64, 32 if variant == "bf16" else 64,
                                              128 if variant == "bf16" else 32, split_k=4))  # fmt: skip
    monkeypatch.setattr(gemm_mod, "gemm_tile", lambda fmt, n, k, m, device, v: tile)
    monkeypatch.setattr(gemm_mod.Fp4Rule, "route", lambda self, fmt, n, k, m: variant)
    gen = torch.Generator("cuda").manual_seed(7)
    n, k = 4096, 14336  # llama3-8b's down projection: few columns, long K
    packed, scale, gs = fp4_weight((), n, k, "nvfp4", gen)
    x = torch.randn(40, k, device="cuda", dtype=DT, generator=gen)
    graph, out = capture(lambda: fp4_linear(x, packed, scale, gs, "nvfp4"))
    for _ in range(2):
        x.copy_(torch.randn(40, k, device="cuda", dtype=DT, generator=gen))
        graph.replay()
        eager = fp4_linear(x, packed, scale, gs, "nvfp4")
        assert torch.equal(out, eager)
        assert rel_err(out, fp4_gemm_reference(x, packed, scale, gs, "nvfp4", variant=variant)) < 1e-2
