"""The router gate + softmax top-k on the tensor cores (9..64 rows), on CPU through Triton's interpreter.

fp16, not bf16: Triton 3.6's interpreter returns garbage from tl.dot on bf16 operands (see
tests/kernels/test_fp8_stream_interp.py); the kernel is the same code at either 16-bit type, and the bf16 runs
at the model shapes live in tests/gpu/test_moe.py.

The inputs sit on a grid (x in steps of 1/16, the weight in steps of 1/256) whose products and sums are
exact in fp32, so every accumulation order gives the same fp32 logit and the one rounding to fp16 is the
same as F.linear's: the logits are bit for bit those of the projection, and the comparison can be exact.
Rounded logits do tie; the kernel gives the lower expert index the earlier slot (as kernels/moe_routing's
argmax rounds do), torch.topk orders ties its own way, so the ids are compared exactly with a stable sort
of the reference's probabilities and with softmax_topk_reference on the slots no tie reaches.
"""

from __future__ import annotations

import torch
from interp_setup import kernel_device, use_interpreter

use_interpreter("graphserve.layers.moe")

import pytest  # noqa: E402

from graphserve.kernels.moe_gate import MAX_ROWS, gate_fusable, moe_gate_softmax_topk  # noqa: E402
from graphserve.kernels.moe_gate_dot import DOT_MAX_ROWS, GATE_COUNTERS, moe_gate_dot_softmax_topk  # noqa: E402
from graphserve.kernels.moe_reference import softmax_topk_reference  # noqa: E402
from graphserve.layers.moe import FusedMoE, SoftmaxTopK  # noqa: E402

DEVICE = kernel_device()
DT = torch.float16


def _grid_inputs(t: int, e: int, h: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [t, h] and a gate weight [e, h] whose dot products are exact in fp32 (|sum| < 2^24 steps of 2^-12)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-32, 33, (t, h), generator=gen) / 16
    w = torch.randint(-64, 65, (e, h), generator=gen) / 256
    return x.to(DT).to(DEVICE), w.to(DT).to(DEVICE)


def _check_routing(x, gate, k, renorm, w, ids):
    logits = torch.nn.functional.linear(x, gate)
    assert torch.equal(logits, (x.double() @ gate.double().T).to(DT)), "the test's grid no longer sums exactly"
    w_ref, ids_ref = softmax_topk_reference(logits, k, renorm)
    probs = torch.softmax(logits.float(), dim=-1)
    stable = torch.sort(probs, dim=1, descending=True, stable=True).indices[:, :k].to(torch.int32)
    assert torch.equal(ids, stable)
    # slots whose probability no other expert in the top k + 1 shares: there torch.topk's order is the only one
    top = torch.sort(probs, dim=1, descending=True).values[:, : k + 1]
    untied = (top[:, :k, None] != top[:, None, :]).sum(-1) == k
    assert torch.equal(ids[untied], ids_ref[untied])
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-7)


CASES = [(t, e, k) for t in (9, 16, 33, 64) for e, k in ((128, 8), (60, 4))]


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("t,e,k", CASES)
def test_dot_gate_matches_projection_then_topk(t, e, k, renorm):
    """Through moe_gate_softmax_topk (which hands rows past MAX_ROWS to the tensor-core kernel): the reference's
    routing, the same outputs at a second call, every row block's counter back at zero."""
    x, gate = _grid_inputs(t, e, 256, seed=t * e + renorm)
    counter = torch.zeros(GATE_COUNTERS, dtype=torch.int32, device=DEVICE)
    w, ids = moe_gate_softmax_topk(x, gate, k, renorm, counter)
    _check_routing(x, gate, k, renorm, w, ids)
    assert torch.equal(counter, torch.zeros_like(counter))
    again = moe_gate_softmax_topk(x, gate, k, renorm, counter)
    assert torch.equal(again[0], w) and torch.equal(again[1], ids)
    assert torch.equal(counter, torch.zeros_like(counter))


def test_dot_gate_at_qwen3_router_shape():
    """qwen3-30b-a3b's router (E 128, H 2048, k 8) at 64 rows: four row blocks, the shape's own tiles."""
    x, gate = _grid_inputs(64, 128, 2048, seed=64)
    counter = torch.zeros(GATE_COUNTERS, dtype=torch.int32, device=DEVICE)
    w, ids = moe_gate_softmax_topk(x, gate, 8, True, counter)
    _check_routing(x, gate, 8, True, w, ids)
    assert torch.equal(counter, torch.zeros_like(counter))


@pytest.mark.parametrize(
    "t,h,block_ep,split_k",
    [
        (20, 200, None, None),  # H off every tile: the last split's columns masked
        (5, 256, 32, 1),  # rows the FMA kernel would take, through the tensor-core one; one split, wide expert blocks
        (40, 384, 16, 3),  # splits not a power of two (two of 256 columns cover H)
        (64, 64, 64, 8),  # more splits asked than H has steps: the empty ones are not launched
    ],
)
def test_dot_gate_tiles_override(t, h, block_ep, split_k):
    x, gate = _grid_inputs(t, 60, h, seed=t + h)
    counter = torch.zeros(GATE_COUNTERS, dtype=torch.int32, device=DEVICE)
    w, ids = moe_gate_dot_softmax_topk(x, gate, 4, False, counter, block_ep=block_ep, split_k=split_k)
    _check_routing(x, gate, 4, False, w, ids)
    assert torch.equal(counter, torch.zeros_like(counter))


@pytest.mark.parametrize("select", ["packed", "bitonic"])
@pytest.mark.parametrize("t,e,k", [(64, 128, 8), (33, 60, 4), (16, 64, 6)])
def test_dot_gate_selections_give_the_rounds_outputs(t, e, k, select):
    """The packed-key selections (kernels/moe_routing.TOPK_SELECTS) write the argmax rounds' weights and ids bit
    for bit, ties included (the grid's rounded logits tie), with k not a power of two too."""
    x, gate = _grid_inputs(t, e, 256, seed=t + e + k)
    counter = torch.zeros(GATE_COUNTERS, dtype=torch.int32, device=DEVICE)
    w0, ids0 = moe_gate_dot_softmax_topk(x, gate, k, True, counter, select="rounds")
    w, ids = moe_gate_dot_softmax_topk(x, gate, k, True, counter, select=select)
    assert torch.equal(ids, ids0) and torch.equal(w, w0)
    _check_routing(x, gate, k, True, w, ids)


@pytest.mark.parametrize("select", ["rounds", "packed", "bitonic"])
def test_softmax_topk_selections_agree_with_ties_and_padding(select):
    """moe_softmax_topk by each selection: the stable order of the probabilities (a tie to the lower expert),
    experts past E (60 in a 64-wide tile) never chosen, an all-equal row in expert order; an unknown selection is
    refused by name."""
    from graphserve.kernels.moe_routing import moe_softmax_topk

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 60, generator=gen)
    logits[0, 3] = logits[0, 41] = logits[0, 7] = logits[0].max() + 1.0  # a three-way tie at the top
    logits[1] = -30.0  # every probability equal
    logits = logits.to(DEVICE)
    w, ids = moe_softmax_topk(logits, 6, False, select=select)
    probs = torch.softmax(logits.float(), dim=-1)
    stable = torch.sort(probs, dim=1, descending=True, stable=True)
    assert torch.equal(ids, stable.indices[:, :6].to(torch.int32))
    assert torch.equal(ids[1].cpu(), torch.arange(6, dtype=torch.int32))
    torch.testing.assert_close(w, stable.values[:, :6], rtol=1e-6, atol=0)  # the kernel's own exp and sum
    with pytest.raises(ValueError, match=r"select='sorted' must be one of \('rounds', 'packed', 'bitonic'\)"):
        moe_softmax_topk(logits, 6, False, select="sorted")


def test_dot_gate_refuses_by_name_and_limit():
    x, gate = _grid_inputs(DOT_MAX_ROWS + 1, 16, 64, seed=1)
    counter = torch.zeros(GATE_COUNTERS, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=rf"fused gate takes 1..{DOT_MAX_ROWS} rows, got {DOT_MAX_ROWS + 1}"):
        moe_gate_softmax_topk(x, gate, 2, True, counter)
    with pytest.raises(ValueError, match=r"counter must be int32 \[>= 3\] \(one per row block\)"):
        moe_gate_softmax_topk(x[:33], gate, 2, True, counter[:2])
    with pytest.raises(ValueError, match=r"tensor-core gate takes x of .* got torch.float32"):
        moe_gate_dot_softmax_topk(x[:9].float(), gate.float(), 2, True, counter)
    with pytest.raises(ValueError, match=r"block_ep=8 must be a power of two >= 16"):
        moe_gate_dot_softmax_topk(x[:9], gate, 2, True, counter, block_ep=8)
    with pytest.raises(ValueError, match=r"rank_topk takes 1 row .* got T=9"):
        moe_gate_softmax_topk(x[:9], gate, 2, True, counter, rank_topk=True)


def test_gate_fusable_rows_by_dtype():
    gate = torch.zeros(8, 32, dtype=DT, device=DEVICE)
    for rows, dtype, fusable in [(MAX_ROWS, torch.float32, True), (MAX_ROWS + 1, torch.float32, False),
                                 (MAX_ROWS + 1, DT, True), (DOT_MAX_ROWS, torch.bfloat16, True),
                                 (DOT_MAX_ROWS + 1, DT, False)]:  # fmt: skip
        x = torch.zeros(rows, 32, dtype=dtype, device=DEVICE)
        assert gate_fusable(x, gate.to(dtype)) == fusable, (rows, dtype)


@pytest.mark.parametrize("rows", [MAX_ROWS, MAX_ROWS + 1, 37])
def test_layer_fused_gate_past_max_rows_matches_gate_then_forward(rows):
    """FusedMoE.forward_gate in fp16: the gate projection never runs (FMA kernel up to MAX_ROWS rows, tensor-core
    kernel past it), the output and expert counts those of the CPU path (projection, torch.topk, loop of experts);
    the layer's counters back at zero."""
    e, k, h, inter = 6, 2, 40, 24
    x, gate_w = _grid_inputs(rows, e, h, seed=rows)
    logits = torch.nn.functional.linear(x, gate_w).float()
    top = torch.sort(logits, dim=1, descending=True).values[:, : k + 1]
    assert bool((top[:, :-1] != top[:, 1:]).all()), "the seed's data has a tie in the top k + 1: pick another"
    gen = torch.Generator().manual_seed(rows)
    layer = FusedMoE(e, k, h, inter, SoftmaxTopK(e, k, True), dtype=DT).to(DEVICE)
    gate = torch.nn.Linear(h, e, bias=False, dtype=DT).to(DEVICE)
    with torch.no_grad():
        layer.w13_weight.copy_(torch.randn(e, 2 * inter, h, generator=gen) * 0.3)
        layer.w2_weight.copy_(torch.randn(e, h, inter, generator=gen) * 0.3)
        gate.weight.copy_(gate_w)
    valid = torch.tensor(rows - 2, device=DEVICE)
    layer.use_kernels = False
    want = layer(x, gate(x), valid=valid)
    want_counts = layer.expert_counts.clone()
    layer.use_kernels = True
    calls = []
    gate.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        got = layer.forward_gate(x, gate, valid=valid)
    assert not calls  # a fused kernel ran, not the projection
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    assert torch.equal(layer.expert_counts, want_counts)
    assert torch.equal(layer.gate_counters, torch.zeros(GATE_COUNTERS, dtype=torch.int32, device=DEVICE))
