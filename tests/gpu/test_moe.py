"""The MoE kernels in bf16 at the expert shapes of Qwen3-30B-A3B, Mixtral-8x7B, OLMoE-1B-7B and
Qwen1.5-MoE-A2.7B, on the GPU.

Fresh random inputs per model and batch (1, 7, 64, 256, 2048) against an fp32 loop over experts;
the routing kernels against torch (softmax + topk; DeepSeek-V3's grouped sigmoid top-k); both expert paths forced at small batches; and
FusedMoE captured into a CUDA graph with padding rows, replayed on new inputs, routing and valid
count, equal to an eager call bit for bit, with padding rows zero and uncounted in expert_counts.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import MOE_MODELS as MODELS
from gpu_utils import capture, rel_err

from graphserve.kernels.moe_align import moe_align
from graphserve.kernels.moe_fused import fused_experts, moe_workspace_bytes
from graphserve.kernels.moe_gate import moe_gate_softmax_topk
from graphserve.kernels.moe_gate_dot import GATE_COUNTERS
from graphserve.kernels.moe_reference import (
    expert_counts_reference,
    experts_loop_reference,
    grouped_sigmoid_topk_reference,
    moe_align_reference,
    softmax_topk_reference,
)
from graphserve.kernels.moe_routing import moe_grouped_topk, moe_softmax_topk
from graphserve.layers.moe import FusedMoE, SoftmaxTopK

DT = torch.bfloat16
TOL = 2e-2
BATCHES = [1, 7, 64, 256, 2048]


@pytest.fixture(scope="module")
def experts() -> dict:
    """Stacked bf16 expert weights per model (and fp32 copies for the reference), made once."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    made = {}
    for name, (e, h, i, _, _) in MODELS.items():
        w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5).to(DT)
        w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5).to(DT)
        made[name] = (w13, w2, w13.float(), w2.float())
    return made


def _reference(x, w13f, w2f, w, ids) -> torch.Tensor:
    return experts_loop_reference(x.float(), w13f, w2f, w, ids)


@pytest.mark.parametrize("t", BATCHES)
@pytest.mark.parametrize("name", list(MODELS))
def test_fused_experts_bf16_model_shapes(name, t, experts, gen):
    e, h, _, k, renorm = MODELS[name]
    w13, w2, w13f, w2f = experts[name]
    x = torch.randn(t, h, device="cuda", generator=gen).to(DT)
    w, ids = moe_softmax_topk(torch.randn(t, e, device="cuda", generator=gen), k, renorm)
    counts = torch.full((e,), -1, dtype=torch.int32, device="cuda")
    out = fused_experts(x, w13, w2, w, ids, counts=counts)
    assert not out.isnan().any()
    assert rel_err(out, _reference(x, w13f, w2f, w, ids)) < TOL
    assert torch.equal(counts, expert_counts_reference(ids, None, e))


@pytest.mark.parametrize("t", [1, 2, 7])
@pytest.mark.parametrize("name", list(MODELS))
def test_both_paths_agree_at_small_batches(name, t, experts, gen):
    e, h, _, k, renorm = MODELS[name]
    w13, w2, w13f, w2f = experts[name]
    x = torch.randn(t, h, device="cuda", generator=gen).to(DT)
    w, ids = moe_softmax_topk(torch.randn(t, e, device="cuda", generator=gen), k, renorm)
    ref = _reference(x, w13f, w2f, w, ids)
    for path in ("gemv", "gemm"):
        assert rel_err(fused_experts(x, w13, w2, w, ids, path=path), ref) < TOL, path


# (experts, first local expert, local experts, tokens, k, block_m): qwen3-30b-a3b decode (512 pairs over
# several programs of the offsets kernel), DeepSeek-V3's 256 experts, an expert-parallel slice, the
# largest one-program count (1024 pairs) and the atomic count beyond it
@pytest.mark.parametrize("e,start,num_local,t,k,block_m", [
    (128, 0, 128, 64, 8, 16), (256, 0, 256, 64, 8, 16), (128, 32, 64, 64, 8, 16), (128, 0, 128, 128, 8, 32),
    (128, 0, 128, 2048, 8, 64), (8, 0, 8, 7, 2, 16),
])  # fmt: skip
def test_align_matches_reference_at_model_shapes(e, start, num_local, t, k, block_m, gen):
    _, ids = moe_softmax_topk(torch.randn(t, e, device="cuda", generator=gen), k, True)
    valid = torch.arange(t, device="cuda") < max(1, t - 3)
    counts = torch.full((e,), -7, dtype=torch.int32, device="cuda")
    align = moe_align(ids, valid, counts, start, num_local, block_m)
    ref_sorted, ref_experts, ref_total = moe_align_reference(ids, valid, start, num_local, block_m)
    assert torch.equal(counts.cpu(), expert_counts_reference(ids, valid, e).cpu())
    assert int(align.num_post_padded) == ref_total
    assert torch.equal(align.expert_ids.cpu(), ref_experts)
    # within a run (an expert's tiles) the order is the atomics' order, which may move a pair to another
    # tile of the same run: compare each run as a set
    got, want = align.sorted_ids.cpu().view(-1, block_m), ref_sorted.view(-1, block_m)
    for expert in ref_experts.unique():
        tiles = ref_experts == expert
        assert torch.equal(got[tiles].flatten().sort().values, want[tiles].flatten().sort().values), int(expert)


@pytest.mark.parametrize("t", [1, 7, 2048])
@pytest.mark.parametrize("name", list(MODELS))
def test_routing_kernel_matches_torch(name, t, gen):
    e, _, _, k, renorm = MODELS[name]
    logits = torch.randn(t, e, device="cuda", generator=gen) * 2
    w, ids = moe_softmax_topk(logits, k, renorm)
    w_ref, ids_ref = softmax_topk_reference(logits, k, renorm)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    # an id may differ from torch only where two probabilities tie to fp32 rounding
    probs = torch.softmax(logits, dim=-1)
    differs = ids != ids_ref
    gap = (probs.gather(1, ids.long()) - probs.gather(1, ids_ref.long())).abs()
    assert bool((gap[differs] < 1e-6).all()), int(differs.sum())


@pytest.mark.parametrize("t", [1, 3, 8, 9, 16, 32, 64])  # the FMA kernel up to 8 rows, the tensor-core one past it
@pytest.mark.parametrize("name", list(MODELS))
def test_fused_gate_matches_projection_then_topk(name, t, gen):
    """Gate projection + softmax top-k in one launch against F.linear (bf16 out, as the model's gate) + torch."""
    e, h, _, k, renorm = MODELS[name]
    gate = (torch.randn(e, h, device="cuda", generator=gen) * h**-0.5).to(DT)
    counter = torch.zeros(GATE_COUNTERS, dtype=torch.int32, device="cuda")
    for _ in range(3):  # the counters must come back to zero after every launch
        x = torch.randn(t, h, device="cuda", generator=gen).to(DT)
        w, ids = moe_gate_softmax_topk(x, gate, k, renorm, counter)
        logits = torch.nn.functional.linear(x, gate)
        w_ref, ids_ref = softmax_topk_reference(logits, k, renorm)
        assert not counter.any()
        # the two sums may round a logit one bf16 step apart: an id may differ only at a near-tie
        probs = torch.softmax(logits.float(), dim=-1)
        gap = (probs.gather(1, ids.long()) - probs.gather(1, ids_ref.long())).abs()
        assert bool((gap[ids != ids_ref] < 2e-2).all())
        same = (ids == ids_ref).all(dim=1)
        torch.testing.assert_close(w[same], w_ref[same], rtol=2e-2, atol=1e-3)


def _grid_gate_inputs(t: int, e: int, h: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x [t, h] in steps of 1/16 and a gate weight [e, h] in steps of 1/256: bf16 values whose dot products are
    exact in fp32 (|sum| < 2^24 steps of 2^-12), so every accumulation order rounds to the same bf16 logit."""
    x = torch.randint(-32, 33, (t, h), device="cuda", generator=gen) / 16
    w = torch.randint(-64, 65, (e, h), device="cuda", generator=gen) / 256
    return x.to(DT), w.to(DT)


def _exact_routing(x: torch.Tensor, gate: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference on the exact logits rounded to bf16, ties to the lower expert index (the kernels' rule;
    torch.topk orders ties its own way, and bf16 logits do tie)."""
    logits = (x.double() @ gate.double().T).to(DT)
    w_ref, _ = softmax_topk_reference(logits, k, renorm)
    probs = torch.softmax(logits.float(), dim=-1)
    return w_ref, torch.sort(probs, dim=1, descending=True, stable=True).indices[:, :k].to(torch.int32)


@pytest.mark.parametrize("t", [9, 16, 32, 64])
@torch.inference_mode()
def test_tensor_core_gate_exact_at_qwen3_router(t, gen):
    """qwen3-30b-a3b's router (E 128, H 2048, k 8) past MAX_ROWS rows on exactly summable inputs: the ids of the
    exact bf16 logits, fp32 weights; then captured into a CUDA graph and replayed on new inputs, equal to eager
    bit for bit with every row block's counter back at zero."""
    e, h, _, k, renorm = MODELS["qwen3-30b-a3b"]
    counter = torch.zeros(GATE_COUNTERS, dtype=torch.int32, device="cuda")
    x, gate = _grid_gate_inputs(t, e, h, gen)
    w, ids = moe_gate_softmax_topk(x, gate, k, renorm, counter)
    w_ref, ids_ref = _exact_routing(x, gate, k, renorm)
    assert torch.equal(ids, ids_ref) and not counter.any()
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-7)
    graph, (w_out, ids_out) = capture(lambda: moe_gate_softmax_topk(x, gate, k, renorm, counter))
    for _ in range(2):  # two replays: the counters must be back at zero for the second
        x.copy_(_grid_gate_inputs(t, e, h, gen)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert not counter.any()
        w_ref, ids_ref = _exact_routing(x, gate, k, renorm)
        assert torch.equal(ids_out, ids_ref)
        torch.testing.assert_close(w_out, w_ref, rtol=1e-5, atol=1e-7)
        eager = moe_gate_softmax_topk(x, gate, k, renorm, counter)
        assert torch.equal(eager[0], w_out) and torch.equal(eager[1], ids_out)


@pytest.mark.parametrize("t", [9, 64, 2048])
@pytest.mark.parametrize("name", list(MODELS))
def test_topk_selections_give_the_rounds_outputs(name, t, gen):
    """Every selection of kernels/moe_routing.TOPK_SELECTS writes the argmax rounds' weights and ids bit for bit:
    the standalone top-k at every model's router, and the tensor-core gate at its rows (qwen3's exact grid, where
    bf16 logits tie)."""
    from graphserve.kernels.moe_gate_dot import moe_gate_dot_softmax_topk
    from graphserve.kernels.moe_routing import TOPK_SELECTS

    e, h, _, k, renorm = MODELS[name]
    logits = torch.randn(t, e, device="cuda", generator=gen) * 2
    want = moe_softmax_topk(logits, k, renorm, select="rounds")
    counter = torch.zeros(GATE_COUNTERS, dtype=torch.int32, device="cuda")
    x, gate = _grid_gate_inputs(min(t, 64), e, h, gen)
    want_gate = moe_gate_dot_softmax_topk(x, gate, k, renorm, counter, select="rounds")
    for select in TOPK_SELECTS:
        got = moe_softmax_topk(logits, k, renorm, select=select)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), select
        got = moe_gate_dot_softmax_topk(x, gate, k, renorm, counter, select=select)
        assert torch.equal(got[0], want_gate[0]) and torch.equal(got[1], want_gate[1]), select
        assert not counter.any()


@pytest.mark.parametrize("block_ep", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_gate_rank_tail_agrees_with_argmax_rounds(name, block_ep, gen):
    """The one-row ranking tail and the rounds of argmax pick the same experts from the same logits."""
    e, h, _, k, renorm = MODELS[name]
    gate = (torch.randn(e, h, device="cuda", generator=gen) * h**-0.5).to(DT)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(3):
        x = torch.randn(1, h, device="cuda", generator=gen).to(DT)
        w_rank, ids_rank = moe_gate_softmax_topk(x, gate, k, renorm, counter, block_ep=block_ep, rank_topk=True)
        w_max, ids_max = moe_gate_softmax_topk(x, gate, k, renorm, counter, block_ep=block_ep, rank_topk=False)
        assert torch.equal(ids_rank, ids_max)
        torch.testing.assert_close(w_rank, w_max, rtol=1e-5, atol=1e-7)
        assert int(counter) == 0


@pytest.mark.parametrize("padded,real", [(1, 1), (1, 0), (8, 5), (16, 9), (64, 57)])  # past 8 rows: tensor cores
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
@torch.inference_mode()
def test_fused_gate_layer_under_cuda_graph_replay(name, padded, real, experts, gen):
    """FusedMoE.forward_gate captured with padding rows, replayed on new inputs: equal to eager, padding zero."""
    e, h, i, k, renorm = MODELS[name]
    layer = FusedMoE(e, k, h, i, SoftmaxTopK(e, k, renorm), dtype=DT, device="cuda")
    layer.w13_weight.copy_(experts[name][0])
    layer.w2_weight.copy_(experts[name][1])
    gate = torch.nn.Linear(h, e, bias=False, device="cuda", dtype=DT)
    gate.weight.copy_(torch.randn(e, h, device="cuda", generator=gen) * h**-0.5)
    x = torch.randn(padded, h, device="cuda", generator=gen).to(DT)
    valid = torch.tensor(padded, device="cuda")
    graph, out = capture(lambda: layer.forward_gate(x, gate, valid=valid))
    for _ in range(2):  # two replays: the done-counter must be back at zero for the second
        x.copy_(torch.randn(padded, h, device="cuda", generator=gen).to(DT))
        x[real:] = float("nan")
        valid.fill_(real)
        graph.replay()
        torch.cuda.synchronize()
        assert not layer.gate_counters.any()
        replay_out, replay_counts = out.clone(), layer.expert_counts.clone()
        assert torch.equal(replay_out, layer.forward_gate(x, gate, valid=valid))
        assert torch.equal(replay_out[real:], torch.zeros(padded - real, h, device="cuda", dtype=DT))
        assert int(replay_counts.sum()) == real * k
        if real:
            # the routing the kernel chose (test_fused_gate_matches_projection_then_topk checks it
            # against torch): a near-tie decided the other way would swap an expert here
            w, ids = moe_gate_softmax_topk(x, gate.weight, k, renorm, torch.zeros_like(layer.gate_counters))
            ref = _reference(x[:real], experts[name][2], experts[name][3], w[:real], ids[:real])
            assert rel_err(replay_out[:real], ref) < TOL


@pytest.mark.parametrize("t", [1, 7, 2048])
def test_grouped_topk_kernel_matches_torch_at_deepseek_v3_shape(t, gen):
    # DeepSeek-V3: 256 routed experts in 8 groups, the best 4 groups, 8 experts, scaling 2.5
    e, n_group, topk_group, k = 256, 8, 4, 8
    logits = torch.randn(t, e, device="cuda", generator=gen) * 2
    bias = torch.randn(e, device="cuda", generator=gen) * 0.1
    w, ids = moe_grouped_topk(logits, k, bias, n_group, topk_group, True, 2.5)
    w_ref, ids_ref = grouped_sigmoid_topk_reference(logits, k, bias, n_group, topk_group, True, 2.5)
    # a row may differ from torch only where its decision is a tie to fp32 rounding: between the
    # last group kept and the first dropped, or the k-th expert and the next allowed one
    biased = torch.sigmoid(logits) + bias
    merit = biased.view(t, n_group, -1).topk(2, dim=-1).values.sum(-1)
    kept = torch.zeros_like(merit, dtype=torch.bool).scatter_(1, merit.topk(topk_group, dim=1).indices, True)
    allowed = kept[:, torch.arange(e, device="cuda") // (e // n_group)]
    ranked = biased.masked_fill(~allowed, float("-inf")).sort(dim=1, descending=True).values
    merits = merit.sort(dim=1, descending=True).values
    margin = torch.minimum(merits[:, topk_group - 1] - merits[:, topk_group], ranked[:, k - 1] - ranked[:, k])
    same = (ids == ids_ref).all(dim=1)
    assert bool((margin[~same] < 1e-5).all()), margin[~same]
    torch.testing.assert_close(w[same], w_ref[same], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("padded,real", [(1, 1), (1, 0), (8, 5), (64, 50), (256, 201)])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
@torch.inference_mode()
def test_cuda_graph_replay_with_padding_rows(name, padded, real, experts, gen):
    e, h, i, k, renorm = MODELS[name]
    layer = FusedMoE(e, k, h, i, SoftmaxTopK(e, k, renorm), dtype=DT, device="cuda")
    layer.w13_weight.copy_(experts[name][0])
    layer.w2_weight.copy_(experts[name][1])
    x = torch.randn(padded, h, device="cuda", generator=gen).to(DT)
    logits = torch.randn(padded, e, device="cuda", generator=gen)
    valid = torch.tensor(padded, device="cuda")
    graph, out = capture(lambda: layer(x, logits, valid=valid))
    x.copy_(torch.randn(padded, h, device="cuda", generator=gen).to(DT))
    logits.copy_(torch.randn(padded, e, device="cuda", generator=gen) * 3)
    x[real:] = float("nan")  # padding rows hold stale data: nothing of them may reach the output
    logits[real:] = float("nan")
    valid.fill_(real)
    layer.expert_counts.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    replay_out, replay_counts = out.clone(), layer.expert_counts.clone()
    assert torch.equal(replay_out, layer(x, logits, valid=valid))
    assert torch.equal(replay_out[real:], torch.zeros(padded - real, h, device="cuda", dtype=DT))
    w, ids = softmax_topk_reference(logits[:real], k, renorm)
    want_counts = expert_counts_reference(ids, None, e)
    assert torch.equal(replay_counts, want_counts)
    if real:
        ref = _reference(x[:real], experts[name][2], experts[name][3], w, ids)
        assert rel_err(replay_out[:real], ref) < TOL


@torch.inference_mode()
def test_uniform_routing_spreads_pairs_evenly(experts, gen):
    e, h, i, k, renorm = MODELS["qwen3-30b-a3b"]
    layer = FusedMoE(e, k, h, i, SoftmaxTopK(e, k, renorm), dtype=DT, device="cuda")
    layer.w13_weight.copy_(experts["qwen3-30b-a3b"][0])
    layer.w2_weight.copy_(experts["qwen3-30b-a3b"][1])
    layer.routing_override = "uniform"
    x = torch.randn(64, h, device="cuda", generator=gen).to(DT)
    out = layer(x, torch.randn(64, e, device="cuda", generator=gen))
    assert torch.equal(layer.expert_counts, torch.full((e,), 64 * k // e, dtype=torch.int32, device="cuda"))
    ids = (torch.arange(64 * k, device="cuda", dtype=torch.int32) % e).view(64, k)
    w = torch.full((64, k), 1 / k, device="cuda")
    assert rel_err(out, _reference(x, experts["qwen3-30b-a3b"][2], experts["qwen3-30b-a3b"][3], w, ids)) < TOL


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_workspace_bound_covers_what_a_forward_allocates(name, experts, gen):
    e, h, i, k, renorm = MODELS[name]
    w13, w2 = experts[name][:2]
    for t in (1, 64, 2048):
        x = torch.randn(t, h, device="cuda", generator=gen).to(DT)
        w, ids = moe_softmax_topk(torch.randn(t, e, device="cuda", generator=gen), k, renorm)
        counts = torch.empty(e, dtype=torch.int32, device="cuda")
        fused_experts(x, w13, w2, w, ids, counts=counts)  # compiled and cached before measuring
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fused_experts(x, w13, w2, w, ids, counts=counts)
        torch.cuda.synchronize()
        used = torch.cuda.max_memory_allocated() - base
        # the caching allocator rounds each of the ~8 buffers up to 512 bytes
        assert out.numel() and used <= moe_workspace_bytes(t, k, e, i, h, DT) + 8 * 512, (t, used)


@pytest.mark.parametrize("t", [16, 64])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
@torch.inference_mode()
def test_gate_asking_l2_for_the_experts_changes_nothing(name, t, experts, gen):
    """The tensor-core gate with the experts' first weights asked of L2 (kernels/l2_prefetch.py), up to the
    largest budget, eager and replayed: the routing bit for bit as without, the weight untouched."""
    from graphserve.kernels.l2_prefetch import MAX_MB, l2_prefetch, plan
    from graphserve.kernels.moe_gate_dot import moe_gate_dot_softmax_topk

    e, h, _, k, renorm = MODELS[name]
    w13 = experts[name][0]
    before = w13.clone()
    counter = torch.zeros(GATE_COUNTERS, dtype=torch.int32, device="cuda")
    x, gate = _grid_gate_inputs(t, e, h, gen)
    want = moe_gate_dot_softmax_topk(x, gate, k, renorm, counter)
    with l2_prefetch(MAX_MB):
        asked = plan(w13, 128, 128, "gate")
        assert asked is not None and 0 < asked.nbytes <= min(MAX_MB * 2**20, w13.numel() * w13.element_size())
        got = moe_gate_dot_softmax_topk(x, gate, k, renorm, counter, prefetch=w13)
        graph, out = capture(lambda: moe_gate_dot_softmax_topk(x, gate, k, renorm, counter, prefetch=w13))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x2, _ = _grid_gate_inputs(t, e, h, gen)
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    again = moe_gate_dot_softmax_topk(x, gate, k, renorm, counter)
    assert torch.equal(out[0], again[0]) and torch.equal(out[1], again[1])
    assert not counter.any() and torch.equal(w13, before)


@pytest.mark.parametrize("t", [7, 64, 256])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
@torch.inference_mode()
def test_slot_sum_asking_l2_for_the_next_weight_changes_nothing(name, t, experts, gen):
    """fused_experts with ``read_next`` under the largest budget: the output bit for bit as without, eager and
    replayed, on both paths (the streaming path has no slot-sum launch and asks nothing)."""
    from graphserve.kernels.l2_prefetch import MAX_MB, l2_prefetch

    e, h, _, k, _ = MODELS[name]
    w13, w2 = experts[name][:2]
    nxt = torch.randn(6 * h, h, device="cuda", generator=gen).to(DT)  # a qkv weight
    before = nxt.clone()
    x = torch.randn(t, h, device="cuda", generator=gen).to(DT)
    w = torch.rand(t, k, device="cuda", generator=gen)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    want = fused_experts(x, w13, w2, w, ids)
    with l2_prefetch(MAX_MB):
        got = fused_experts(x, w13, w2, w, ids, read_next=nxt)
        graph, out = capture(lambda: fused_experts(x, w13, w2, w, ids, read_next=nxt))
    assert torch.equal(got, want)
    x.copy_(torch.randn(t, h, device="cuda", generator=gen).to(DT))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_experts(x, w13, w2, w, ids)) and torch.equal(nxt, before)
