"""The experts' L2 prefetch from the router's gate launch (kernels/l2_prefetch.py): its setting, its plan and the
rule for which calls ask; the requests themselves are PTX, checked on the GPU (tests/gpu/test_moe.py)."""

from __future__ import annotations

import pytest
import torch

from graphserve.kernels import l2_prefetch as l2_prefetch_module
from graphserve.kernels.l2_prefetch import (
    DEFAULT_MB,
    LINE,
    LINKS,
    MAX_MB,
    MIN_PIECE,
    budget_bytes,
    l2_prefetch,
    plan,
    worth_prefetching,
)
from graphserve.layers.moe import FusedMoE, SoftmaxTopK


@pytest.fixture
def capable(monkeypatch):
    """plan() as on a Hopper GPU, for a CPU tensor."""
    monkeypatch.setattr(l2_prefetch_module, "_capable", lambda device: True)


def test_scopes_set_budgets_innermost_first():
    outside = {link: budget_bytes(link) for link in LINKS}
    with l2_prefetch(16):
        assert all(budget_bytes(link) == 16 << 20 for link in LINKS)
        with l2_prefetch(slot_sum=2.5):
            assert budget_bytes("slot_sum") == int(2.5 * 2**20)
            assert budget_bytes("gate") == 16 << 20  # kept from the scope outside
        with l2_prefetch(0, gate=3):
            assert (budget_bytes("gate"), budget_bytes("slot_sum")) == (3 << 20, 0)
        assert budget_bytes("slot_sum") == 16 << 20
    assert {link: budget_bytes(link) for link in LINKS} == outside


def test_the_defaults_are_the_measured_budgets(monkeypatch):
    monkeypatch.delenv(l2_prefetch_module.ENV, raising=False)
    l2_prefetch_module.env_budgets.cache_clear()
    try:
        assert {link: budget_bytes(link) for link in LINKS} == {
            link: int(mb * 2**20) for link, mb in DEFAULT_MB.items()}
        assert set(DEFAULT_MB) == set(LINKS)
    finally:
        l2_prefetch_module.env_budgets.cache_clear()


@pytest.mark.parametrize("mb", [-1, MAX_MB + 1, "lots"])
def test_a_budget_out_of_range_is_refused_by_name(mb):
    with pytest.raises(ValueError, match=rf"l2_prefetch\(gate\)={str(mb)!r}.*0\.\.{MAX_MB:g}"):
        with l2_prefetch(mb):
            pass


def test_an_unknown_link_is_refused_by_name():
    with pytest.raises(ValueError, match=r"qkv is not a link; links: \('gate', 'slot_sum'\)"):
        with l2_prefetch(qkv=4):
            pass
    with pytest.raises(ValueError, match=r"link='qkv' must be one of"):
        budget_bytes("qkv")


def test_the_environment_sets_every_link_and_is_checked(monkeypatch):
    l2_prefetch_module.env_budgets.cache_clear()
    try:
        monkeypatch.setenv(l2_prefetch_module.ENV, "12")
        assert all(budget_bytes(link) == 12 << 20 for link in LINKS)
        l2_prefetch_module.env_budgets.cache_clear()
        monkeypatch.setenv(l2_prefetch_module.ENV, "100")
        with pytest.raises(ValueError, match=rf"{l2_prefetch_module.ENV}='100'"):
            budget_bytes("gate")
    finally:
        l2_prefetch_module.env_budgets.cache_clear()


@pytest.mark.parametrize("mb,programs,threads,numel", [(32, 128, 128, 128 * 1536 * 2048), (48, 128, 256, 10**8),
                                                        (16, 7, 96, 5 * 2**20 + 48), (1, 128, 128, 3000)])
def test_a_plan_asks_whole_lines_within_budget_weight_and_grid(capable, mb, programs, threads, numel):
    weight = torch.empty(numel, dtype=torch.uint8)
    with l2_prefetch(mb):
        p = plan(weight, programs, threads, "gate")
    if numel < MIN_PIECE:
        assert p is None
        return
    assert p is not None
    assert p.piece % LINE == 0 and p.piece >= MIN_PIECE
    assert 0 < p.nbytes <= min(mb << 20, numel) and p.nbytes % p.piece == 0
    # one request a thread: the grid's requests cover what the plan asks for
    assert programs * threads * p.piece >= p.nbytes
    # and nothing is left out that a whole piece could still ask for
    assert p.nbytes + p.piece > min(mb << 20, numel)
    assert p.kernel_args() == {"pf_ptr": weight, "pf_bytes": p.nbytes, "pf_piece": p.piece, "PREFETCH": True}


def test_nothing_is_asked_without_budget_weight_or_device(capable):
    weight = torch.empty(2**24, dtype=torch.uint8)
    with l2_prefetch(0):
        assert plan(weight, 128, 128, "gate") is None
    with l2_prefetch(8, slot_sum=0):
        assert plan(weight, 128, 128, "slot_sum") is None
        assert plan(weight, 128, 128, "gate").nbytes == 8 << 20
        assert plan(None, 128, 128, "gate") is None
        assert plan(weight, 0, 128, "gate") is None
        with pytest.raises(ValueError, match="contiguous and 16-byte aligned"):
            plan(torch.empty(1024, 1024, dtype=torch.uint8).t(), 128, 128, "gate")


def test_a_cpu_or_interpreted_launch_asks_nothing():
    with l2_prefetch(8):
        assert plan(torch.empty(2**20, dtype=torch.uint8), 128, 128, "gate") is None


@pytest.mark.parametrize("tokens,top_k,experts,want", [
    (64, 8, 128, True),    # qwen3-30b-a3b at batch 64: each expert touched with probability 0.98
    (32, 8, 128, False),   # 0.87
    (36, 8, 128, True),    # 0.90
    (9, 2, 8, True),       # mixtral: 0.92
    (16, 8, 256, False),   # deepseek-v3 at 16 tokens: 0.40
])
def test_which_calls_ask(tokens, top_k, experts, want):
    assert worth_prefetching(tokens, top_k, experts) is want


def test_the_layer_asks_for_its_w13_only_where_the_grouped_gemm_runs_on_most_experts(monkeypatch):
    from graphserve.kernels import moe_fused

    layer = FusedMoE(128, 8, 64, 32, SoftmaxTopK(128, 8, True), dtype=torch.bfloat16)
    runs_gemm = {}
    monkeypatch.setattr(moe_fused, "runs_grouped_gemm", lambda t, k, w13, w2: runs_gemm[t])
    runs_gemm.update({64: True, 32: True, 8: False})
    assert layer._prefetch_target(torch.empty(64, 64)) is layer.w13_weight
    assert layer._prefetch_target(torch.empty(32, 64)) is None  # the gemm, but too few experts touched
    assert layer._prefetch_target(torch.empty(8, 64)) is None   # the streaming path reads only routed experts
    runs_gemm[64] = False  # asked once a row count: the answer is kept
    assert layer._prefetch_target(torch.empty(64, 64)) is layer.w13_weight


def test_runs_grouped_gemm_follows_the_table():
    from graphserve.kernels.moe_config import moe_tiles
    from graphserve.kernels.moe_fused import runs_grouped_gemm

    w13, w2 = torch.empty(128, 64, 64, dtype=torch.bfloat16), torch.empty(128, 64, 32, dtype=torch.bfloat16)
    small = moe_tiles(128, 32, 64, torch.bfloat16, w13.device).small_max_pairs
    assert not runs_grouped_gemm(small // 8, 8, w13, w2)
    assert runs_grouped_gemm(small // 8 + 1, 8, w13, w2)


