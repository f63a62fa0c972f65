"""FP8 under tensor and expert parallelism on CPU (gloo, fp32). Each rank holds its part of every FP8 projection
and expert: an FP8 checkpoint's weights cut with their scales (whole scale blocks only), a bf16 checkpoint's
quantized whole as at --tp 1 and then cut (a part that would cut a block quantized on its own), so every tp runs
the same fp8 values and scales where the parts are whole blocks, and --tp 2 / --ep 2 engines produce the greedy
tokens of --tp 1."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_hf_checkpoint
from tp_utils import generate_on_ranks
from transformers import Qwen3Config, Qwen3MoeConfig

from graphserve import SamplingParams
from graphserve.kernels.fp8_quant import FP8_DTYPE, quantize_weight_blocks, quantize_weight_channels
from graphserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from graphserve.layers.moe import FusedMoE, SoftmaxTopK
from graphserve.layers.quant.config import Fp8Config
from graphserve.layers.quant.fp8 import Fp8LinearMethod
from graphserve.layers.quant.fp8_moe import Fp8MoEMethod
from graphserve.models.fp8_checkpoint import quantize_checkpoint

BLOCK = (16, 16)  # every tp-2 part below is whole 16x16 blocks
PROMPTS = ["Hello world", "The quick brown fox jumps over", "a", "fp8 ranks agree on every token"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SCHEMES = {  # (block, serialized): checkpoints as they ship, and --quantization at load
    "checkpoint block": (BLOCK, True), "checkpoint channel": (None, True),
    "load block": (BLOCK, False), "load channel": (None, False),
}


# ---- layers: every rank's part is the --tp 1 layer's, and the parts add up to it ----------------------------

def _fp8(layer, block, serialized):  # noqa: ANN001, ANN202
    method = Fp8LinearMethod(Fp8Config(block=block, serialized=serialized))
    method.create_weights(layer)
    return method


def _load(layer, method, w, b, serialized, shard=None) -> None:  # noqa: ANN001
    """``w`` (fp32) into ``layer`` as a checkpoint would hold it: fp8 + scale, or fp32 quantized at load."""
    if serialized:
        q, s = quantize_weight_blocks(w, *method.config.block) if method.config.block else quantize_weight_channels(w)
        layer.load_weight("weight", layer.weight, q, shard)
        layer.load_weight(method.scale_name, method.scale(layer), s, shard)
    else:
        layer.load_weight("weight", layer.weight, w, shard)
    if b is not None:
        layer.load_weight("bias", layer.bias, b, shard)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_fp8_parallel_parts_are_the_tp1_layers_and_add_up_to_it(scheme):
    block, serialized = SCHEMES[scheme]
    gen = torch.Generator().manual_seed(0)
    w1, b1 = torch.randn(64, 32, generator=gen), torch.randn(64, generator=gen)
    w2, b2 = torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    x = torch.randn(3, 32, generator=gen)
    layers = {}
    for tp in (1, 2):
        for rank in range(tp):
            col, row = ColumnParallelLinear(32, 64, True, rank, tp), RowParallelLinear(64, 32, True, rank, tp)
            _load(col, _fp8(col, block, serialized), w1, b1, serialized)
            _load(row, _fp8(row, block, serialized), w2, b2, serialized)
            layers[tp, rank] = col, row
    whole_col, whole_row = layers[1, 0]
    deq = {name: layer.quant_method.dequantized_weight(layer, torch.float32)
           for name, layer in (("col", whole_col), ("row", whole_row))}
    total = torch.zeros(3, 32)
    for rank in range(2):
        col, row = layers[2, rank]
        assert col.weight.dtype == row.weight.dtype == FP8_DTYPE
        assert col.weight.shape == (32, 32) and row.weight.shape == (32, 32)
        # the same fp8 values and scales as the whole layer's rows / columns
        torch.testing.assert_close(col.quant_method.dequantized_weight(col, torch.float32),
                                   deq["col"][rank * 32:(rank + 1) * 32], rtol=0, atol=0)
        torch.testing.assert_close(row.quant_method.dequantized_weight(row, torch.float32),
                                   deq["row"][:, rank * 32:(rank + 1) * 32], rtol=0, atol=0)
        total += row(col(x))  # the all-reduce
    torch.testing.assert_close(total, whole_row(whole_col(x)))  # the row-parallel bias added once


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 2), (4, 1, 2)])
def test_fp8_qkv_parts_hold_their_heads_with_their_scales(scheme, heads, kv_heads, tp):
    """q, k and v each scaled on their own; a rank's kv head (replicated where there are fewer than ranks) comes
    with its own rows' scales."""
    block, serialized = SCHEMES[scheme]
    d, hidden = 16, 32
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(n * d, hidden, generator=gen) for n in (heads, kv_heads, kv_heads)]
    whole = QKVParallelLinear(hidden, d, heads, kv_heads, False, 0, 1)
    method = _fp8(whole, block, serialized)
    for shard, t in enumerate(parts):
        _load(whole, method, t, None, serialized, shard)
    q_all, k_all, v_all = method.dequantized_weight(whole, torch.float32).split(whole.output_sizes)
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, False, rank, tp)
        local = _fp8(layer, block, serialized)
        for shard, t in enumerate(parts):
            _load(layer, local, t, None, serialized, shard)
        q, k, v = local.dequantized_weight(layer, torch.float32).split(layer.output_sizes)
        per_rank = heads // tp
        kv_head = rank * per_rank // (heads // kv_heads)
        torch.testing.assert_close(q, q_all[rank * per_rank * d:(rank + 1) * per_rank * d], rtol=0, atol=0)
        torch.testing.assert_close(k, k_all[kv_head * d:(kv_head + 1) * d], rtol=0, atol=0)
        torch.testing.assert_close(v, v_all[kv_head * d:(kv_head + 1) * d], rtol=0, atol=0)


def test_a_part_that_cuts_a_scale_block_is_refused_from_a_checkpoint_and_quantized_alone_at_load():
    """48 input columns over 2 ranks: rank 1's columns [24, 48) start inside the second 16-wide block. An FP8
    checkpoint's scales cannot be cut there: refused, naming the columns. Quantized at load, the rank's part is
    quantized on its own, its blocks starting at its first column."""
    w = torch.randn(32, 48)
    row = RowParallelLinear(48, 32, False, 1, 2)
    with pytest.raises(ValueError, match=r"columns \[24, 48\) cut the fp8 scale blocks of 16: each rank's part "
                                         r"must be whole blocks \(a multiple of 16\)"):
        _load(row, _fp8(row, BLOCK, True), w, None, True)
    row = RowParallelLinear(48, 32, False, 1, 2)
    method = _fp8(row, BLOCK, False)
    _load(row, method, w, None, False)
    q, s = quantize_weight_blocks(w[:, 24:], *BLOCK)
    torch.testing.assert_close(row.weight.view(torch.uint8), q.view(torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(row.weight_scale_inv, s, rtol=0, atol=0)


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
def test_fp8_expert_parts_are_the_tp1_experts(block):
    """An expert's w1/w3 rows and w2 columns on each rank, with their scales: the whole expert's (experts 32
    wide, 16 a rank: whole blocks). Per channel, w2's scales are every hidden row's on each rank."""
    gen = torch.Generator().manual_seed(2)
    w1, w3, w2 = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen), torch.randn(64, 32, generator=gen)
    layers = {}
    for tp, rank in ((1, 0), (2, 0), (2, 1)):
        layer = FusedMoE(2, 1, 64, 32, SoftmaxTopK(2, 1, True), tp_rank=rank, tp_size=tp)
        Fp8MoEMethod(Fp8Config(block=block, serialized=True)).create_weights(layer)
        for part, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            q, sc = quantize_weight_blocks(w, *block) if block else quantize_weight_channels(w)
            name = "w2_weight" if part == "w2" else "w13_weight"
            layer.load_weight(name, getattr(layer, name), q, (1, part))
            scale = layer.quant_method.scale_name(name)
            layer.load_weight(scale, getattr(layer, scale), sc, (1, part))
        layers[tp, rank] = [t[1].float() for t in layer.quant_method.dequantized(layer, torch.float32)]
    w13, w2_all = layers[1, 0]
    for rank in range(2):
        rows = slice(rank * 16, (rank + 1) * 16)
        got13, got2 = layers[2, rank]
        torch.testing.assert_close(got13, torch.cat((w13[rows], w13[32:][rows])), rtol=0, atol=0)
        torch.testing.assert_close(got2, w2_all[:, rows], rtol=0, atol=0)


def test_an_expert_part_that_cuts_a_scale_block_is_refused_from_a_checkpoint_and_quantized_alone_at_load():
    """Experts 48 wide over 2 ranks: rank 1's rows [24, 48) of w1 start inside the second 16-row block."""
    w1 = torch.randn(48, 64)
    layer = FusedMoE(2, 1, 64, 48, SoftmaxTopK(2, 1, True), tp_rank=1, tp_size=2)
    Fp8MoEMethod(Fp8Config(block=BLOCK, serialized=True)).create_weights(layer)
    q, sc = quantize_weight_blocks(w1, *BLOCK)
    with pytest.raises(ValueError, match=r"rows \[24, 48\) cut the fp8 scale blocks of 16"):
        layer.load_weight("w13_weight", layer.w13_weight, q, (0, "w1"))
    layer = FusedMoE(2, 1, 64, 48, SoftmaxTopK(2, 1, True), tp_rank=1, tp_size=2)
    Fp8MoEMethod(Fp8Config(block=BLOCK, serialized=False)).create_weights(layer)
    layer.load_weight("w13_weight", layer.w13_weight, w1, (0, "w1"))
    q, sc = quantize_weight_blocks(w1[24:], *BLOCK)
    torch.testing.assert_close(layer.w13_weight[0, :24].view(torch.uint8), q.view(torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(layer.w13_weight_scale_inv[0, :2], sc, rtol=0, atol=0)


def test_a_row_parallel_channel_scale_is_every_rows_on_each_rank():
    """Per channel, a row-parallel rank's scales are the whole rows' (the --tp 1 values), not its columns' amax."""
    w = torch.randn(8, 32)
    w[:, 20] = 100.0  # rank 1's columns hold each row's largest value
    whole, part = RowParallelLinear(32, 8, False, 0, 1), RowParallelLinear(32, 8, False, 0, 2)
    for layer in (whole, part):
        _load(layer, _fp8(layer, None, False), w, None, False)
    torch.testing.assert_close(part.weight_scale, whole.weight_scale, rtol=0, atol=0)
    torch.testing.assert_close(part.weight_scale, torch.full((8,), 100.0 / 448.0))


# ---- engines: --tp 2 / --ep 2 greedy tokens == --tp 1 --------------------------------------------------------

_TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=False)


def _dense() -> Qwen3Config:
    # q 4x16, k/v 2x16 (one kv head per rank at tp 2), MLP 128: every rank's part whole 16-row blocks
    return Qwen3Config(**_TINY, intermediate_size=128)


def _moe() -> Qwen3MoeConfig:
    # dense layer 1, experts 32 wide (16 per rank at tp 2), 4 experts (2 per rank at ep 2)
    return Qwen3MoeConfig(**_TINY, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])


def _layer_counts(model) -> tuple[int, int]:  # noqa: ANN001
    moe_shape = getattr(model, "moe_shape", None)
    return len(model.model.layers), len(moe_shape.sparse_layers) if moe_shape is not None else 0


def _generate(folder, **kw) -> list[list[int]]:
    return generate_on_ranks(folder, PROMPTS, GREEDY, _layer_counts, num_kv_tokens=2048, chunked_prefill_size=64,
                             **kw)


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
def test_fp8_checkpoint_tp2_matches_tp1(tmp_path, block):
    make_hf_checkpoint(tmp_path / "bf16", _dense(), seed=4)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp8", block=block)
    assert _generate(tmp_path / "fp8", tp=2) == _generate(tmp_path / "fp8")


def test_fp8_moe_checkpoint_tp2_and_ep2_match_tp1(tmp_path):
    make_hf_checkpoint(tmp_path / "bf16", _moe(), seed=6)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp8", block=BLOCK)
    reference = _generate(tmp_path / "fp8")
    assert _generate(tmp_path / "fp8", tp=2) == reference  # experts cut along their intermediate size
    assert _generate(tmp_path / "fp8", ep=2) == reference  # experts whole, 2 on each rank


def test_quantization_at_load_tp2_matches_tp1(tmp_path):
    """``--quantization fp8``: dense projections per channel, experts in 128x128 blocks (whole tensors of this
    tiny model: one block each way, which --ep keeps whole); the row-parallel projections' scales are the
    whole rows', so tp 2 runs tp 1's weights."""
    make_hf_checkpoint(tmp_path, _moe(), seed=7)
    reference = _generate(tmp_path, quantization="fp8")
    assert _generate(tmp_path, tp=2, quantization="fp8-channel") == _generate(tmp_path, quantization="fp8-channel")
    assert _generate(tmp_path, ep=2, quantization="fp8") == reference
