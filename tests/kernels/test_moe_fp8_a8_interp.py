"""The FP8 grouped GEMM that quantizes its activations in registers (``GemmTile.a8``: kernels/moe_gemm.py's
``A_QUANT``), on CPU through Triton's interpreter.

Triton's interpreter rounds fp32 to e4m3 its own way (tests/kernels/test_fp8_interp.py: elements off by up to
one binade), so the kernel's quantization of a and the reference's differ at a few elements. As in
tests/kernels/test_fp8_stream_interp.py's FP8-dot tests: a loose bound against the reference that quantizes the
activations the same way (kernels/moe_fp8_reference.py, ``w8a8=True``), which a wrong scale or a missed
K step exceeds; and exact tests where every row's K step holds e4m3 values times one power of two with
448 among them, so quantizing loses nothing and the output must match the unquantized reference. Tiles
of 16 rows over a few pairs per expert: every tile holds rows past the pair count. The tile table's new
field and the tuner's a8 tiles are checked here too; the model shapes run in tests/gpu/test_moe_fp8.py.
"""

from __future__ import annotations

import json

import torch
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error
from tune_utils import before_never_kept

use_interpreter()

import pytest  # noqa: E402

from graphserve.kernels import moe_fused  # noqa: E402
from graphserve.kernels.fp8_quant import per_token_group_quant_reference  # noqa: E402
from graphserve.kernels.moe_align import moe_align  # noqa: E402
from graphserve.kernels.moe_config import GemmTile, MoeTiles  # noqa: E402
from graphserve.kernels.moe_fp8_reference import dequantize_experts, experts_fp8_reference  # noqa: E402
from graphserve.kernels.moe_fused import fused_experts, gemm_step  # noqa: E402
from graphserve.kernels.moe_reference import expert_counts_reference, softmax_topk_reference  # noqa: E402
from graphserve.kernels.moe_scales import ExpertScales  # noqa: E402
from graphserve.layers.quant.fp8_moe import quantize_stack  # noqa: E402

DEVICE = kernel_device()
E = 6
BLOCK = (16, 32)
A8 = GemmTile(16, 16, 32, 1, 4, 2, a8=True)
A8_WIDE = GemmTile(16, 32, 32, 1, 4, 2, a8=True)  # block_n across two 16-row scale blocks
W8A16 = GemmTile(16, 32, 32, 1, 4, 2)  # per-column scales (block_n past the scale block): no K_SCALES rounding


def _randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)


def _fp8_experts(gen, h, inter, block=BLOCK):
    w13, w2 = _randn(E, 2 * inter, h, gen=gen, scale=0.3), _randn(E, h, inter, gen=gen, scale=0.3)
    qg, sg = quantize_stack(w13[:, :inter], block)
    qu, su = quantize_stack(w13[:, inter:], block)
    q2, s2 = quantize_stack(w2, block)
    return torch.cat([qg, qu], 1), q2, torch.cat([sg, su], 1).contiguous(), s2.contiguous()


def _spy_a_quant(monkeypatch) -> list[bool]:
    """The A_QUANT constexpr of every grouped-GEMM launch from here on, in order."""
    spy = []
    kernel = moe_fused.fused_moe_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                spy.append(kwargs["A_QUANT"])
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(moe_fused, "fused_moe_gemm_kernel", Spy())
    return spy


def _exact_rows(m: int, k: int, group: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose every ``group``-wide K step is e4m3 values times 2^-6, with 448 (e4m3's largest) among
    them: the step's scale is 2^-6 and quantizing it is exact, however the fp32 -> e4m3 rounding goes."""
    levels = (_randn(m, k, gen=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    levels[:, ::group] = 448.0
    return (levels * 2.0**-6).to(dtype)


# (gate_up tile, down tile, w8a8 rule, hidden, intermediate): both steps in the GEMM (a K tail on down:
# 24 columns in one 32-wide step), several K steps on both, one step alone (the other W8A16, or W8A8 with
# its quantization launch), a tile across scale blocks
CASES = [
    (A8, A8, False, 64, 24),
    (A8_WIDE, A8, False, 96, 64),
    (A8, W8A16, False, 64, 48),
    (W8A16, A8_WIDE, False, 64, 40),
    (A8, GemmTile(16, 16, 32, 1, 4, 2), True, 64, 48),
]


@pytest.mark.parametrize("gate_up,down,w8a8,h,inter", CASES)
def test_a8_matches_the_quantized_reference(gate_up, down, w8a8, h, inter, monkeypatch):
    # the W8A8 step's separate quantization: the reference quantizer, so the GEMM is what is compared
    monkeypatch.setattr(moe_fused, "per_token_group_quant", per_token_group_quant_reference)
    gen = torch.Generator().manual_seed(h + inter + gate_up.block_n)
    w13, w2, s13, s2 = _fp8_experts(gen, h, inter)
    t, k = 9, 2
    x = _randn(t, h, gen=gen)
    x[0, : BLOCK[1]] = 0.0  # a real row with an all-zero K step: scale MIN_SCALE and zeros, not NaN
    topk_w, topk_ids = softmax_topk_reference(_randn(t, E, gen=gen), k, True)
    valid = torch.arange(t, device=DEVICE) < t - 2
    x[-2:] = float("nan")  # padding rows: never read
    topk_w[-2:] = float("nan")
    counts = torch.full((E,), -1, dtype=torch.int32, device=DEVICE)
    out = fused_experts(x, w13, w2, topk_w, topk_ids, valid=valid, counts=counts, w13_scale=s13, w2_scale=s2,
                        weight_block=BLOCK, path="gemm", w8a8=w8a8, gemm_tiles=(gate_up, down))  # fmt: skip
    assert not out.isnan().any()
    assert torch.equal(out[-2:].cpu(), torch.zeros(2, h))
    assert torch.equal(counts.cpu(), expert_counts_reference(topk_ids, valid, E).cpu())
    quantized = experts_fp8_reference(x, w13, w2, s13, s2, BLOCK, topk_w, topk_ids, valid, w8a8=True)
    plain = experts_fp8_reference(x, w13, w2, s13, s2, BLOCK, topk_w, topk_ids, valid)
    assert quantized[:-2].abs().max() > 0.1
    # the interpreter's e4m3 rounding: the bound is the size of the activations' quantization error
    # (e4m3 keeps 3 mantissa bits), which a wrong scale block or a missed K step exceeds many times
    assert relative_error(out[:-2], quantized[:-2]) < 0.1
    assert relative_error(out[:-2], plain[:-2]) < 0.1


def test_a8_gate_up_is_exact_where_x_quantizes_exactly():
    """Gated: one quantized x tile serves the gate and the up dot; down in W8A16 (per-column scales)."""
    gen = torch.Generator().manual_seed(3)
    h, inter, t, k = 96, 48, 9, 2
    w13, w2, s13, s2 = _fp8_experts(gen, h, inter)
    x = _exact_rows(t, h, BLOCK[1], gen, torch.float16)
    topk_w, topk_ids = softmax_topk_reference(_randn(t, E, gen=gen), k, True)
    for gate_up in (A8, A8_WIDE):
        out = fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, weight_block=BLOCK,
                            path="gemm", w8a8=False, gemm_tiles=(gate_up, W8A16))  # fmt: skip
        want = experts_fp8_reference(x, w13, w2, s13, s2, BLOCK, topk_w, topk_ids)
        assert want.abs().max() > 0.1
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("tile", [A8, A8_WIDE])
def test_a8_down_is_exact_where_the_activations_quantize_exactly(tile):
    """Not gated (down, times the routing weight) on exact activations, launched alone over the sort."""
    gen = torch.Generator().manual_seed(4)
    h, inter, t, k = 40, 96, 9, 2
    w2, s2 = quantize_stack(_randn(E, h, inter, gen=gen, scale=0.3), BLOCK)
    act = _exact_rows(t * k, inter, BLOCK[1], gen, torch.float16)
    topk_w, topk_ids = softmax_topk_reference(_randn(t, E, gen=gen), k, True)
    counts = torch.empty(E, dtype=torch.int32, device=DEVICE)
    align = moe_align(topk_ids, None, counts, 0, E, tile.block_m)
    out = torch.full((t * k, h), float("nan"), dtype=torch.float16, device=DEVICE)
    gemm_step(act, w2, ExpertScales(s2, *BLOCK), out, tile, align, topk_w, 1, False, False)
    d2 = dequantize_experts(w2, s2, BLOCK)
    ids = topk_ids.reshape(-1).long()
    want = torch.einsum("pk,pnk->pn", act.float(), d2[ids]) * topk_w.reshape(-1, 1)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(out.float(), want, rtol=2e-3, atol=2e-3)


def test_a8_refuses_a_step_other_than_the_scale_block_and_other_scales():
    gen = torch.Generator().manual_seed(5)
    h, inter = 64, 24
    w13, w2, s13, s2 = _fp8_experts(gen, h, inter)
    x = _randn(4, h, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(4, E, gen=gen), 2, True)
    wide = GemmTile(16, 16, 64, 1, 4, 2, a8=True)
    with pytest.raises(ValueError, match=r"block_k equal to the weight scale block's K 32 \(got block_k=64\)"):
        fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, weight_block=BLOCK, path="gemm",
                      gemm_tiles=(wide, W8A16))  # fmt: skip
    with pytest.raises(ValueError, match=r"K 32 \(got block_k=16\)"):
        fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, weight_block=BLOCK, path="gemm",
                      gemm_tiles=(W8A16, GemmTile(16, 32, 16, 1, 4, 2, a8=True)))  # fmt: skip
    qc13, sc13 = quantize_stack(w13.float(), None)
    qc2, sc2 = quantize_stack(w2.float(), None)
    with pytest.raises(ValueError, match="per-channel scales"):
        fused_experts(x, qc13, qc2, topk_w, topk_ids, w13_scale=sc13, w2_scale=sc2, weight_block=None, path="gemm",
                      gemm_tiles=(A8, A8))  # fmt: skip
    with pytest.raises(ValueError, match="no scales"):
        fused_experts(x, w13.float(), w2.float(), topk_w, topk_ids, path="gemm", gemm_tiles=(A8, A8))


def test_tile_table_keeps_a8_and_reads_older_tables_as_false():
    tiles = MoeTiles(8, None, None, (64, 512), (A8, W8A16), (W8A16, A8_WIDE))
    assert MoeTiles.from_json(json.loads(json.dumps(tiles.to_json()))) == tiles
    old = tiles.to_json()
    for bucket in old["buckets"].values():
        for tile in bucket.values():
            del tile["a8"]
    assert not any(t.a8 for t in MoeTiles.from_json(old).gate_up + MoeTiles.from_json(old).down)


def test_tuner_offers_a8_tiles_for_fp8_weights_only():
    from benchmarks.moe_tune import SMEM_LIMIT, gemm_candidates

    for gated in (True, False):
        for w8a8 in (False, True):
            a8 = [c for c in gemm_candidates(4, gated, False, fp8_block=(128, 128), w8a8=w8a8) if c.a8]
            assert a8 and {c.block_k for c in a8} == {128} and {c.num_warps for c in a8} == {4, 8}
            assert {c.block_n for c in a8} == {32, 64, 128} and {c.num_stages for c in a8} == {3, 4}
            assert all(c.num_stages * (2 * c.block_m * 128 + 2 * 128 * c.block_n) <= SMEM_LIMIT for c in a8)
        assert not any(c.a8 for c in gemm_candidates(4, gated, False))


def test_tuner_writes_a8_tiles_that_the_table_path_runs(monkeypatch):
    """``moe_tune --dtype float8_e4m3fn`` with only a8 tiles to choose from (wall-clock timing on the
    interpreter): the table keeps them, and fused_experts reading that table quantizes in the GEMM."""
    import time

    from benchmarks import moe_tune

    def wall_ms(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    h, inter, k = 64, 32, 2
    monkeypatch.setattr(moe_tune, "DEVICE", DEVICE)
    monkeypatch.setattr(moe_tune, "FP8_BLOCK", BLOCK)
    monkeypatch.setattr(moe_tune, "graph_ms", wall_ms)
    monkeypatch.setattr(moe_tune, "gemm_candidates", lambda per_expert, gated, quick, **space: [A8])
    monkeypatch.setattr(moe_tune._Bucket, "ms", before_never_kept(moe_tune._Bucket.ms))
    tiles, _ = moe_tune.tune(E, h, inter, k, torch.float8_e4m3fn, quick=False, budget_s=600, tokens=[4])
    assert tiles.gate_up == (A8,) and tiles.down == (A8,)
    again = MoeTiles.from_json(json.loads(json.dumps(tiles.to_json())))
    spy = _spy_a_quant(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    w13, w2, s13, s2 = _fp8_experts(gen, h, inter)
    x = _randn(4, h, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(4, E, gen=gen), k, True)
    out = fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, weight_block=BLOCK, tiles=again,
                        path="gemm")  # fmt: skip
    assert spy == [True, True]
    want = experts_fp8_reference(x, w13, w2, s13, s2, BLOCK, topk_w, topk_ids, w8a8=True)
    assert relative_error(out, want) < 0.1


@pytest.mark.parametrize("case", ["per_channel", "w8a16_asked"])
def test_table_a8_tiles_run_without_a8_where_the_call_cannot_take_them(case, monkeypatch):
    """A tuned table's a8 tile met by per-channel expert scales (a8 needs block scales), or by a caller asking
    for W8A16: the step runs the same tile without quantizing in the GEMM. Per channel the W8A8 rule still
    holds (the activations quantized per token by a launch before the GEMM); asked for W8A16, nothing is
    quantized. quantized_steps says which, and the product is that mode's reference."""
    if DEVICE.type == "cpu":  # the interpreter's e4m3 rounding (test_fp8_experts_match_reference)
        monkeypatch.setattr(moe_fused, "per_token_group_quant", per_token_group_quant_reference)
    h, inter, k, t = 64, 32, 2, 4
    table = MoeTiles(small_max_pairs=0, gemv_gate_up=None, gemv_down=None, buckets=(64,), gate_up=(A8,), down=(A8,))
    monkeypatch.setattr(moe_fused, "moe_tiles", lambda *args: table)
    gen = torch.Generator().manual_seed(21)
    block = None if case == "per_channel" else BLOCK
    w13, w2, s13, s2 = _fp8_experts(gen, h, inter, block)
    x = _randn(t, h, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(t, E, gen=gen), k, True)
    w8a8 = False if case == "w8a16_asked" else None
    quantized = case == "per_channel"  # t * k pairs >= W8A8_MIN_ROWS_PER_EXPERT (0) per expert
    assert moe_fused.W8A8_MIN_ROWS_PER_EXPERT == 0
    assert moe_fused.quantized_steps(t, k, w13, w2, s13, s2, block, w8a8=w8a8) == (quantized, quantized)
    spy = _spy_a_quant(monkeypatch)
    out = fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, weight_block=block, w8a8=w8a8)
    assert spy == [False, False]
    want = experts_fp8_reference(x, w13, w2, s13, s2, block, topk_w, topk_ids, w8a8=quantized)
    assert relative_error(out, want) < 1e-2
