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
from model_utils import relative_error
from tune_utils import before_never_kept

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

from test_moe_interp import E, _randn, routed_tokens  # noqa: E402  # isort: skip

DEVICE = kernel_device()
GEMM = (GemmTile(16, 16, 32, 2, 4, 2), GemmTile(16, 32, 32, 1, 4, 2))
GEMV = (GemvTile(8, 32, 4), GemvTile(16, 32, 4))


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


# streaming tiles whose K step spans several 32-wide scale blocks (their rows in one 16-row block: the scales
# multiply the activation per column, K_SCALES), and a gate_up tile whose 32 rows span two block rows (its step
# stays capped at one block)
# (gate_up and down tiles, hidden, intermediate, k, the launches' (K_SCALES, BLOCK_K) for gate_up and down): over
# 16x32 blocks, case 1 steps 64 and 128 wide across blocks (down's 128 over an intermediate of 96, masked past it);
# case 2 steps 128 over a hidden of 96 and 64 over an intermediate of 80 (a K tail); case 3's gate_up tile has 32
# rows over 16-row blocks, so its step stays one block (32), beside a down step of 64 across blocks
WIDE_STEPS = [
    ((GemvTile(8, 64, 4), GemvTile(16, 128, 4)), 64, 96, 3, [(True, 64), (True, 128)]),
    ((GemvTile(4, 128, 4), GemvTile(8, 64, 4)), 96, 80, 2, [(True, 128), (True, 64)]),
    ((GemvTile(32, 64, 4), GemvTile(16, 64, 4)), 64, 64, 2, [(False, 32), (True, 64)]),
]


@pytest.mark.parametrize("gemv,h,inter,k,launched", WIDE_STEPS)
def test_streaming_steps_across_scale_blocks_match_reference(gemv, h, inter, k, launched, monkeypatch):
    """K steps past the scale block, with K tails, against the reference; the launches take K_SCALES and the step
    the case states."""
    block = (16, 32)
    gen = torch.Generator().manual_seed(h + inter + k)
    w13, w2, s13, s2 = _fp8_experts(gen, E, h, inter, block)
    x = _randn(4, h, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(4, E, gen=gen), k, True)
    spies = {name: _LaunchSpy(getattr(moe_fused, name))
             for name in ("fused_moe_gemv_gate_up_kernel", "fused_moe_gemv_down_kernel")}  # fmt: skip
    for name, spy in spies.items():
        monkeypatch.setattr(moe_fused, name, spy)
    out = fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, weight_block=block, path="gemv",
                        gemv_tiles=gemv)  # fmt: skip
    want = experts_fp8_reference(x, w13, w2, s13, s2, block, topk_w, topk_ids, None, 0)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert [(spy.launches[0]["K_SCALES"], spy.launches[0]["BLOCK_K"]) for spy in spies.values()] == launched
    assert [len(spy.launches) for spy in spies.values()] == [1, 1]


def test_stream_step_rule():
    """moe_scales.stream_step: a step past the block's K only where the tile's rows lie in one block-scale row;
    per-channel scales take the tile's step as it is."""
    from graphserve.kernels.moe_scales import ExpertScales, stream_step

    assert stream_step(128, 128, 16, 256) == (256, True)
    assert stream_step(128, 128, 16, 128) == (128, False)  # one block: the per-step row scales, as before
    assert stream_step(128, 128, 16, 64) == (64, False)
    assert stream_step(16, 32, 32, 64) == (32, False)  # 32 rows over 16-row blocks: capped at one block
    assert stream_step(48, 32, 32, 64) == (32, False)  # rows 32-63 span two 48-row block rows: capped
    channel = ExpertScales(torch.ones(1, 8, 1), 1, 512)
    assert channel.per_channel and channel.stream_step(512, 32) == (512, False)


@pytest.mark.parametrize("path,w8a8,block,t,k,expert_start,num_local,padded,h,inter", CASES)
def test_fp8_experts_match_reference(path, w8a8, block, t, k, expert_start, num_local, padded, h, inter,
                                     monkeypatch):  # fmt: skip
    if DEVICE.type == "cpu":
        # Triton 3.6's interpreter rounds to e4m3 without the carry across a power of two (see
        # tests/kernels/test_fp8_interp.py, which checks the quantization kernel itself); here the
        # activations are quantized by the reference quantizer so the GEMM is what is compared
        monkeypatch.setattr(moe_fused, "per_token_group_quant", per_token_group_quant_reference)
    gen = torch.Generator().manual_seed(t * k + num_local + h)
    w13, w2, s13, s2 = _fp8_experts(gen, num_local, h, inter, block)
    x, topk_w, topk_ids, valid = routed_tokens(gen, t, h, k, padded)
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


@pytest.mark.parametrize("padded", [False, True])
def test_static_activation_scales_match_reference(padded):
    """W8A8 with static activation scales (per-channel weights): x and the activated product quantized with one
    scale each, exactly as the reference does; the scales chosen small enough that some values clip at 448."""
    gen = torch.Generator().manual_seed(31 + padded)
    t, k, h, inter = 9, 2, 64, 24
    w13, w2, s13, s2 = _fp8_experts(gen, E, h, inter, None)
    x = _randn(t, h, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(t, E, gen=gen), k, True)
    valid = (torch.arange(t, device=DEVICE) < t - 2) if padded else None
    if padded:
        x[-2:] = float("nan")
    scales = (torch.tensor([x[: t - 2].abs().max().item() / 500.0], device=DEVICE),
              torch.tensor([0.002], device=DEVICE))  # fmt: skip
    assert (x[: t - 2].abs() / scales[0] > 448).any()  # some of x clips
    out = fused_experts(x, w13, w2, topk_w, topk_ids, valid=valid, w13_scale=s13, w2_scale=s2, path="gemm",
                        w8a8=True, gemm_tiles=GEMM, input_scales=scales)  # fmt: skip
    want = experts_fp8_reference(x, w13, w2, s13, s2, None, topk_w, topk_ids, valid, w8a8=True, input_scales=scales)
    dynamic = experts_fp8_reference(x, w13, w2, s13, s2, None, topk_w, topk_ids, valid, w8a8=True)
    assert want.abs().max() > 0.1 and not torch.allclose(want, dynamic, rtol=1e-3, atol=1e-3)  # the scales matter
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    if padded:
        assert torch.equal(out[-2:].cpu(), torch.zeros(2, h))


def test_static_activation_scales_are_refused_where_they_cannot_apply():
    gen = torch.Generator().manual_seed(33)
    w13, w2, s13, s2 = _fp8_experts(gen, E, 32, 16, (16, 16))
    x = _randn(4, 32, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(4, E, gen=gen), 2, True)
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match=r"input_scales \(static activation scales\) need fp8 experts with "
                                         r"per-channel scales .* weight_block=\(16, 16\)"):  # fmt: skip
        fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, weight_block=(16, 16),
                      input_scales=(one, one))
    w13, w2, s13, s2 = _fp8_experts(gen, E, 32, 16, None)
    with pytest.raises(ValueError, match=r"as two one-element fp32 tensors; .*\[\(\(2,\), torch.float32\)"):
        fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, input_scales=(one.repeat(2), one))


def test_static_fp8_layer_kernel_path_applies_the_largest_scales():
    """A layer holding a checkpoint's static scales: the kernel path quantizes with the largest of the layer's
    (``*_input_scale_max``), takes no norm-quantized hidden, and matches the reference with those scales."""
    gen = torch.Generator().manual_seed(35)
    h, inter, t = 64, 24, 6
    layer = FusedMoE(E, 2, h, inter, SoftmaxTopK(E, 2, False), dtype=torch.float32).to(DEVICE)
    Fp8MoEMethod(Fp8Config(block=None, activation_scheme="static", serialized=True)).create_weights(layer)
    w13, w2, s13, s2 = _fp8_experts(gen, E, h, inter, None)
    for e in range(E):
        for part, rows in (("w1", slice(0, inter)), ("w3", slice(inter, 2 * inter))):
            layer.load_weight("w13_weight", layer.w13_weight, w13[e, rows], (e, part))
            layer.load_weight("w13_weight_scale", layer.w13_weight_scale, s13[e, rows, 0], (e, part))
            layer.load_weight("w13_input_scale", layer.w13_input_scale, torch.tensor(0.01 + 0.001 * e), (e, part))
        layer.load_weight("w2_weight", layer.w2_weight, w2[e], (e, "w2"))
        layer.load_weight("w2_weight_scale", layer.w2_weight_scale, s2[e, :, 0], (e, "w2"))
        layer.load_weight("w2_input_scale", layer.w2_input_scale, torch.tensor(0.002 * (e + 1)), (e, "w2"))
    assert layer.w13_input_scale_max.item() == pytest.approx(0.01 + 0.001 * (E - 1))
    assert layer.w2_input_scale_max.item() == pytest.approx(0.002 * E)
    assert layer._hidden_quant_group(_randn(t, h, gen=gen)) is None
    layer.use_kernels = True
    x, logits = _randn(t, h, gen=gen), _randn(t, E, gen=gen)
    got = layer(x, logits)
    w, ids = layer.route(logits)
    scales = (layer.w13_input_scale_max, layer.w2_input_scale_max)
    want = experts_fp8_reference(x, layer.w13_weight, layer.w2_weight, layer.w13_weight_scale, layer.w2_weight_scale,
                                 None, w, ids, w8a8=True, input_scales=scales)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class _LaunchSpy:
    """Wraps a Triton kernel: records each launch's keyword arguments (the constexprs), then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


# W8A16 grouped GEMM with K steps spanning several scale blocks (K_SCALES: the tile's block_n divides the
# block's N): (block, hidden, intermediate, gate_up tile, down tile, (K_SCALES, BLOCK_K) of gate_up and
# of down). Case 1: gate_up's 64-wide step spans 4 blocks of 16, down's 32-wide step 2 of them with a
# masked K tail (intermediate 48); case 2: K tails on both (hidden 80: 5 blocks of 16 under two 64-wide
# steps; intermediate 40), gate's and up's last scale rows partial (40 rows in blocks of 32), down at
# block_n 32 = the block's N; case 3: down at block_n 32 over 16-row blocks keeps the per-column scales
# and its K step capped at the block's K, beside a gated K_SCALES gate_up
WIDE_K_CASES = [
    ((16, 16), 64, 48, GemmTile(16, 16, 64, 1, 4, 2), GemmTile(16, 16, 32, 1, 4, 2), [(True, 64), (True, 32)]),
    ((32, 16), 80, 40, GemmTile(16, 16, 64, 2, 4, 2), GemmTile(16, 32, 64, 1, 4, 2), [(True, 64), (True, 64)]),
    ((16, 16), 64, 48, GemmTile(16, 16, 64, 1, 4, 2), GemmTile(16, 32, 64, 1, 4, 2), [(True, 64), (False, 16)]),
]


@pytest.mark.parametrize("block,h,inter,gate_up,down,launched", WIDE_K_CASES)
def test_w8a16_k_steps_across_scale_blocks_match_reference(block, h, inter, gate_up, down, launched, monkeypatch):
    spy = _LaunchSpy(moe_fused.fused_moe_gemm_kernel)
    monkeypatch.setattr(moe_fused, "fused_moe_gemm_kernel", spy)
    gen = torch.Generator().manual_seed(h + inter + down.block_n)
    w13, w2, s13, s2 = _fp8_experts(gen, E, h, inter, block)
    t, k = 9, 3  # 27 pairs over 6 experts in 16-row tiles: every run ends in rows past the pair count
    x = _randn(t, h, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(t, E, gen=gen), k, True)
    valid = torch.arange(t, device=DEVICE) < t - 1
    x[-1:] = float("nan")
    out = fused_experts(x, w13, w2, topk_w, topk_ids, valid=valid, w13_scale=s13, w2_scale=s2, weight_block=block,
                        path="gemm", w8a8=False, gemm_tiles=(gate_up, down))  # fmt: skip
    assert [(c["K_SCALES"], c["BLOCK_K"]) for c in spy.launches] == launched
    want = experts_fp8_reference(x, w13, w2, s13, s2, block, topk_w, topk_ids, valid)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(out[-1:].cpu(), torch.zeros(1, h))


def test_w8a16_k_scales_rounding_at_16_bits():
    """K_SCALES rounds w * s (gate_up) and x * s (down) to the activation dtype: one rounding per
    product more than the per-column path.

    fp16, not bf16: Triton 3.6's interpreter returns garbage from tl.dot on bf16 operands (see
    tests/kernels/test_fp8_stream_interp.py); the rounding is the same code at either 16-bit type.
    """
    gen = torch.Generator().manual_seed(16)
    block, h, inter, t, k = (32, 32), 256, 128, 16, 4
    w13, w2, s13, s2 = _fp8_experts(gen, 8, h, inter, block)
    x = _randn(t, h, gen=gen).to(torch.float16)
    topk_w, topk_ids = softmax_topk_reference(_randn(t, 8, gen=gen), k, True)
    want = experts_fp8_reference(x, w13, w2, s13, s2, block, topk_w, topk_ids)
    errs = {}
    for name, bn in (("k_scales", 32), ("per_column", 64)):
        tile = GemmTile(16, bn, 128, 1, 4, 2)
        out = fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, weight_block=block,
                            path="gemm", w8a8=False, gemm_tiles=(tile, tile))  # fmt: skip
        errs[name] = relative_error(out, want)
    # the unit roundoff of fp16 is 2^-11: the extra rounding stays within a couple of them, as
    # rounding the output (which both paths do) already costs up to one
    assert errs["per_column"] < 2**-11 and errs["k_scales"] < 3 * 2**-11, errs


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
def test_fp8_layer_kernel_path_matches_cpu_path(block, monkeypatch):
    """An Fp8MoEMethod layer quantizing model-dtype experts at load: kernels vs dequantized CPU path."""
    if DEVICE.type == "cpu":  # the interpreter's e4m3 rounding (test_fp8_experts_match_reference)
        monkeypatch.setattr(moe_fused, "per_token_group_quant", per_token_group_quant_reference)
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
    assert int(layer.expert_counts.sum()) == 8
    # the kernels quantize the activations too (W8A8, kernels/moe_fused.py's rule): exactly their reference...
    s13, s2 = layer.quant_method.scales(layer)
    modes = moe_fused.quantized_steps(6, 2, layer.w13_weight, layer.w2_weight, s13, s2, block)
    assert modes == (True, True)
    w, ids = layer.route(logits)
    valid = torch.arange(6, device=DEVICE) < 4
    exact = experts_fp8_reference(x, layer.w13_weight, layer.w2_weight, s13, s2, block, w, ids, valid, w8a8=modes)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
    # ...and the CPU path, on unquantized activations, within their e4m3 rounding (2^-4 relative at most per
    # element, far less over a dot product of 64 or 24)
    assert (got - want).norm() <= 2**-4 * want.norm()


@pytest.mark.parametrize("block", [(16, 32), None])
def test_fp8_layer_norms_and_quantizes_hidden_in_one_launch(block, monkeypatch):
    """Past the router's add-norm rows, W8A8 experts take hidden quantized by the norm's launch
    (kernels/fp8_quant.norm_group_quant_keep) and launch no quantization of their own before gate_up: the
    same output, bit for bit, as the same normed hidden quantized by that launch, and the normed rows and the
    residual sum rms_norm's."""
    from graphserve.kernels import fp8_quant
    from graphserve.layers.linear import Linear
    from graphserve.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(23)
    h, inter, t = 64, 24, 6
    layer = FusedMoE(E, 2, h, inter, SoftmaxTopK(E, 2, False), dtype=torch.float32).to(DEVICE)
    Fp8MoEMethod(Fp8Config(block=block, serialized=False)).create_weights(layer)
    w13, w2 = _randn(E, 2 * inter, h, gen=gen, scale=0.3), _randn(E, h, inter, gen=gen, scale=0.3)
    for e in range(E):
        layer.load_weight("w13_weight", layer.w13_weight, w13[e, :inter], (e, "w1"))
        layer.load_weight("w13_weight", layer.w13_weight, w13[e, inter:], (e, "w3"))
        layer.load_weight("w2_weight", layer.w2_weight, w2[e], (e, "w2"))
    layer.use_kernels = True
    norm, gate = RMSNorm(h, 1e-6).to(DEVICE), Linear(h, E, bias=True).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(_randn(h, gen=gen))
        gate.weight.copy_(_randn(E, h, gen=gen, scale=0.2))
        gate.bias.copy_(_randn(E, gen=gen, scale=0.2))
    x, residual = _randn(t, h, gen=gen), _randn(t, h, gen=gen)
    assert layer._hidden_quant_group(x) == (block[1] if block else h)
    quant_launches = []
    real_quant = moe_fused.per_token_group_quant
    monkeypatch.setattr(moe_fused, "per_token_group_quant", lambda *a, **kw: quant_launches.append(1) or real_quant(*a, **kw))
    # the answer is kept per row count: the layer asks every step, the experts' plan never changes after loading
    monkeypatch.setattr(moe_fused, "hidden_quant_group", lambda *a, **kw: pytest.fail("asked the plan again"))
    out, hidden, summed = layer.forward_add_norm_gate(x, residual, norm, gate)
    assert len(quant_launches) == 1  # down's input only: gate_up's came from the norm's launch
    want_hidden, want_summed = norm(x, residual)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(summed, want_summed, rtol=0, atol=0)
    quant_launches.clear()
    want = layer.forward_gate(hidden, gate)  # the experts quantizing the same hidden themselves
    assert len(quant_launches) == 2
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # a launch of other quantization cannot stand in for the experts' own
    q, scales, _ = fp8_quant.norm_group_quant(x, norm.weight, 1e-6, 16 if block else h // 2, residual)
    with pytest.raises(ValueError, match="pre-quantized activations"):
        layer.forward_gate(hidden, gate, hidden_q=(q, scales))


# (scale block, intermediate, gate_up tile): gate_up's tile one of down's 32-wide activation groups; intermediate 24
# is one partial group (columns 24-31 re-read weights the epilogue must not count), 48 a whole and a partial one
QUANT_OUT_CASES = [((16, 32), 24, GemmTile(16, 32, 32, 1, 4, 2)), ((16, 32), 48, GemmTile(16, 32, 32, 2, 4, 2))]


@pytest.mark.parametrize("block,inter,gate_up", QUANT_OUT_CASES)
def test_w8a8_gate_up_quantizes_down_input_in_its_epilogue(block, inter, gate_up, monkeypatch):
    """W8A8 with gate_up's tile one activation group wide: gate_up writes down's fp8 input and scales
    (``QUANT_OUT``) and no quantization launch runs before down; the output equals, bit for bit, the same tiles
    with that launch (the one rounding, kernels/fp8_quant.quantize_rows, in both), padding rows poisoned."""
    spy = _LaunchSpy(moe_fused.fused_moe_gemm_kernel)
    monkeypatch.setattr(moe_fused, "fused_moe_gemm_kernel", spy)
    quant_launches = []
    real_quant = moe_fused.per_token_group_quant
    monkeypatch.setattr(moe_fused, "per_token_group_quant", lambda a, g: quant_launches.append(g) or real_quant(a, g))
    gen = torch.Generator().manual_seed(inter + gate_up.group_m)
    h, t, k = 64, 9, 3
    w13, w2, s13, s2 = _fp8_experts(gen, E, h, inter, block)
    x = _randn(t, h, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(t, E, gen=gen), k, True)
    valid = torch.arange(t, device=DEVICE) < t - 1
    x[-1:] = float("nan")
    topk_w[-1:] = float("nan")
    down = GemmTile(gate_up.block_m, 16, 32, 1, 4, 2)
    args = dict(valid=valid, w13_scale=s13, w2_scale=s2, weight_block=block, path="gemm", w8a8=True,
                gemm_tiles=(gate_up, down))  # fmt: skip
    fused = fused_experts(x, w13, w2, topk_w, topk_ids, **args)
    assert [c["QUANT_OUT"] for c in spy.launches] == [True, False] and quant_launches == [block[1]]
    assert spy.launches[1]["A_FP8"]  # down reads the epilogue's fp8 rows and scales
    spy.launches.clear()
    quant_launches.clear()
    monkeypatch.setattr(moe_fused, "quant_out_group", lambda *a: False)
    apart = fused_experts(x, w13, w2, topk_w, topk_ids, **args)
    assert [c["QUANT_OUT"] for c in spy.launches] == [False, False] and quant_launches == [block[1]] * 2
    assert torch.isfinite(fused[:-1]).all() and torch.equal(fused[-1:].cpu(), torch.zeros(1, h))
    torch.testing.assert_close(fused, apart, rtol=0, atol=0)
    want = experts_fp8_reference(x, w13, w2, s13, s2, block, topk_w, topk_ids, valid, w8a8=True)
    # the interpreter rounds to e4m3 its own way (test_fp8_experts_match_reference): the bound is the size of the
    # activations' quantization error (3 mantissa bits), which a wrong group or scale exceeds many times
    assert want[:-1].abs().max() > 0.1 and relative_error(fused[:-1], want[:-1]) < 0.1


def test_quant_out_group_rule():
    """The epilogue quantizes only where down runs W8A8 by a launch and gate_up's tile is one group wide."""
    from graphserve.kernels.moe_fused import quant_out_group
    from graphserve.kernels.moe_scales import ExpertScales

    blocks, channel = ExpertScales(torch.ones(2, 4, 4), 128, 128), ExpertScales(torch.ones(2, 512, 1), 1, 768)
    gu, dn = GemmTile(16, 128, 128, 1, 4, 3), GemmTile(16, 64, 128, 1, 4, 3)
    assert quant_out_group(gu, dn, blocks, True)
    assert not quant_out_group(gu, dn, blocks, False)  # W8A16: down reads the activation dtype
    assert not quant_out_group(GemmTile(16, 64, 128, 1, 4, 3), dn, blocks, True)  # half a group a tile
    assert not quant_out_group(gu, GemmTile(16, 64, 128, 1, 4, 3, a8=True), blocks, True)  # down quantizes itself
    assert not quant_out_group(gu, dn, channel, True)  # per channel: the group is the whole row
    assert not quant_out_group(gu, dn, None, True)


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
    monkeypatch.setattr(moe_tune, "GEMV_TILES", [GemvTile(8, 32, 4), GemvTile(32, 64, 4)])
    one = [GemmTile(16, 16, 32, 1, 4, 3)]
    monkeypatch.setattr(moe_tune, "gemm_candidates", lambda per_expert, gated, quick, **space: one)
    monkeypatch.setattr(moe_tune._Bucket, "ms", before_never_kept(moe_tune._Bucket.ms))
    tiles, rows = moe_tune.tune(E, h, inter, 2, torch.float8_e4m3fn, quick=True, budget_s=600)
    assert tiles.buckets == (2, 8) and [r["tokens"] for r in rows] == [1, 4]
    assert tiles.gemv_gate_up == GemvTile(8, 32, 4)  # 32 rows over 16-row blocks: a 64-wide step is not taken
    again = MoeTiles.from_json(json.loads(json.dumps(tiles.to_json())))
    gen = torch.Generator().manual_seed(8)
    w13, w2, s13, s2 = _fp8_experts(gen, E, h, inter, (16, 32))
    x = _randn(5, h, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(5, E, gen=gen), 2, True)
    if DEVICE.type == "cpu":  # the interpreter's e4m3 rounding (test_fp8_experts_match_reference)
        monkeypatch.setattr(moe_fused, "per_token_group_quant", per_token_group_quant_reference)
    out = fused_experts(x, w13, w2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2, weight_block=(16, 32), tiles=again)
    monkeypatch.setattr(moe_fused, "moe_tiles", lambda *args: again)
    modes = moe_fused.quantized_steps(5, 2, w13, w2, s13, s2, (16, 32))  # the mode the table's path runs
    want = experts_fp8_reference(x, w13, w2, s13, s2, (16, 32), topk_w, topk_ids, w8a8=modes)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_tuner_fp8_tile_space_spans_scale_blocks_only_where_the_kernel_does():
    from benchmarks.moe_tune import SMEM_LIMIT, gemm_candidates

    w8a16 = gemm_candidates(4, True, False, fp8_block=(128, 128))
    assert {c.block_k for c in w8a16} == {64, 128, 256, 512}
    assert all(c.block_k <= 128 or 128 % c.block_n == 0 for c in w8a16)
    assert GemmTile(16, 32, 512, 1, 4, 4) in w8a16  # 4 stages of a 16x512 bf16 and two 512x32 fp8 tiles
    assert all(c.num_stages * (2 * c.block_m * c.block_k + 2 * c.block_k * c.block_n) <= SMEM_LIMIT for c in w8a16)
    assert max(c.block_k for c in gemm_candidates(4, True, False, fp8_block=(128, 128), w8a8=True)) == 128
    assert max(c.block_k for c in gemm_candidates(4, True, False)) == 256  # bf16 weights: as before


def test_tuner_fp8_streaming_steps_span_scale_blocks_only_where_the_kernels_do():
    """Over 16x32 blocks every candidate step (128-512) is past the block's K, so only tiles of 2, 4, 8 or 16 rows
    (dividing the 16-row block) are timed: a 32-row tile's step would be capped at 32, repeating a tile timed."""
    from benchmarks.moe_tune import GEMV_TILES, gemv_candidates

    gate_up, down = gemv_candidates(2, (16, 32))
    assert {g.block_n for g in gate_up} == {g.block_n for g in down} == {2, 4, 8, 16}
    assert GemvTile(8, 512, 4) in gate_up and GemvTile(32, 512, 8) not in gate_up
    assert {g.block_k for g in gate_up} == {128, 256, 512}
    bf16 = gemv_candidates(2)
    assert {g.block_n for g in bf16[0]} == {2, 4, 8, 16, 32}  # bf16 weights: no scale blocks to keep to
    assert len(bf16[0]) < len(GEMV_TILES)  # the register budget still prunes (2 x 32 x 512 on 4 warps)


def test_tuner_retunes_some_buckets_and_keeps_the_others(monkeypatch):
    """``moe_tune --buckets``: only the given buckets are timed; the merged table keeps the rest, and
    the streaming path's entries unless the sweep began at one token."""
    import json
    import time

    from benchmarks import moe_tune
    from graphserve.kernels.moe_config import MoeTiles

    def wall_ms(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    h, inter, k = 64, 32, 2
    tile = GemmTile(16, 16, 64, 1, 4, 3)
    monkeypatch.setattr(moe_tune, "DEVICE", DEVICE)
    monkeypatch.setattr(moe_tune, "FP8_BLOCK", (16, 32))
    monkeypatch.setattr(moe_tune, "graph_ms", wall_ms)
    monkeypatch.setattr(moe_tune, "GEMV_TILES", [GemvTile(8, 32, 4)])
    monkeypatch.setattr(moe_tune, "gemm_candidates", lambda per_expert, gated, quick, **space: [tile])
    old_tile = GemmTile(16, 32, 32, 1, 4, 3)
    old = MoeTiles(2, GemvTile(4, 32, 4), GemvTile(4, 32, 4), (2, 8, 32), (old_tile,) * 3, (old_tile,) * 3)
    old_json = {**old.to_json(), "measurements": [{"pairs": b, "gemm_us": 1.0} for b in (2, 8, 32)]}
    old_json = json.loads(json.dumps(old_json))

    monkeypatch.setattr(moe_tune._Bucket, "ms", before_never_kept(moe_tune._Bucket.ms))
    tiles, rows = moe_tune.tune(E, h, inter, k, torch.float8_e4m3fn, quick=False, budget_s=600, tokens=[4])
    assert tiles.buckets == (8,) and [r["pairs"] for r in rows] == [8] and rows[0]["gemv_us"] != rows[0]["gemv_us"]
    merged, merged_rows = moe_tune.merge_tables(old_json, tiles, rows, streaming=False)
    assert merged.buckets == (2, 8, 32) and merged.gate_up == (old_tile, tile, old_tile)
    assert (merged.small_max_pairs, merged.gemv_gate_up) == (2, GemvTile(4, 32, 4))
    assert [r["pairs"] for r in merged_rows] == [2, 8, 32] and merged_rows[1] is rows[0]
    # kept rows name the run that timed them: the earlier table's where it timed that bucket, else their own
    earlier = {"commit": "aaa"}
    partial = {**old_json, "environment": earlier, "retuned_buckets": [32],
               "measurements": [{"pairs": 2, "gemm_us": 1.0}, {"pairs": 32, "gemm_us": 1.0},
                                {"pairs": 8, "gemm_us": 1.0}]}
    _, kept_rows = moe_tune.merge_tables(partial, tiles, rows, streaming=False)
    assert "measured_at" not in kept_rows[0] and kept_rows[2]["measured_at"] == earlier
    full = {**old_json, "environment": earlier, "measurements": [{"pairs": 2, "gemm_us": 1.0, "measured_at": {"commit": "b"}},
                                                                  {"pairs": 32, "gemm_us": 1.0}]}
    _, kept_rows = moe_tune.merge_tables(full, tiles, rows, streaming=False)
    assert kept_rows[0]["measured_at"] == {"commit": "b"} and kept_rows[2]["measured_at"] == earlier

    tiles, rows = moe_tune.tune(E, h, inter, k, torch.float8_e4m3fn, quick=False, budget_s=600, tokens=[1])
    merged, _ = moe_tune.merge_tables(old_json, tiles, rows, streaming=True)
    assert merged.buckets == (2, 8, 32) and merged.gate_up[0] == tile
    assert merged.gemv_gate_up == GemvTile(8, 32, 4) and merged.small_max_pairs in (0, 2)
    assert MoeTiles.from_json(json.loads(json.dumps(merged.to_json()))) == merged
