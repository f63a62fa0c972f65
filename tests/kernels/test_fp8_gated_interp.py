"""The gated FP8 gate_up (kernels/fp8_gemv.fp8_gate_up_a8: gate and up rows in one tile, silu·up in the epilogue,
optionally quantized for the down projection), the routing table's gated MLP pairs, and the benchmark that writes
them, on CPU through Triton's interpreter. Fresh random inputs at tiny shapes.

Tolerances: in fp32 the kernel and the reference multiply the same fp8 values and fp32 scales, so they differ by
summation order only (1e-5 relative); the quantized output is compared with kernels/fp8_quant.silu_mul_group_quant
applied to the reference's gate_up, where only an fp8 rounding flipped by that order can differ (one e4m3 step,
1/8 relative, on the rare element that sits on a rounding boundary)."""

from __future__ import annotations

import dataclasses

import torch
from interp_setup import use_interpreter

use_interpreter()

import pytest  # noqa: E402

from benchmarks.fp8_gated_mlp import table_with  # noqa: E402
from graphserve.kernels import fp8_config  # noqa: E402
from graphserve.kernels.fp8_config import Fp8Rule, GatedMlp, StreamConfig, gated_mlp  # noqa: E402
from graphserve.kernels.fp8_gemv import fp8_gate_up_a8, fp8_gemv_a8  # noqa: E402
from graphserve.kernels.fp8_quant import (  # noqa: E402
    dequantize_blocks,
    per_token_group_quant,
    quantize_weight_blocks,
    quantize_weight_channels,
    silu_mul_group_quant,
)
from graphserve.kernels.fp8_reference import fp8_gemv_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _gate_up(n: int, k: int, group_n: int, group_k: int, seed: int):
    """A merged [gate | up] fp8 weight [2n, k] with its scales ([2n, 1] per channel)."""
    w = _randn(2 * n, k, seed=seed) * 0.05
    if group_n == 1:
        q, s = quantize_weight_channels(w)
        return q, s.view(-1, 1)
    return quantize_weight_blocks(w, group_n, group_k)


def _tile(block_n: int, block_k: int, split: int = 1) -> StreamConfig:
    return StreamConfig(block_n, block_k, 4, 2, True, split_k=split, fp8_dot=True, a8=True)


def _reference_gate_up(q, s, x_group, wq, ws, group_n, group_k):
    return fp8_gemv_reference(dequantize_blocks(q, s, 1, x_group), wq, ws, group_n, group_k)


# (m, n, k, group_n, group_k, x_group, block_n, split): one scale for each half of the tile (group_n a multiple of
# the half), a half across two scale blocks (each row its block's scale), K tails and split K, a 64-row tile, per
# channel with x per token (one dot chain) and with an N tail
CASES = [
    (5, 64, 96, 32, 32, 32, 64, 1),
    (3, 64, 200, 32, 64, 64, 64, 2),
    (40, 96, 128, 16, 32, 32, 32, 2),
    (6, 32, 96, 16, 32, 32, 64, 1),
    (7, 40, 72, 1, 72, 72, 32, 1),
    (9, 48, 160, 1, 160, 32, 64, 2),
]


@pytest.mark.parametrize("m,n,k,group_n,group_k,x_group,block_n,split", CASES)
def test_gated_gate_up_matches_silu_of_the_reference(m, n, k, group_n, group_k, x_group, block_n, split) -> None:
    wq, ws = _gate_up(n, k, group_n, group_k, seed=m + n)
    q, s = per_token_group_quant(_randn(m, k, seed=k), x_group)
    cfg = _tile(block_n, x_group if x_group < k else 32, split)
    out = fp8_gate_up_a8(q, s, wq, ws, group_n, group_k, torch.float32, config=cfg)
    gate_up = _reference_gate_up(q, s, x_group, wq, ws, group_n, group_k)
    want = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n,k,group_n,group_k,x_group,block_n,split", CASES)
def test_gated_gate_up_writes_the_down_input_as_the_quantization_launch_would(
    m, n, k, group_n, group_k, x_group, block_n, split
) -> None:
    wq, ws = _gate_up(n, k, group_n, group_k, seed=m + k)
    q, s = per_token_group_quant(_randn(m, k, seed=n), x_group)
    cfg = _tile(block_n, x_group if x_group < k else 32, split)
    h_q, h_s = fp8_gate_up_a8(q, s, wq, ws, group_n, group_k, torch.float32, config=cfg, quant_group=block_n // 2)
    want_q, want_s = silu_mul_group_quant(_reference_gate_up(q, s, x_group, wq, ws, group_n, group_k),
                                          block_n // 2)  # fmt: skip
    assert h_q.shape == (m, n) and h_s.shape == want_s.shape == (m, -(-n // (block_n // 2)))
    torch.testing.assert_close(h_s, want_s, rtol=1e-5, atol=0)
    steps = (h_q.float() - want_q.float()).abs() / want_q.float().abs().clamp(min=2**-6)
    assert (steps <= 0.126).all() and (steps > 0).float().mean() < 0.02


@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_gated_then_down_matches_the_unfused_launches(act_dtype) -> None:
    """The pair as layers/quant/fp8.apply_norm_mlp runs it (down reading the quantized silu·up in groups of its K
    step) against the launches it replaces: gate_up's [M, 2N] output in the activation dtype, silu_mul_group_quant,
    then the same down tile. Both round gate, up and silu·up alike and quantize the same values, so only summation
    order can differ. Against the model-dtype MLP on the dequantized weights the bound is the two activation
    quantizations' (the interpreter rounds to e4m3 coarser than the GPU: elements off by up to one binade)."""
    m, n, k, half = 4, 64, 96, 32
    wq, ws = _gate_up(n, k, 32, 32, seed=3)
    dq, ds = quantize_weight_blocks(_randn(k, n, seed=4) * 0.05, 32, 32)
    x = _randn(m, k, seed=5)
    q, s = per_token_group_quant(x, 32)
    h_q, h_s = fp8_gate_up_a8(q, s, wq, ws, 32, 32, act_dtype, config=_tile(2 * half, 32), quant_group=half)
    out = fp8_gemv_a8(h_q, h_s, dq, ds, 32, 32, torch.float32, config=_tile(16, half))
    gate_up = fp8_gemv_a8(q, s, wq, ws, 32, 32, act_dtype, config=_tile(32, 32))
    u_q, u_s = silu_mul_group_quant(gate_up, half)
    torch.testing.assert_close(out, fp8_gemv_a8(u_q, u_s, dq, ds, 32, 32, torch.float32, config=_tile(16, half)),
                               rtol=1e-3, atol=1e-4)  # fmt: skip
    exact = x @ dequantize_blocks(wq, ws, 32, 32).T
    want = (torch.nn.functional.silu(exact[:, :n]) * exact[:, n:]) @ dequantize_blocks(dq, ds, 32, 32).T
    assert ((out - want).norm() / want.norm()).item() < 0.15


def test_gated_gate_up_refuses_what_it_cannot_run() -> None:
    wq, ws = _gate_up(32, 64, 16, 32, seed=6)
    q, s = per_token_group_quant(_randn(2, 64, seed=7), 32)
    with pytest.raises(ValueError, match="must be FP8-dot tiles at least 32 rows tall"):
        fp8_gate_up_a8(q, s, wq, ws, 16, 32, torch.float32, config=_tile(16, 32))
    with pytest.raises(ValueError, match="quant_group=32 needs a gated tile of 32 columns \\(block_n 64\\), got block_n 32"):
        fp8_gate_up_a8(q, s, wq, ws, 16, 32, torch.float32, config=_tile(32, 32), quant_group=32)
    odd_q, odd_s = quantize_weight_blocks(_randn(48, 64, seed=8), 16, 32)  # halves of 24 rows: not whole 16-row blocks
    with pytest.raises(ValueError, match="each half of w has 24 rows, must be a multiple of the 16-row scale block"):
        fp8_gate_up_a8(q, s, odd_q, odd_s, 16, 32, torch.float32, config=_tile(32, 32))
    odd_rows, odd_scales = quantize_weight_channels(_randn(47, 64, seed=9))
    with pytest.raises(ValueError, match="w has 47 rows, must be \\[gate \\| up\\]: an even count"):
        fp8_gate_up_a8(q, s, odd_rows, odd_scales.view(-1, 1), 1, 64, torch.float32, config=_tile(32, 32))
    with pytest.raises(ValueError, match="output dtype torch.float8_e4m3fn is not one of"):
        fp8_gate_up_a8(q, s, wq, ws, 16, 32, q.dtype, config=_tile(32, 32))


# ---- the table's gated MLP pairs ---------------------------------------------------------------------

PAIR = GatedMlp(_tile(256, 128), dataclasses.replace(_tile(64, 128), split_k=2))


def _mlps(rows: list[dict]) -> dict:
    return {"device": "card", "shapes": [], "mlps": [{"name": "mlp", "hidden": 4096, "intermediate": 14336,
                                                      "scales": "channel", "rows": rows}]}


def test_rule_takes_the_pair_of_the_smallest_measured_count_and_none_where_unfused_won(monkeypatch) -> None:
    rule = Fp8Rule.from_json(_mlps([{"m": 16, "gate_up": None, "down": None}, {"m": 64, **PAIR.to_json()}]))
    assert rule.gated_mlp(8, 4096, 14336, "channel") is None  # unfused won at 16: no pair below it either
    assert rule.gated_mlp(17, 4096, 14336, "channel") == rule.gated_mlp(64, 4096, 14336, "channel") == PAIR
    assert rule.gated_mlp(65, 4096, 14336, "channel") is None and rule.gated_mlp(64, 4096, 14336, "block128") is None
    monkeypatch.setattr(fp8_config, "rule_for", lambda device: rule)
    cuda = torch.device("cuda", 0)
    assert gated_mlp(40, 4096, 14336, 1, 4096, cuda) == PAIR
    assert gated_mlp(40, 4096, 14336, 128, 128, cuda) is None  # block scales: not measured
    assert gated_mlp(40, 4096, 14336, 1, 4096, torch.device("cpu")) is None


@pytest.mark.parametrize("change,message", [
    ({"down": {**PAIR.to_json()["down"], "block_k": 256}}, "twice down's block_k=256"),
    ({"gate_up": {**PAIR.to_json()["gate_up"], "a8": False}}, "gate_up tile .* must be an a8 FP8-dot tile"),
    ({"gate_up": {**PAIR.to_json()["gate_up"], "block_n": 512}}, "block_n=512 exceeds 256"),
    ({"down": None}, "down is None: a pair names both tiles"),
    ({"gate_up": None}, "gate_up is None: a pair names both tiles"),
])
def test_rule_refuses_gated_pairs_no_call_can_run(change, message) -> None:
    with pytest.raises(ValueError, match=f"gated tiles for mlp m=64: .*{message}"):
        Fp8Rule.from_json(_mlps([{"m": 64, **PAIR.to_json(), **change}]))


def test_rule_refuses_block_scaled_pairs_whose_steps_are_not_the_scale_block() -> None:
    """With 128x128 weight blocks both tiles step one block along K (kernels/fp8_gemv.py refuses any other step
    at the call, which would be inside a graph capture): the table is refused at load instead."""
    half = GatedMlp(_tile(128, 128), _tile(64, 64))  # 64 output columns: down would step 64 columns
    data = _mlps([{"m": 8, **half.to_json()}])
    Fp8Rule.from_json(data)  # per channel any step runs
    data["mlps"][0]["scales"] = "block128"
    with pytest.raises(ValueError, match="gated tiles for mlp m=8: down tile's block_k=64 must be the 128-column"):
        Fp8Rule.from_json(data)


def test_the_benchmark_writes_a_pair_where_it_won_and_keeps_the_rest() -> None:
    kept = {"name": "kept", "n": 64, "k": 64, "scales": "channel", "rows": [{"m": 1, "path": "scaled_mm"}]}
    earlier = {"device": "card", "shapes": [kept],
               "mlps": [{"name": "llama3-8b mlp", "hidden": 4096, "intermediate": 14336, "scales": "channel",
                         "rows": [{"m": 8, "gate_up": None, "down": None}, {"m": 64, **PAIR.to_json()}]}]}
    row = {"shape": "llama3-8b mlp", "scales": "channel", "hidden": 4096, "intermediate": 14336, "pair": PAIR.to_json()}
    table = table_with([{**row, "m": 16, "gated_us": 90.0, "unfused_us": 100.0},
                        {**row, "m": 32, "gated_us": 99.0, "unfused_us": 100.0},
                        {**row, "m": 64, "gated_us": 101.0, "unfused_us": 100.0}], {"commit": "c", "date": "d"}, earlier)
    assert table["shapes"] == [kept]
    rows = {r["m"]: r for r in table["mlps"][0]["rows"]}
    assert sorted(rows) == [8, 16, 32, 64] and rows[8] == earlier["mlps"][0]["rows"][0]
    assert rows[32]["gate_up"] is None  # 1% faster: within what one row moves between runs, not kept
    assert rows[16]["gate_up"] == PAIR.to_json()["gate_up"] and rows[16]["measured_at"] == {"commit": "c", "date": "d"}
    assert rows[64]["gate_up"] is None and rows[64]["down"] is None  # the unfused launches won: no pair
    rule = Fp8Rule.from_json(table)
    assert rule.gated_mlp(16, 4096, 14336, "channel") == PAIR and rule.gated_mlp(64, 4096, 14336, "channel") is None


@pytest.mark.parametrize("block", [(32, 32), None], ids=["block", "channel"])
def test_the_layer_path_runs_the_pair_as_the_unfused_launches_would(block) -> None:
    """Fp8LinearMethod.norm_mlp_with (what apply_norm_mlp runs where the table has a pair) on real fp8 layers: the
    norm in gate_up's input quantization (groups of the tile's K step, or per token for per-channel weights), the
    gated tile, down's tile on the quantized silu·up. Against the same launches unfused (gate_up's [M, 2N] output,
    silu_mul_group_quant, the same down tile), which round and quantize alike: only summation order differs."""
    from graphserve.kernels.fp8_quant import norm_group_quant
    from graphserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from graphserve.layers.norm import RMSNorm
    from graphserve.layers.quant.config import Fp8Config
    from graphserve.layers.quant.fp8 import Fp8LinearMethod

    hidden, inter, m = 64, 64, 3
    gen = torch.Generator().manual_seed(11)
    gate_up, down = MergedColumnParallelLinear(hidden, [inter, inter], False), RowParallelLinear(inter, hidden, False)
    for layer in (gate_up, down):
        Fp8LinearMethod(Fp8Config(block=block, serialized=False)).create_weights(layer)
        layer.quant_method.init_random(layer, torch.float32, gen)
    norm = RMSNorm(hidden, 1e-6)
    x, residual = _randn(m, hidden, seed=12), _randn(m, hidden, seed=13)
    tiles = GatedMlp(_tile(64, 32), _tile(16, 32))
    out, new_residual = gate_up.quant_method.norm_mlp_with(tiles, gate_up, norm, x, residual, down)
    torch.testing.assert_close(new_residual, x + residual)
    gn, gk = block or (1, hidden)
    a_q, a_s, _ = norm_group_quant(x, norm.weight, norm.eps, 32 if block else hidden, residual)
    scale = gate_up.quant_method.scale(gate_up).view(2 * inter // gn if block else 2 * inter, -1)
    h = fp8_gemv_a8(a_q, a_s, gate_up.weight, scale, gn, gk, torch.float32, config=_tile(32, 32))
    h_q, h_s = silu_mul_group_quant(h, 32)
    down_scale = down.quant_method.scale(down).view(hidden // gn if block else hidden, -1)
    want = fp8_gemv_a8(h_q, h_s, down.weight, down_scale, gn, gk if block else inter, torch.float32,
                       config=_tile(16, 32))
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
