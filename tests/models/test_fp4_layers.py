"""FP4 layers on CPU: under --tp every rank holds the tp 1 layer's codes and scales (a scale group two ranks would
share is refused naming the columns) and the partial sums add up to it; the FP4 experts reference against the
unquantized experts and against gpt-oss's activation computed by hand; gpt-oss's MXFP4 stacks load de-interleaved
under tp and ep; a CUDA card that cannot run FP4 is refused naming it."""

from __future__ import annotations

import sys

import pytest
import torch

from graphserve.errors import ModelLoadError
from graphserve.kernels.fp4_experts_reference import fp4_fused_experts_reference
from graphserve.kernels.fp4_reference import (
    fp4_dequantize,
    fp4_linear_reference,
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_quantize,
)
from graphserve.kernels.moe_reference import experts_reference, softmax_topk_reference
from graphserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from graphserve.layers.moe import FusedMoE, SoftmaxTopK
from graphserve.layers.quant import fp4_config
from graphserve.layers.quant.fp4 import Fp4LinearMethod, quantize_fp4
from graphserve.layers.quant.fp4_config import Fp4Config, check_fp4_device
from graphserve.layers.quant.fp4_moe import Fp4MoEMethod

SCHEMES = {"nvfp4 checkpoint": ("nvfp4", True), "nvfp4 load": ("nvfp4", False), "mxfp4 load": ("mxfp4", False)}


def _fp4(layer, fmt, serialized):  # noqa: ANN001, ANN202
    method = Fp4LinearMethod(Fp4Config(fmt, serialized=serialized))
    method.create_weights(layer)
    return method


def _load(layer, w, b, fmt, serialized, shard=None) -> None:  # noqa: ANN001
    """``w`` (fp32) into ``layer`` as a checkpoint holds it (packed, scales, global) or quantized at load."""
    if serialized:
        packed, scale, g = quantize_fp4(w, fmt)
        layer.load_weight("weight", layer.weight, packed, shard)
        layer.load_weight("weight_scale", layer.weight_scale, scale, shard)
        layer.load_weight("weight_scale_2", layer.weight_scale_2, g, shard)
        layer.load_weight("input_scale", layer.input_scale, torch.tensor(0.01), shard)
    else:
        layer.load_weight("weight", layer.weight, w, shard)
    if b is not None:
        layer.load_weight("bias", layer.bias, b, shard)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_fp4_parallel_parts_are_the_tp1_layers_and_add_up_to_it(scheme):
    fmt, serialized = SCHEMES[scheme]
    gen = torch.Generator().manual_seed(0)
    w1, b1 = torch.randn(64, 64, generator=gen), torch.randn(64, generator=gen)
    w2, b2 = torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    layers = {}
    for tp in (1, 2):
        for rank in range(tp):
            col, row = ColumnParallelLinear(64, 64, True, rank, tp), RowParallelLinear(64, 32, True, rank, tp)
            _fp4(col, fmt, serialized), _fp4(row, fmt, serialized)
            _load(col, w1, b1, fmt, serialized)
            _load(row, w2, b2, fmt, serialized)
            layers[tp, rank] = col, row
    whole_col, whole_row = layers[1, 0]
    deq_col = whole_col.quant_method.dequantized_weight(whole_col, torch.float32)
    deq_row = whole_row.quant_method.dequantized_weight(whole_row, torch.float32)
    # the layer computes fp4_linear_reference
    want = fp4_linear_reference(x, *quantize_fp4(w1, fmt)[:2], quantize_fp4(w1, fmt)[2], fmt, b1)
    torch.testing.assert_close(whole_col(x), want, rtol=1e-6, atol=1e-6)
    total = torch.zeros(3, 32)
    for rank in range(2):
        col, row = layers[2, rank]
        assert col.weight.dtype == torch.uint8 and col.weight.shape == (32, 32) and row.weight.shape == (32, 16)
        assert torch.equal(col.quant_method.dequantized_weight(col, torch.float32), deq_col[rank * 32:(rank + 1) * 32])
        assert torch.equal(row.quant_method.dequantized_weight(row, torch.float32), deq_row[:, rank * 32:(rank + 1) * 32])
        total += row(col(x))  # the all-reduce
    torch.testing.assert_close(total, whole_row(whole_col(x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("serialized", [True, False], ids=["checkpoint", "load"])
@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 2), (4, 1, 2)])
def test_nvfp4_qkv_parts_keep_their_own_global_scales_on_every_rank(serialized, heads, kv_heads, tp):
    d, hidden = 16, 32
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(n * d, hidden, generator=gen) * (1 + i) for i, n in enumerate((heads, kv_heads, kv_heads))]
    whole = QKVParallelLinear(hidden, d, heads, kv_heads, False, 0, 1)
    _fp4(whole, "nvfp4", serialized)
    for shard, t in enumerate(parts):
        _load(whole, t, None, "nvfp4", serialized, shard)
    assert torch.equal(whole.weight_scale_2, torch.stack([nvfp4_quantize(t)[2] for t in parts]))
    q_all, k_all, v_all = whole.quant_method.dequantized_weight(whole, torch.float32).split(whole.output_sizes)
    for shard, got in enumerate((q_all, k_all, v_all)):
        assert torch.equal(got, fp4_dequantize(*nvfp4_quantize(parts[shard]), "nvfp4"))
    x = torch.randn(2, hidden, generator=gen)
    torch.testing.assert_close(whole(x), x @ torch.cat([q_all, k_all, v_all]).T, rtol=1e-5, atol=1e-5)
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, False, rank, tp)
        _fp4(layer, "nvfp4", serialized)
        for shard, t in enumerate(parts):
            _load(layer, t, None, "nvfp4", serialized, shard)
        q, k, v = layer.quant_method.dequantized_weight(layer, torch.float32).split(layer.output_sizes)
        per_rank = heads // tp
        kv_head = rank * per_rank // (heads // kv_heads)
        assert torch.equal(q, q_all[rank * per_rank * d:(rank + 1) * per_rank * d])
        assert torch.equal(k, k_all[kv_head * d:(kv_head + 1) * d])
        assert torch.equal(v, v_all[kv_head * d:(kv_head + 1) * d])


@pytest.mark.parametrize("serialized", [True, False], ids=["checkpoint", "load"])
def test_a_rank_part_that_splits_a_scale_group_is_refused_naming_the_columns(serialized):
    row = RowParallelLinear(48, 32, False, 1, 2)  # rank 1's columns [24, 48): inside the second group of 16
    with pytest.raises(ValueError, match=r"this rank's columns \[24, 48\) cut the FP4 scale groups of 16: each "
                                         r"rank's part of K must be whole groups \(a multiple of 16\)"):
        _fp4(row, "nvfp4", serialized)
    # and the experts: 48 intermediate columns of down over 2 ranks
    layer = FusedMoE(2, 1, 64, 48, SoftmaxTopK(2, 1, True), tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match=r"this rank's columns \[24, 48\) cut the FP4 scale groups of 16"):
        Fp4MoEMethod(Fp4Config("nvfp4", serialized=serialized)).create_weights(layer)
    # a checkpoint tensor cut by hand on a rank the layer holds whole groups of: a cut elsewhere is refused too
    from graphserve.layers.linear import RankSlice
    from graphserve.layers.quant.fp4 import take_groups

    with pytest.raises(ValueError, match=r"columns \[8, 40\) cut the FP4 scale groups of 16"):
        take_groups(RankSlice(1, 8, 32), torch.zeros(4, 24, dtype=torch.uint8), 2, 16)


def _experts(fmt, serialized, tp=1, rank=0, ep=1, ep_rank=0, e=4, h=64, i=64, activation="silu"):
    layer = FusedMoE(e, 2, h, i, SoftmaxTopK(e, 2, True), tp_rank=rank, tp_size=tp, ep_rank=ep_rank, ep_size=ep)
    layer.activation = activation
    Fp4MoEMethod(Fp4Config(fmt, serialized=serialized)).create_weights(layer)
    return layer


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_fp4_expert_parts_are_the_tp1_experts_and_run_the_unquantized_reference(scheme):
    fmt, serialized = SCHEMES[scheme]
    gen = torch.Generator().manual_seed(2)
    ws = {(e, p): torch.randn(64, 64, generator=gen) * 0.1 for e in range(4) for p in ("w1", "w3", "w2")}
    layers = {}
    for tp, rank in ((1, 0), (2, 0), (2, 1)):
        layer = _experts(fmt, serialized, tp, rank)
        for (e, part), w in ws.items():
            stack = "w2_" if part == "w2" else "w13_"
            if serialized:
                packed, scale, g = quantize_fp4(w, fmt)
                for leaf, t in (("weight", packed), ("weight_scale", scale), ("weight_scale_2", g),
                                ("input_scale", torch.tensor(0.01))):
                    assert layer.load_weight(stack + leaf, None, t, (e, part))
            else:
                assert layer.load_weight(stack + "weight", None, w, (e, part))
        layers[tp, rank] = layer
    whole = layers[1, 0]
    d13, d2 = whole.quant_method.dequantized(whole, torch.float32)
    for e in range(4):
        assert torch.equal(d13[e, :64], fp4_dequantize(*quantize_fp4(ws[e, "w1"], fmt), fmt))
        assert torch.equal(d2[e], fp4_dequantize(*quantize_fp4(ws[e, "w2"], fmt), fmt))
    x = torch.randn(5, 64, generator=gen)
    weights, ids = softmax_topk_reference(torch.randn(5, 4, generator=gen), 2, True)
    want = experts_reference(x, d13, d2, weights, ids)
    assert whole(x, torch.randn(5, 4, generator=torch.Generator().manual_seed(3))).shape == x.shape
    got = whole._experts(x, weights, ids, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert int(whole.expert_counts.sum()) == 10
    total = torch.zeros_like(x)
    for rank in range(2):
        part = layers[2, rank]
        p13, p2 = part.quant_method.dequantized(part, torch.float32)
        assert torch.equal(p13, torch.cat([d13[:, rank * 32:(rank + 1) * 32], d13[:, 64 + rank * 32:96 + rank * 32]], 1))
        assert torch.equal(p2, d2[:, :, rank * 32:(rank + 1) * 32])
        total += part._experts(x, weights, ids, None)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def _swiglu_oai_by_hand(x, w13, b13, w2, b2, weights, ids, alpha=1.702, limit=7.0):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gu = w13[e] @ x[t] + b13[e]
            gate, up = gu[: w13.shape[1] // 2], gu[w13.shape[1] // 2:]
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[t] += weights[t, slot] * (w2[e] @ act + b2[e])
    return out


def _gpt_oss_tensors(e, h, i, gen):
    """gpt-oss's expert tensors (interleaved gate/up rows, blocks [E, N, K/32, 16]) and the [gate; up] weights."""
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.2
    w2 = torch.randn(e, h, i, generator=gen) * 0.2
    interleaved = torch.stack([w13[:, :i], w13[:, i:]], dim=2).reshape(e, 2 * i, h)  # row 2j gate j, 2j+1 up j
    b13, b2 = torch.randn(e, 2 * i, generator=gen), torch.randn(e, h, generator=gen)
    b13_interleaved = torch.stack([b13[:, :i], b13[:, i:]], dim=2).reshape(e, 2 * i)
    p13, s13 = mxfp4_quantize(interleaved)
    p2, s2 = mxfp4_quantize(w2)
    tensors = {"gate_up_proj_blocks": p13.reshape(e, 2 * i, h // 32, 16), "gate_up_proj_scales": s13,
               "gate_up_proj_bias": b13_interleaved.to(torch.bfloat16), "down_proj_blocks": p2.reshape(e, h, i // 32, 16),
               "down_proj_scales": s2, "down_proj_bias": b2.to(torch.bfloat16)}
    return tensors, mxfp4_dequantize(*mxfp4_quantize(w13)), mxfp4_dequantize(p2, s2)


def _gpt_oss_layer(tensors, tp=1, rank=0, ep=1, ep_rank=0, e=4, h=64, i=64):
    layer = _experts("mxfp4", True, tp, rank, ep, ep_rank, e, h, i, activation="swiglu_oai")
    il, le = i // tp, e // ep
    layer.w13_bias = torch.nn.Parameter(torch.empty(le, 2 * il, dtype=torch.bfloat16), requires_grad=False)
    layer.w2_bias = torch.nn.Parameter(torch.empty(le, h, dtype=torch.bfloat16), requires_grad=False)
    filled = set()
    for name, t in tensors.items():
        filled.update(layer.quant_method.load_gpt_oss(layer, name, t))
    # every parameter's keys the loader expects (models/base.py expected_weights), scales included
    assert filled == {f"{p}#{s}" for p, _ in layer.named_parameters() for s in layer.weight_shards(p)}
    return layer


def test_gpt_oss_mxfp4_experts_load_de_interleaved_and_run_swiglu_oai():
    gen = torch.Generator().manual_seed(4)
    tensors, d13, d2 = _gpt_oss_tensors(4, 64, 64, gen)
    layer = _gpt_oss_layer(tensors)
    g13, g2 = layer.quant_method.dequantized(layer, torch.float32)
    assert torch.equal(g13, d13) and torch.equal(g2, d2)
    b13 = torch.cat([tensors["gate_up_proj_bias"][:, 0::2], tensors["gate_up_proj_bias"][:, 1::2]], 1).float()
    assert torch.equal(layer.w13_bias.float(), b13)
    x = torch.randn(6, 64, generator=gen)
    weights, ids = softmax_topk_reference(torch.randn(6, 4, generator=gen), 2, True)
    want = _swiglu_oai_by_hand(x, d13, b13, d2, tensors["down_proj_bias"].float(), weights, ids)
    got = layer._experts(x, weights, ids, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the limit clamps: large inputs give a different answer from silu
    assert relative_error_of(got, layer, x, weights, ids) > 0.05
    # tp 2: the rank's gate rows and up rows, down's columns, the down bias once; ep 2: whole experts
    total = torch.zeros_like(x)
    for rank in range(2):
        part = _gpt_oss_layer(tensors, tp=2, rank=rank)
        p13, p2 = part.quant_method.dequantized(part, torch.float32)
        assert torch.equal(p13, torch.cat([d13[:, rank * 32:(rank + 1) * 32], d13[:, 64 + rank * 32:96 + rank * 32]], 1))
        assert torch.equal(p2, d2[:, :, rank * 32:(rank + 1) * 32])
        total += part._experts(x, weights, ids, None)
    torch.testing.assert_close(total, want, rtol=1e-4, atol=1e-4)
    total = torch.zeros_like(x)
    for ep_rank in range(2):
        part = _gpt_oss_layer(tensors, ep=2, ep_rank=ep_rank)
        assert torch.equal(part.quant_method.dequantized(part, torch.float32)[0], d13[2 * ep_rank:2 * ep_rank + 2])
        total += part._experts(x, weights, ids, None)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def relative_error_of(got, layer, x, weights, ids) -> float:
    layer.activation = "silu"
    try:
        other = layer._experts(x, weights, ids, None)
    finally:
        layer.activation = "swiglu_oai"
    return float((got - other).norm() / got.norm())


def test_gpt_oss_tensors_of_the_wrong_shape_or_dtype_are_refused_naming_them():
    gen = torch.Generator().manual_seed(5)
    tensors, _, _ = _gpt_oss_tensors(4, 64, 64, gen)
    layer = _gpt_oss_layer(tensors)
    with pytest.raises(ValueError, match=r"gate_up_proj_blocks has shape \(4, 128, 2, 8\), expected \(4, 128, 2, 16\)"):
        layer.quant_method.load_gpt_oss(layer, "gate_up_proj_blocks", tensors["gate_up_proj_blocks"][..., :8])
    with pytest.raises(ValueError, match=r"dtype torch.float32, expected torch.uint8 \(mxfp4 group scales\)"):
        layer.quant_method.load_gpt_oss(layer, "down_proj_scales", tensors["down_proj_scales"].float())
    bad = tensors["down_proj_scales"].clone()
    bad[1, 2, 0] = 255
    with pytest.raises(ValueError, match=r"1 of 512 group scales are NaN \(the first at \(1, 2, 0\)\)"):
        layer.quant_method.load_gpt_oss(layer, "down_proj_scales", bad)


def test_the_fp4_experts_reference_with_silu_is_the_unquantized_reference_on_dequantized_weights():
    gen = torch.Generator().manual_seed(6)
    w13, w2 = torch.randn(3, 64, 32, generator=gen), torch.randn(3, 32, 32, generator=gen)
    (p13, s13, _), (p2, s2, _) = quantize_fp4(w13[:, :32], "nvfp4"), quantize_fp4(w2, "nvfp4")
    up = nvfp4_quantize(w13[:, 32:])
    p13, s13 = torch.cat([p13, up[0]], 1), torch.cat([s13, up[1]], 1)
    g13 = torch.stack([nvfp4_quantize(w13[:, :32])[2], up[2]], 1)
    g2 = nvfp4_quantize(w2)[2][:, None]
    x = torch.randn(4, 32, generator=gen).to(torch.bfloat16)
    weights, ids = softmax_topk_reference(torch.randn(4, 3, generator=gen), 2, True)
    valid = torch.tensor([True, True, False, True])
    got = fp4_fused_experts_reference(x, p13, s13, g13, p2, s2, g2, "nvfp4", weights, ids, valid=valid)
    want = experts_reference(x, fp4_dequantize(p13, s13, g13, "nvfp4"), fp4_dequantize(p2, s2, g2, "nvfp4"),
                             weights, ids, valid)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    assert torch.equal(got[2], torch.zeros(32, dtype=torch.bfloat16))


def test_a_cuda_card_that_cannot_run_fp4_is_refused_naming_it(monkeypatch):
    quant = Fp4Config("nvfp4")
    monkeypatch.setattr(fp4_config, "cuda_card", lambda device: ("Tesla T4", (7, 5)))
    with pytest.raises(ModelLoadError, match=r"nvfp4 .* weights need a CUDA card of compute capability >= 8.0; "
                                             r"Tesla T4 has 7.5"):
        check_fp4_device(quant, torch.device("cuda"))
    monkeypatch.setattr(fp4_config, "cuda_card", lambda device: ("NVIDIA H100 80GB HBM3", (9, 0)))
    for module in ("fp4_gemv", "fp4_gemm", "fp4_moe"):  # a build without the FP4 kernels
        monkeypatch.setitem(sys.modules, f"graphserve.kernels.{module}", None)
    with pytest.raises(ModelLoadError, match=r"weights on NVIDIA H100 80GB HBM3: this build has no FP4 kernels"):
        check_fp4_device(quant, torch.device("cuda"))
    check_fp4_device(quant, torch.device("cpu"))  # CPU runs the references
