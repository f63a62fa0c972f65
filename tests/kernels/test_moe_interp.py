"""The MoE kernels against their PyTorch references, on CPU through Triton's interpreter.

fp32, tiny shapes whose sizes are not multiples of the tiles, fresh random inputs: the routing
kernels (softmax top-k, grouped sigmoid top-k), the sort/align, both expert paths (grouped GEMM
and streaming) with padding rows and an expert-parallel slice, and FusedMoE on the kernel path
against its own CPU path. The bf16 model-shape versions and the CUDA-graph checks live in
tests/gpu/test_moe.py.
"""

from __future__ import annotations

import torch
from interp_setup import kernel_device, use_interpreter
from tune_utils import before_never_kept

use_interpreter("graphserve.layers.moe")

import pytest  # noqa: E402

from graphserve.kernels import moe_align as moe_align_mod  # noqa: E402
from graphserve.kernels.moe_align import moe_align  # noqa: E402
from graphserve.kernels.moe_config import GemmTile, GemvTile  # noqa: E402
from graphserve.kernels.moe_fused import fused_experts  # noqa: E402
from graphserve.kernels.moe_gate import (  # noqa: E402
    moe_add_norm_gate_reference,
    moe_add_norm_gate_softmax_topk,
    moe_gate_softmax_topk,
)
from graphserve.kernels.moe_reference import (  # noqa: E402
    expert_counts_reference,
    experts_reference,
    grouped_sigmoid_topk_reference,
    moe_align_reference,
    softmax_topk_reference,
)
from graphserve.kernels.moe_routing import moe_grouped_topk, moe_softmax_topk  # noqa: E402
from graphserve.layers.moe import FusedMoE, SoftmaxTopK  # noqa: E402

DEVICE = kernel_device()
H, INTER, E = 40, 24, 6
GEMM = (GemmTile(16, 16, 32, 2, 4, 2), GemmTile(16, 32, 16, 1, 4, 2))
GEMV = (GemvTile(8, 16, 4), GemvTile(16, 16, 4))


def _randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)


def routed_tokens(gen: torch.Generator, t: int, h: int, k: int, padded: bool):
    """``t`` tokens routed to ``k`` of ``E`` experts: (x, topk_w, topk_ids, valid). Where ``padded``, the last two
    are padding rows holding NaN, as whatever the batch buffer held: nothing of them may leak."""
    x = _randn(t, h, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(t, E, gen=gen), k, True)
    valid = (torch.arange(t, device=DEVICE) < t - 2) if padded else None
    if padded:
        x[-2:] = float("nan")
        topk_w[-2:] = float("nan")
    return x, topk_w, topk_ids, valid


@pytest.mark.parametrize("t,e,k,renorm", [(1, 8, 2, True), (5, 60, 4, False), (19, 6, 3, True)])
def test_softmax_topk_matches_reference(t, e, k, renorm):
    gen = torch.Generator().manual_seed(t * 100 + e)
    logits = _randn(t, e, gen=gen, scale=3.0)
    w, ids = moe_softmax_topk(logits, k, renorm, block_t=4)
    w_ref, ids_ref = softmax_topk_reference(logits, k, renorm)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "t,e,k,n_group,topk_group,renorm",
    [(5, 16, 4, 4, 2, True), (9, 12, 2, 3, 1, False), (3, 8, 3, 8, 3, True), (4, 6, 2, 1, 1, True)],
)
def test_grouped_topk_matches_reference(t, e, k, n_group, topk_group, renorm):
    gen = torch.Generator().manual_seed(t * 10 + e)
    logits, bias = _randn(t, e, gen=gen, scale=2.0), _randn(e, gen=gen, scale=0.5)
    w, ids = moe_grouped_topk(logits, k, bias, n_group, topk_group, renorm, 2.5, block_t=4)
    w_ref, ids_ref = grouped_sigmoid_topk_reference(logits, k, bias, n_group, topk_group, renorm, 2.5)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tiles_per_program", [None, 2])
@pytest.mark.parametrize("count_in_one_program", [True, False])
@pytest.mark.parametrize("expert_start,num_local,block_m", [(0, E, 16), (2, 3, 4)])
def test_align_matches_reference(expert_start, num_local, block_m, count_in_one_program, tiles_per_program,
                                 monkeypatch):  # fmt: skip
    if not count_in_one_program:  # the large-batch count: zeroed buffer, atomic per-program histograms
        monkeypatch.setattr(moe_align_mod, "SINGLE_PROGRAM_MAX_PAIRS", 4)
    if tiles_per_program:  # tile owners and sentinel fill split over several programs, as at real sizes
        monkeypatch.setattr(moe_align_mod, "OWNER_TILES", tiles_per_program)
    gen = torch.Generator().manual_seed(block_m)
    ids = torch.randint(0, E, (11, 3), generator=gen, dtype=torch.int32).to(DEVICE)
    valid = torch.arange(11, device=DEVICE) < 9
    counts = torch.full((E,), -7, dtype=torch.int32, device=DEVICE)
    align = moe_align(ids, valid, counts, expert_start, num_local, block_m)
    ref_sorted, ref_experts, ref_total = moe_align_reference(ids, valid, expert_start, num_local, block_m)
    assert torch.equal(counts.cpu(), expert_counts_reference(ids, valid, E).cpu())
    assert int(align.num_post_padded) == ref_total
    assert torch.equal(align.expert_ids.cpu(), ref_experts)
    if count_in_one_program:  # placed without atomics: pair order within a run, as the reference
        assert torch.equal(align.sorted_ids.cpu(), ref_sorted)
    else:  # within a run the order is the atomics' order: compare each tile as a set
        got = align.sorted_ids.cpu().view(-1, block_m).sort(dim=1).values
        assert torch.equal(got, ref_sorted.view(-1, block_m).sort(dim=1).values)


class _NoLaunch:
    """Stands in for a kernel a small batch must not launch."""

    def __getitem__(self, grid):
        raise AssertionError("a small batch's sort launched a second kernel")


def _hot_expert_ids(t: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Every row picks k of 5 experts, expert 5 in most rows: one run of many tiles, most runs empty."""
    pool = torch.tensor([5, 9, 40, 41, 42])
    return torch.stack([pool[torch.randperm(5, generator=gen)[:k]] for _ in range(t)]).to(torch.int32)


# (tokens, k, experts, first local expert, local experts, block_m, hot): qwen3-30b-a3b at batch 64 and at
# the largest one-launch batch (exactly SINGLE_PROGRAM_MAX_PAIRS pairs), an expert-parallel slice of it,
# a skewed batch with an expert-parallel slice (experts 40..42 routed elsewhere), batch 1
SINGLE_LAUNCH_CASES = [
    (64, 8, 128, 0, 128, 16, False),
    (128, 8, 128, 0, 128, 16, False),
    (128, 8, 128, 32, 64, 16, False),
    (100, 4, 64, 4, 32, 16, True),
    (1, 8, 128, 0, 128, 16, False),
]


@pytest.mark.parametrize("t,k,e,expert_start,num_local,block_m,hot", SINGLE_LAUNCH_CASES)
def test_align_in_one_launch_matches_reference(t, k, e, expert_start, num_local, block_m, hot, monkeypatch):
    """Up to SINGLE_PROGRAM_MAX_PAIRS the offsets kernel places every pair itself, in pair order per run."""
    monkeypatch.setattr(moe_align_mod, "moe_count_kernel", _NoLaunch())
    monkeypatch.setattr(moe_align_mod, "moe_align_scatter_kernel", _NoLaunch())
    gen = torch.Generator().manual_seed(t * k + expert_start)
    if hot:
        ids = _hot_expert_ids(t, k, gen)
    else:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    assert t * k <= moe_align_mod.SINGLE_PROGRAM_MAX_PAIRS
    ids = ids.to(DEVICE)
    valid = torch.rand(t, generator=gen).to(DEVICE) < 0.9  # padding rows scattered through the batch
    valid[0] = True
    counts = torch.full((e,), -7, dtype=torch.int32, device=DEVICE)
    align = moe_align(ids, valid, counts, expert_start, num_local, block_m)
    ref_sorted, ref_experts, ref_total = moe_align_reference(ids, valid, expert_start, num_local, block_m)
    assert torch.equal(counts.cpu(), expert_counts_reference(ids, valid, e).cpu())
    assert int(align.num_post_padded) == ref_total
    assert torch.equal(align.expert_ids.cpu(), ref_experts)
    assert torch.equal(align.sorted_ids.cpu(), ref_sorted)
    # the reference's order spelled out: each run holds its pairs in increasing order, then the sentinel
    tiles, experts = align.sorted_ids.cpu().view(-1, block_m), align.expert_ids.cpu()
    for expert in range(num_local):
        run, n = tiles[experts == expert].flatten(), int(counts[expert_start + expert])
        assert torch.all(run[:n].diff() > 0) and torch.all(run[n:] == t * k), expert
    assert torch.all(tiles[experts == -1] == t * k)


def _weights(gen: torch.Generator, num_local: int = E, h: int = H, inter: int = INTER) -> tuple[torch.Tensor, ...]:
    return _randn(num_local, 2 * inter, h, gen=gen, scale=0.3), _randn(num_local, h, inter, gen=gen, scale=0.3)


# (tokens, k, first local expert, local experts, padding rows, hidden, intermediate): K and N not
# multiples of the tiles (masked tails), then multiples (the unmasked loads the real shapes take)
FUSED_CASES = [(7, 2, 0, E, False, H, INTER), (9, 3, 2, 3, True, H, INTER), (6, 2, 1, 4, True, 64, 32)]


@pytest.mark.parametrize("path", ["gemm", "gemv"])
@pytest.mark.parametrize("t,k,expert_start,num_local,padded,h,inter", FUSED_CASES)
def test_fused_experts_matches_reference(path, t, k, expert_start, num_local, padded, h, inter):
    gen = torch.Generator().manual_seed(t * k + num_local)
    w13, w2 = _weights(gen, num_local, h, inter)
    x, topk_w, topk_ids, valid = routed_tokens(gen, t, h, k, padded)
    counts = torch.full((E,), -1, dtype=torch.int32, device=DEVICE)
    out = fused_experts(x, w13, w2, topk_w, topk_ids, valid=valid, expert_start=expert_start, counts=counts,
                        path=path, gemm_tiles=GEMM, gemv_tiles=GEMV)  # fmt: skip
    want = experts_reference(x, w13, w2, topk_w, topk_ids, valid, expert_start)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(counts.cpu(), expert_counts_reference(topk_ids, valid, E).cpu())
    if padded:
        assert torch.equal(out[-2:].cpu(), torch.zeros(2, h))


def test_streaming_steps_without_a_mask_read_one_held_all_true_mask():
    """Eager steps pass no mask: the streaming kernels (one compiled HAS_VALID variant) read a held all-true mask
    that grows by powers of two, not one allocated per call; a step with its own mask (a graph replay's) reads that
    one, and its padding rows still come out zero."""
    from graphserve.kernels import moe_fused

    moe_fused._ALL_ROWS_VALID.pop(DEVICE, None)
    gen = torch.Generator().manual_seed(21)
    w13, w2 = _weights(gen)
    held = []
    for t, padded in ((5, False), (3, False), (7, True), (8, False), (9, False)):
        x, topk_w, topk_ids, valid = routed_tokens(gen, t, H, 2, padded)
        counts = torch.full((E,), -1, dtype=torch.int32, device=DEVICE)
        out = fused_experts(x, w13, w2, topk_w, topk_ids, valid=valid, counts=counts, path="gemv", gemv_tiles=GEMV)
        torch.testing.assert_close(out, experts_reference(x, w13, w2, topk_w, topk_ids, valid, 0), rtol=1e-4,
                                   atol=1e-5)
        assert torch.equal(counts.cpu(), expert_counts_reference(topk_ids, valid, E).cpu())
        if padded:
            assert torch.equal(out[-2:].cpu(), torch.zeros(2, H))
        mask = moe_fused._ALL_ROWS_VALID[DEVICE]
        held.append((mask.data_ptr(), mask.numel()))
        assert bool(mask.all())
    assert held[0] == held[1] == held[2] == held[3] and held[0][1] == 8  # t = 5 made 8 rows; 3, 7 and 8 reuse them
    assert held[4][1] == 16  # 9 rows grow it once
    assert moe_fused.all_rows_valid(9, DEVICE).data_ptr() == held[4][0]


def test_fused_experts_refuses_bad_weights_by_name_and_value():
    gen = torch.Generator().manual_seed(3)
    w13, w2 = _weights(gen)
    x = _randn(4, H, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(4, E, gen=gen), 2, True)
    with pytest.raises(ValueError, match=r"w13 torch.float16, w2 torch.float32 must be torch.float32"):
        fused_experts(x, w13.half(), w2, topk_w, topk_ids)
    with pytest.raises(ValueError, match=r"must be contiguous, got strides w13 \(1920, 1, 48\)"):
        fused_experts(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, topk_w, topk_ids)


@pytest.mark.parametrize("t,e,h,k,renorm", [(1, 12, 40, 3, True), (5, 6, 64, 2, False), (8, 130, 72, 4, True)])
def test_fused_gate_matches_projection_then_topk(t, e, h, k, renorm):
    """One launch of gate projection + softmax top-k, twice on one counter (it must be left at zero)."""
    gen = torch.Generator().manual_seed(t * e)
    gate = _randn(e, h, gen=gen)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        x = _randn(t, h, gen=gen)
        w, ids = moe_gate_softmax_topk(x, gate, k, renorm, counter)
        w_ref, ids_ref = softmax_topk_reference(x @ gate.T, k, renorm)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
        assert int(counter) == 0


@pytest.mark.parametrize(
    "e,k,renorm,block_ep",
    [(128, 8, True, 2), (128, 8, False, 1), (60, 4, False, 1), (8, 2, True, 1), (64, 8, False, 4)],
)
def test_gate_rank_tail_matches_argmax_rounds_and_reference(e, k, renorm, block_ep):
    """The one-row ranking tail against the reference on distinct logits, then with ties (duplicated gate rows
    give equal logits) against the rounds of argmax: the lower expert index takes the earlier slot in both
    (torch.topk's order among ties is its own), with the reference's weights."""
    gen = torch.Generator().manual_seed(e + k)
    h = 48
    gate = _randn(e, h, gen=gen)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    x = _randn(1, h, gen=gen)
    w, ids = moe_gate_softmax_topk(x, gate, k, renorm, counter, block_ep=block_ep, rank_topk=True)
    w_ref, ids_ref = softmax_topk_reference(x @ gate.T, k, renorm)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    r = int(ids_ref[0, k - 2])  # a block of four equal logits from the (k-1)-th slot on: the last slots tie
    tied = {0, e // 2, e - 1, r}
    gate[sorted(tied - {r})] = gate[r].clone()
    w_ref, _ = softmax_topk_reference(x @ gate.T, k, renorm)
    got = [moe_gate_softmax_topk(x, gate, k, renorm, counter, block_ep=block_ep, rank_topk=r) for r in (True, False)]
    assert torch.equal(got[0][1], got[1][1])
    chosen = set(got[0][1][0].tolist())
    assert len(chosen) == k and len(chosen & tied) >= 2  # ties inside the top k
    for w, _ in got:
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    assert int(counter) == 0
    with pytest.raises(ValueError, match="rank_topk takes 1 row"):
        moe_gate_softmax_topk(x.repeat(2, 1), gate, k, renorm, counter, rank_topk=True)
    with pytest.raises(ValueError, match="block_ep=3 must be a power of two"):
        moe_gate_softmax_topk(x, gate, k, renorm, counter, block_ep=3)


@pytest.mark.parametrize(
    "t,e,h,k,renorm",
    [
        (1, 12, 40, 3, True),  # one column tile, H off the tile
        (5, 6, 64, 2, False),  # one tile, H on it
        (8, 130, 300, 4, True),  # several tiles, the last one partial; more experts than one program holds
        (8, 130, 512, 2, False),  # several whole tiles
    ],
)
def test_add_norm_gate_matches_norm_then_gate(t, e, h, k, renorm):
    """Residual add + RMSNorm + gate + softmax top-k in one launch against the unfused chain, twice on one
    counter; the normed hidden and new residual land in full (each program writes its share of columns)."""
    gen = torch.Generator().manual_seed(t * e + h)
    gate, norm_w = _randn(e, h, gen=gen, scale=0.2), 1 + _randn(h, gen=gen, scale=0.1)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        x, res = _randn(t, h, gen=gen, scale=3.0), _randn(t, h, gen=gen)
        got = moe_add_norm_gate_softmax_topk(x, res, norm_w, 1e-6, gate, k, renorm, counter)
        w_ref, ids_ref, normed_ref, summed_ref = moe_add_norm_gate_reference(x, res, norm_w, 1e-6, gate, k, renorm)
        assert torch.equal(got[1], ids_ref)
        torch.testing.assert_close(got[0], w_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[2], normed_ref, rtol=1e-5, atol=1e-6)
        assert torch.equal(got[3], summed_ref)
        assert int(counter) == 0
    with pytest.raises(ValueError, match="residual"):
        moe_add_norm_gate_softmax_topk(x, res[:, 1:], norm_w, 1e-6, gate, k, renorm, counter)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_layer_add_norm_gate_matches_norm_then_forward(rows):
    """FusedMoE.forward_add_norm_gate: one launch on the kernel path up to ADD_NORM_MAX_ROWS rows (above it the
    norm runs on its own and the gate stays fused), the norm module then the gate on the CPU path."""
    from graphserve.kernels.moe_gate import ADD_NORM_MAX_ROWS
    from graphserve.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(13)
    layer = FusedMoE(E, 2, H, INTER, SoftmaxTopK(E, 2, True), dtype=torch.float32).to(DEVICE)
    w13, w2 = _weights(gen)
    gate, norm = torch.nn.Linear(H, E, bias=False).to(DEVICE), RMSNorm(H, 1e-6).to(DEVICE)
    with torch.no_grad():
        layer.w13_weight.copy_(w13)
        layer.w2_weight.copy_(w2)
        gate.weight.copy_(_randn(E, H, gen=gen))
        norm.weight.copy_(1 + _randn(H, gen=gen, scale=0.1))
    x, res = _randn(rows, H, gen=gen), _randn(rows, H, gen=gen)
    valid = torch.tensor([True, False, True][:rows], device=DEVICE)
    layer.use_kernels = False
    want, want_hidden, want_res = layer.forward_add_norm_gate(x, res.clone(), norm, gate, valid=valid)
    want_counts = layer.expert_counts.clone()
    layer.use_kernels = True
    calls = []
    gate.register_forward_hook(lambda *_: calls.append(1))
    norm.register_forward_hook(lambda *_: calls.append(2))
    with torch.no_grad():
        got, hidden, new_res = layer.forward_add_norm_gate(x, res, norm, gate, valid=valid)
    # one fused launch (neither the norm module nor the projection ran), or the norm and then the fused gate
    assert calls == ([] if rows <= ADD_NORM_MAX_ROWS else [2])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-6)
    assert torch.equal(new_res, want_res) and torch.equal(new_res, x + res)
    assert torch.equal(layer.expert_counts, want_counts) and not layer.gate_counters.any()


def test_layer_fused_gate_matches_gate_then_forward():
    gen = torch.Generator().manual_seed(12)
    layer = FusedMoE(E, 2, H, INTER, SoftmaxTopK(E, 2, True), dtype=torch.float32).to(DEVICE)
    w13, w2 = _weights(gen)
    gate = torch.nn.Linear(H, E, bias=False).to(DEVICE)
    with torch.no_grad():
        layer.w13_weight.copy_(w13)
        layer.w2_weight.copy_(w2)
        gate.weight.copy_(_randn(E, H, gen=gen))
    x = _randn(3, H, gen=gen)
    layer.use_kernels = False
    want = layer(x, gate(x), valid=torch.tensor(2, device=DEVICE))
    want_counts = layer.expert_counts.clone()
    layer.use_kernels = True
    calls = []
    gate.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        got = layer.forward_gate(x, gate, valid=torch.tensor(2, device=DEVICE))
    assert not calls  # the fused kernel ran, not the projection
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(layer.expert_counts, want_counts) and not layer.gate_counters.any()


def test_layer_kernel_path_matches_cpu_path():
    gen = torch.Generator().manual_seed(11)
    layer = FusedMoE(E, 2, H, INTER, SoftmaxTopK(E, 2, False), dtype=torch.float32).to(DEVICE)
    w13, w2 = _weights(gen)
    with torch.no_grad():
        layer.w13_weight.copy_(w13)
        layer.w2_weight.copy_(w2)
    x, logits = _randn(6, H, gen=gen), _randn(6, E, gen=gen)
    layer.use_kernels = False
    want = layer(x, logits, valid=torch.tensor(4, device=DEVICE))
    want_counts = layer.expert_counts.clone()
    layer.use_kernels = True
    got = layer(x, logits, valid=torch.tensor(4, device=DEVICE))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(layer.expert_counts, want_counts) and int(want_counts.sum()) == 8


def test_tuner_sweep_writes_a_table_the_kernels_accept(monkeypatch):
    """The tuner's control flow on the interpreter (wall-clock timing, two tiles of each kind)."""
    import json
    import time

    from benchmarks import moe_tune
    from graphserve.kernels.moe_config import MoeTiles

    def wall_ms(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    small = [GemmTile(16, 16, 32, 1, 4, 3), GemmTile(32, 32, 16, 1, 4, 3)]
    monkeypatch.setattr(moe_tune, "DEVICE", DEVICE)
    monkeypatch.setattr(moe_tune, "graph_ms", wall_ms)
    monkeypatch.setattr(moe_tune, "QUICK_TOKENS", [1, 4])
    monkeypatch.setattr(moe_tune, "GEMV_TILES", list(GEMV))
    monkeypatch.setattr(moe_tune, "gemm_candidates", lambda per_expert, gated, quick, **space: small)
    monkeypatch.setattr(moe_tune._Bucket, "ms", before_never_kept(moe_tune._Bucket.ms))
    tiles, rows = moe_tune.tune(E, H, INTER, 2, torch.float32, quick=True, budget_s=600)
    assert tiles.buckets == (2, 8) and [r["tokens"] for r in rows] == [1, 4]
    assert all(g.block_m == d.block_m for g, d in zip(tiles.gate_up, tiles.down))
    assert tiles.small_max_pairs in (0, 2, 8) and tiles.gemv_gate_up in GEMV
    for r in rows:  # each bucket against what ran before (the defaults: the interpreter has no table)
        assert 0 < r["before_us"] < float("inf")
        assert r["tuned_us"] == (r["gemv_us"] if r["pairs"] <= tiles.small_max_pairs else r["gemm_us"])
    again = MoeTiles.from_json(json.loads(json.dumps(tiles.to_json())))
    assert again == tiles
    gen = torch.Generator().manual_seed(3)
    w13, w2 = _weights(gen)
    x = _randn(5, H, gen=gen)
    topk_w, topk_ids = softmax_topk_reference(_randn(5, E, gen=gen), 2, True)
    out = fused_experts(x, w13, w2, topk_w, topk_ids, tiles=again)
    torch.testing.assert_close(out, experts_reference(x, w13, w2, topk_w, topk_ids), rtol=1e-4, atol=1e-5)


def test_tuner_keeps_a_buckets_tiles_where_what_ran_before_timed_faster(monkeypatch):
    """A bucket whose grouped GEMM, as the engine ran it before the sweep (the table read at start), times faster
    than every tile the sweep timed keeps that table's tiles; the other buckets take the sweep's. Timings are
    made up (the run before at 1.0 ms in bucket 8 only, every sweep candidate at 2.0), so which wins is fixed."""
    from benchmarks import moe_tune
    from graphserve.kernels.moe_config import MoeTiles

    swept = GemmTile(16, 16, 32, 1, 4, 3)
    old_tile = GemmTile(32, 32, 16, 1, 4, 3)
    old = MoeTiles(0, None, None, (2, 8), (old_tile, old_tile), (old_tile, old_tile))
    monkeypatch.setattr(moe_tune, "DEVICE", DEVICE)
    monkeypatch.setattr(moe_tune, "moe_tiles", lambda *args: old)
    monkeypatch.setattr(moe_tune, "GEMV_TILES", list(GEMV))
    monkeypatch.setattr(moe_tune, "gemm_candidates", lambda per_expert, gated, quick, **space: [swept])
    def fake_ms(self, **overrides) -> float:
        return 2.0 if overrides else (1.0 if self.ids.numel() == 8 else 3.0)

    monkeypatch.setattr(moe_tune._Bucket, "ms", fake_ms)
    tiles, rows = moe_tune.tune(E, H, INTER, 2, torch.float32, quick=True, budget_s=600, tokens=[1, 4])
    assert tiles.buckets == (2, 8) and tiles.small_max_pairs == 0  # the streaming path (2.0) never beat 2.0
    assert (tiles.gate_up, tiles.down) == ((swept, old_tile), (swept, old_tile))
    assert [(r["gemm_from"], r["gemm_us"], r["before_us"]) for r in rows] == [("this run", 2e3, 3e3), ("before", 1e3, 1e3)]
    assert [r["tuned_vs_before"] for r in rows] == [2 / 3, 1.0]


@pytest.mark.parametrize("argv,message", [
    (["--experts", "0", "--hidden", "64", "--intermediate", "32"], "--experts 0 is invalid: must be >= 1"),
    (["--model", "dummy:qwen3-30b-a3b", "--tp-size", "0"], "--tp-size 0 is invalid: must be >= 1"),
    (["--model", "dummy:qwen3-30b-a3b", "--budget-s", "0"], "--budget-s 0.0 is invalid: must be > 0"),
    (["--experts", "4", "--hidden", "64", "--intermediate", "32", "--top-k", "8"], "--top-k 8 exceeds --experts 4"),
])  # fmt: skip
def test_tuner_refuses_sizes_it_cannot_tune_naming_them(argv, message, monkeypatch, capsys):
    """Refused before any GPU work, each message naming the flag, its value and the limit."""
    from benchmarks import moe_tune

    monkeypatch.setattr("sys.argv", ["moe_tune", *argv])
    with pytest.raises(SystemExit):
        moe_tune.main()
    assert message in capsys.readouterr().err
