"""FP8 expert kernels against their PyTorch reference (dequantize, then the experts), on CPU through
Triton's interpreter.

fp32 activations, tiny shapes whose sizes are not multiples of the tiles or of the scale blocks
(intermediate 24 with 16-row blocks: gate's and up's last blocks are partial), fresh random inputs,
padding rows poisoned with NaN: the streaming path, the grouped GEMM in W8A16 and in W8A8, block
and per-channel scales, an expert-parallel slice; then FusedMoE with an Fp8MoEMethod on the kernel
path against its own CPU path. Both sides read the same fp8 weights, so W8A16 differs only by fp32
summation order; W8A8 is compared with a reference that quantizes x and the activated product the
same way. The bf16 model-shape and CUDA-graph versions live in tests/gpu/test_moe_fp8.py.
"""

from __future__ import annotations

import torch
from interp_setup import kernel_device, use_interpreter

use_interpreter("graphserve.layers.moe")

import pytest  # noqa: E402

from graphserve.kernels import moe_fused  # noqa: E402
from graphserve.kernels.fp8_quant import (  # noqa: E402
    per_token_group_quant_reference,
    quantize_weight_blocks,
    quantize_weight_channels,
)
from graphserve.kernels.moe_config import GemmTile, GemvTile  # noqa: E402
from graphserve.kernels.moe_fp8_reference import experts_fp8_reference  # noqa: E402
from graphserve.kernels.moe_fused import fused_experts  # noqa: E402
from graphserve.kernels.moe_reference import expert_counts_reference, softmax_topk_reference  # noqa: E402
from graphserve.layers.moe import FusedMoE, SoftmaxTopK  # noqa: E402
from graphserve.layers.quant.config import Fp8Config  # noqa: E402
from graphserve.layers.quant.fp8_moe import Fp8MoEMethod, quantize_stack  # noqa: E402

DEVICE = kernel_device()
E = 6
GEMM = (GemmTile(16, 16, 32, 2, 4, 2), GemmTile(16, 32, 32, 1, 4, 2))
GEMV = (GemvTile(8, 32, 4), GemvTile(16, 32, 4))


def _randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)


def _fp8_experts(gen, num_local, h, inter, block):
    """fp8 w13 (gate and up quantized apart, as a checkpoint stores them), w2 and their scales."""
    w13, w2 = _randn(num_local, 2 * inter, h, gen=gen, scale=0.3), _randn(num_local, h, inter, gen=gen, scale=0.3)
    qg, sg = quantize_stack(w13[:, :inter], block)
    qu, su = quantize_stack(w13[:, inter:], block)
    q2, s2 = quantize_stack(w2, block)
    return torch.cat([qg, qu], 1), q2, torch.cat([sg, su], 1).contiguous(), s2.contiguous()


def test_quantize_stack_matches_the_per_matrix_quantizers():
    gen = torch.Generator().manual_seed(0)
    w = _randn(3, 40, 72, gen=gen)
    q, s = quantize_stack(w, (16, 32))
    q1, s1 = quantize_stack(w, None)
    for e in range(3):
        qb, sb = quantize_weight_blocks(w[e], 16, 32)
        qc, sc = quantize_weight_channels(w[e])
        assert torch.equal(q[e].float(), qb.float()) and torch.equal(s[e], sb)
        assert torch.equal(q1[e].float(), qc.float()) and torch.equal(s1[e, :, 0], sc)


# (path, w8a8, block, tokens, k, first local expert, local experts, padding rows, hidden, intermediate)
CASES = [
    ("gemv", False, (16, 32), 5, 2, 0, E, True, 64, 24),
    ("gemv", False, None, 4, 3, 2, 3, True, 40, 32),
    ("gemm", False, (16, 32), 7, 2, 0, E, True, 64, 24),
    ("gemm", False, None, 6, 2, 1, 4, False, 40, 32),
    ("gemm", True, (16, 32), 7, 3, 0, E, True, 64, 24),
    ("gemm", True, None, 5, 2, 0, E, True, 64, 32),
]


@pytest.mark.parametrize("path,w8a8,block,t,k,expert_start,num_local,padded,h,inter", CASES)
def test_fp8_experts_match_reference(path, w8a8, block, t, k, expert_start, num_local, padded, h, inter,
                                     monkeypatch):  # fmt: skip
    if DEVICE.type == "cpu":
        # Triton 3.6's interpreter rounds to e4m3 without the carry across a power of two (see
        # tests/test_fp8_interp.py, which checks the quantization kernel itself); here the
        # activations are quantized by the reference quantizer so the GEMM is what is compared
        monkeypatch.setattr(moe_fused, "per_token_group_quant", per_token_group_quant_reference)
    gen = torch.Generator().manual_seed(t * k + num_local + h)
    w13, w2, s13, s2 = _fp8_experts(gen, num_local, h, inter, block)
    x = _randn(t, h, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(t, E, gen=gen), k, True)
    valid = (torch.arange(t, device=DEVICE) < t - 2) if padded else None
    if padded:  # padding rows hold whatever the batch buffer held: nothing of them may leak
        x[-2:] = float("nan")
        topk_w[-2:] = float("nan")
    counts = torch.full((E,), -1, dtype=torch.int32, device=DEVICE)
    out = fused_experts(x, w13, w2, topk_w, topk_ids, valid=valid, expert_start=expert_start, counts=counts,
                        w13_scale=s13, w2_scale=s2, weight_block=block, path=path, w8a8=w8a8 if path == "gemm"
                        else None, gemm_tiles=GEMM, gemv_tiles=GEMV)  # fmt: skip
    want = experts_fp8_reference(x, w13, w2, s13, s2, block, topk_w, topk_ids, valid, expert_start, w8a8=w8a8)
    assert want.abs().max() > 0.1  # the comparison is not between near-zero outputs
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(counts.cpu(), expert_counts_reference(topk_ids, valid, E).cpu())
    if padded:
        assert torch.equal(out[-2:].cpu(), torch.zeros(2, h))


def test_fp8_experts_refuse_malformed_scales():
    gen = torch.Generator().manual_seed(5)
    w13, w2, s13, s2 = _fp8_experts(gen, E, 64, 24, (16, 32))
    x = _randn(2, 64, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(2, E, gen=gen), 2, True)
    with pytest.raises(ValueError, match=r"w13_scale must be contiguous float32 \(6, 4, 2\)"):
        fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13[:, :3].contiguous(), w2_scale=s2,
                      weight_block=(16, 32))  # fmt: skip
    with pytest.raises(ValueError, match="w2_scale"):
        fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2.double(), weight_block=(16, 32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_experts(x, w13.float(), w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, weight_block=(16, 32))


@pytest.mark.parametrize("block", [(16, 32), None])
def test_fp8_layer_kernel_path_matches_cpu_path(block):
    """An Fp8MoEMethod layer quantizing model-dtype experts at load: kernels vs dequantized CPU path."""
    gen = torch.Generator().manual_seed(21)
    h, inter = 64, 24
    layer = FusedMoE(E, 2, h, inter, SoftmaxTopK(E, 2, False), dtype=torch.float32).to(DEVICE)
    Fp8MoEMethod(Fp8Config(block=block, serialized=False)).create_weights(layer)
    assert layer.w13_weight.dtype == torch.float8_e4m3fn and layer.act_dtype == torch.float32
    w13, w2 = _randn(E, 2 * inter, h, gen=gen, scale=0.3), _randn(E, h, inter, gen=gen, scale=0.3)
    for e in range(E):
        layer.load_weight("w13_weight", layer.w13_weight, w13[e, :inter], (e, "w1"))
        layer.load_weight("w13_weight", layer.w13_weight, w13[e, inter:], (e, "w3"))
        layer.load_weight("w2_weight", layer.w2_weight, w2[e], (e, "w2"))
    x, logits = _randn(6, h, gen=gen), _randn(6, E, gen=gen)
    layer.use_kernels = False
    want = layer(x, logits, valid=torch.tensor(4, device=DEVICE))
    # the CPU path computes on the dequantized weights: e4m3 keeps ~2^-4 relative per weight
    bf = layer.quant_method.dequantized(layer, torch.float32)
    assert (bf[0] - w13).abs().max() <= w13.abs().max() * 2**-4 and (bf[1] - w2).abs().max() <= w2.abs().max() * 2**-4
    layer.use_kernels = True
    got = layer(x, logits, valid=torch.tensor(4, device=DEVICE))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert int(layer.expert_counts.sum()) == 8


def test_tuner_sweeps_fp8_experts_and_writes_a_table_the_kernels_accept(monkeypatch):
    """``moe_tune --dtype float8_e4m3fn``'s control flow on the interpreter (wall-clock timing, two tiles)."""
    import json
    import time

    from benchmarks import moe_tune
    from graphserve.kernels.moe_config import MoeTiles

    def wall_ms(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    h, inter = 64, 32
    monkeypatch.setattr(moe_tune, "DEVICE", DEVICE)
    monkeypatch.setattr(moe_tune, "FP8_BLOCK", (16, 32))
    monkeypatch.setattr(moe_tune, "graph_ms", wall_ms)
    monkeypatch.setattr(moe_tune, "QUICK_TOKENS", [1, 4])
    monkeypatch.setattr(moe_tune, "GEMV_TILES", [GemvTile(8, 32, 4), GemvTile(4, 64, 4)])
    monkeypatch.setattr(moe_tune, "gemm_candidates", lambda per_expert, gated, quick: [GemmTile(16, 16, 32, 1, 4, 3)])
    tiles, rows = moe_tune.tune(E, h, inter, 2, torch.float8_e4m3fn, quick=True, budget_s=600)
    assert tiles.buckets == (2, 8) and [r["tokens"] for r in rows] == [1, 4]
    assert tiles.gemv_gate_up == GemvTile(8, 32, 4)  # the 64-wide K step would cross a 32-wide scale block
    again = MoeTiles.from_json(json.loads(json.dumps(tiles.to_json())))
    gen = torch.Generator().manual_seed(8)
    w13, w2, s13, s2 = _fp8_experts(gen, E, h, inter, (16, 32))
    x = _randn(5, h, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(5, E, gen=gen), 2, True)
    out = fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, weight_block=(16, 32), tiles=again)
    want = experts_fp8_reference(x, w13, w2, s13, s2, (16, 32), topk_w, topk_ids)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
