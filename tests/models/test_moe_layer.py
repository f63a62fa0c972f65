"""FusedMoE's CPU path against transformers' own sparse MoE blocks, fp32, fresh random weights.

Each family's block is built from its config class, its weights are copied into FusedMoE through
load_expert_weight (the path a checkpoint takes), and the outputs must agree within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphserve.engine.expert_load import ExpertLoad, ExpertLoadProbe
from graphserve.errors import ModelLoadError
from graphserve.kernels.moe_reference import (
    expert_counts_reference,
    experts_loop_reference,
    experts_reference,
    grouped_sigmoid_topk_reference,
    moe_align_reference,
    softmax_topk_reference,
)
from graphserve.layers.moe import FusedMoE, GroupedSigmoidTopK, SoftmaxTopK, make_router

H, INTER, E = 32, 24, 8


def _hf_block(family: str, top_k: int, norm_topk_prob: bool):
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe import modeling_qwen3_moe as m

        cfg = m.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=top_k,
                               norm_topk_prob=norm_topk_prob)  # fmt: skip
        return m.Qwen3MoeSparseMoeBlock(cfg)
    if family == "mixtral":
        from transformers.models.mixtral import modeling_mixtral as m

        cfg = m.MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=top_k)
        return m.MixtralSparseMoeBlock(cfg)
    if family == "olmoe":
        from transformers.models.olmoe import modeling_olmoe as m

        cfg = m.OlmoeConfig(hidden_size=H, intermediate_size=INTER, num_experts=E, num_experts_per_tok=top_k,
                            norm_topk_prob=norm_topk_prob)  # fmt: skip
        return m.OlmoeSparseMoeBlock(cfg)
    from transformers.models.qwen2_moe import modeling_qwen2_moe as m

    cfg = m.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=top_k,
                           norm_topk_prob=norm_topk_prob, shared_expert_intermediate_size=40)  # fmt: skip
    return m.Qwen2MoeSparseMoeBlock(cfg)


def _randomise(block: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _layer_from(block, top_k: int, renormalize: bool, **kw) -> FusedMoE:
    layer = FusedMoE(E, top_k, H, INTER, SoftmaxTopK(E, top_k, renormalize), dtype=torch.float32, **kw)
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    for e in range(E):
        layer.load_expert_weight("w1", e, gate_up[e, :INTER])
        layer.load_expert_weight("w3", e, gate_up[e, INTER:])
        layer.load_expert_weight("w2", e, down[e])
    return layer


CASES = [("qwen3_moe", 2, True), ("qwen3_moe", 3, False), ("mixtral", 2, True), ("olmoe", 4, False),
         ("olmoe", 2, True), ("qwen2_moe", 4, False), ("qwen2_moe", 2, True)]  # fmt: skip


@pytest.mark.parametrize("family,top_k,norm", CASES)
def test_matches_transformers_block(family, top_k, norm):
    gen = torch.Generator().manual_seed(CASES.index((family, top_k, norm)))
    block = _hf_block(family, top_k, norm).eval()
    _randomise(block, gen)
    x = torch.randn(11, H, generator=gen)
    with torch.no_grad():
        want = block(x[None])[0]
        layer = _layer_from(block, top_k, renormalize=norm or family == "mixtral")
        got = layer(x, F.linear(x, block.gate.weight))
        if family == "qwen2_moe":  # the model owns the shared expert and its sigmoid gate
            got = got + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ids = softmax_topk_reference(F.linear(x, block.gate.weight), top_k, False)[1]
    assert torch.equal(layer.expert_counts, torch.bincount(ids.flatten().long(), minlength=E).int())


def _random_layer(gen, top_k=3, **kw) -> FusedMoE:
    layer = FusedMoE(E, top_k, H, INTER, SoftmaxTopK(E, top_k, True), dtype=torch.float32, **kw)
    with torch.no_grad():
        layer.w13_weight.copy_(torch.randn(layer.w13_weight.shape, generator=gen) * 0.3)
        layer.w2_weight.copy_(torch.randn(layer.w2_weight.shape, generator=gen) * 0.3)
    return layer


def test_reference_matches_loop_and_padding_rows_cost_nothing():
    gen = torch.Generator().manual_seed(1)
    layer = _random_layer(gen)
    x, logits = torch.randn(9, H, generator=gen), torch.randn(9, E, generator=gen)
    w, ids = softmax_topk_reference(logits, 3, True)
    loop = experts_loop_reference(x, layer.w13_weight, layer.w2_weight, w, ids)
    torch.testing.assert_close(layer(x, logits), loop, rtol=1e-5, atol=1e-5)
    # rows 6.. are padding: they route nowhere, are not counted, and come out as zeros
    for valid in (torch.tensor(6), torch.arange(9) < 6):
        out = layer(x, logits, valid=valid)
        torch.testing.assert_close(out[:6], loop[:6], rtol=1e-5, atol=1e-5)
        assert torch.equal(out[6:], torch.zeros(3, H))
        assert int(layer.expert_counts.sum()) == 6 * 3
        assert torch.equal(layer.expert_counts, expert_counts_reference(ids, torch.arange(9) < 6, E))
        # what the engine's per-step telemetry reads from these counts (engine/expert_load.py)
        load = ExpertLoad.from_counts(layer.expert_counts[None].numpy())
        assert load.experts_touched == len(set(ids[:6].flatten().tolist()))
        assert load.max_expert_load == max(ids[:6].flatten().tolist().count(e) for e in range(E))


def test_expert_load_probe_reads_every_layer_from_one_tensor():
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.ModuleList([_random_layer(gen, top_k=2), _random_layer(gen, top_k=3)])
    probe = ExpertLoadProbe(model, torch.device("cpu"))
    again = ExpertLoadProbe(model, torch.device("cpu"))  # a second runner on the same model keeps the tensor
    assert again.counts is probe.counts
    x, logits = torch.randn(7, H, generator=gen), torch.randn(7, E, generator=gen)
    for layer in model:
        layer(x, logits, valid=torch.tensor(5))
    expected = torch.stack([expert_counts_reference(softmax_topk_reference(logits, k, True)[1], torch.arange(7) < 5, E)
                            for k in (2, 3)])
    assert torch.equal(again.snapshot(), expected)
    assert ExpertLoadProbe.read(probe.snapshot()).layer_routed_pairs == [5 * 2, 5 * 3]


def test_tensor_and_expert_parallel_shards_sum_to_the_whole():
    gen = torch.Generator().manual_seed(2)
    full = _random_layer(gen)
    w1, w3 = full.w13_weight[:, :INTER], full.w13_weight[:, INTER:]
    x, logits = torch.randn(7, H, generator=gen), torch.randn(7, E, generator=gen)
    want = full(x, logits)
    for kw in ({"tp_size": 2}, {"tp_size": 3}, {"ep_size": 2}, {"ep_size": 4}, {"tp_size": 2, "ep_size": 2}):
        total = torch.zeros(7, H)
        tp, ep = kw.get("tp_size", 1), kw.get("ep_size", 1)
        for r in range(tp * ep):
            part = FusedMoE(E, 3, H, INTER, SoftmaxTopK(E, 3, True), dtype=torch.float32,
                            tp_rank=r % tp, ep_rank=r // tp, **kw)  # fmt: skip
            for e in range(E):
                part.load_expert_weight("w1", e, w1[e])
                part.load_expert_weight("w3", e, w3[e])
                part.load_expert_weight("w2", e, full.w2_weight[e])
            total += part(x, logits)
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5, msg=str(kw))


def test_uniform_routing_is_round_robin():
    gen = torch.Generator().manual_seed(3)
    layer = _random_layer(gen)
    layer.routing_override = "uniform"
    x, logits = torch.randn(8, H, generator=gen), torch.randn(8, E, generator=gen)
    ids = (torch.arange(24) % E).view(8, 3).int()
    want = experts_loop_reference(x, layer.w13_weight, layer.w2_weight, torch.full((8, 3), 1 / 3), ids)
    torch.testing.assert_close(layer(x, logits), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.expert_counts, torch.full((E,), 3, dtype=torch.int32))
    layer.routing_override = "skewed"
    with pytest.raises(ValueError, match="routing_override='skewed'"):
        layer(x, logits)


def test_grouped_sigmoid_routing():
    gen = torch.Generator().manual_seed(4)
    logits, bias = torch.randn(5, 16, generator=gen), torch.randn(16, generator=gen)
    w, ids = grouped_sigmoid_topk_reference(logits, 4, bias, n_group=4, topk_group=2, renormalize=True,
                                            routed_scaling_factor=2.5)  # fmt: skip
    scores = torch.sigmoid(logits)
    for t in range(5):
        biased = scores[t] + bias
        merit = [sorted(biased[g * 4 : g * 4 + 4].tolist())[-2:] for g in range(4)]
        groups = sorted(range(4), key=lambda g: -sum(merit[g]))[:2]
        allowed = [e for g in groups for e in range(g * 4, g * 4 + 4)]
        chosen = sorted(allowed, key=lambda e: -biased[e].item())[:4]
        assert ids[t].tolist() == chosen
        picked = scores[t, chosen]
        torch.testing.assert_close(w[t], picked / picked.sum() * 2.5)
    router = make_router("sigmoid", 16, 4, n_group=4, topk_group=2, renormalize=True, routed_scaling_factor=2.5)
    assert isinstance(router, GroupedSigmoidTopK)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(bias)
    assert torch.equal(router(logits)[1], ids)


def test_bad_configs_and_weights_are_refused_by_name():
    with pytest.raises(ModelLoadError, match="scoring_func='xyz'"):
        make_router("xyz", 8, 2)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok=9"):
        SoftmaxTopK(8, 9, True)
    with pytest.raises(ModelLoadError, match="n_group=3"):
        make_router("sigmoid", 16, 4, n_group=3, topk_group=2, renormalize=True, routed_scaling_factor=1.0)
    with pytest.raises(ModelLoadError, match="hidden_act='gelu'"):
        FusedMoE(E, 2, H, INTER, SoftmaxTopK(E, 2, True), activation="gelu")
    with pytest.raises(ModelLoadError, match="tp_size=5"):
        FusedMoE(E, 2, H, INTER, SoftmaxTopK(E, 2, True), tp_size=5)
    layer = FusedMoE(E, 2, H, INTER, SoftmaxTopK(E, 2, True))
    with pytest.raises(ModelLoadError, match=r"checkpoint shape \(32, 24\) does not match the config's \(24, 32\)"):
        layer.load_expert_weight("w1", 0, torch.zeros(H, INTER))
    with pytest.raises(ModelLoadError, match="expert index 8"):
        layer.load_expert_weight("w2", 8, torch.zeros(H, INTER))
    with pytest.raises(ModelLoadError, match="'w4'"):
        layer.load_expert_weight("w4", 0, torch.zeros(INTER, H))


def test_align_reference_groups_pairs_by_expert():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, E, (13, 3), generator=gen, dtype=torch.int32)
    valid = torch.arange(13) < 11
    sorted_ids, expert_ids, padded = moe_align_reference(ids, valid, expert_start=2, num_local=4, block_m=4)
    assert sorted_ids.numel() >= 13 * 3 + 4 * 3 and padded % 4 == 0
    seen = []
    for b in range(padded // 4):
        block = sorted_ids[b * 4 : b * 4 + 4]
        real = block[block < 39]
        assert real.numel() > 0 and all(ids.flatten()[p] - 2 == expert_ids[b] for p in real)
        seen += real.tolist()
    want = [p for p in range(39) if valid[p // 3] and 2 <= ids.flatten()[p] < 6]
    assert sorted(seen) == want and bool((expert_ids[padded // 4 :] == -1).all())
    # the vectorised reference and the loop agree under fp32 on the same routing
    x = torch.randn(13, H, generator=gen)
    layer = _random_layer(gen)
    w = torch.rand(13, 3, generator=gen)
    torch.testing.assert_close(
        experts_reference(x, layer.w13_weight, layer.w2_weight, w, ids, pairs_per_chunk=5),
        experts_loop_reference(x, layer.w13_weight, layer.w2_weight, w, ids), rtol=1e-5, atol=1e-5,
    )  # fmt: skip


def test_tile_tables_load_by_shape_and_fall_back_with_the_tuning_command(monkeypatch, tmp_path, caplog):
    import json
    import logging

    from graphserve.kernels import moe_config, tables

    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tables, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setenv("GRAPHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    tables.clear()
    moe_config._load.cache_clear()
    with caplog.at_level(logging.INFO, logger="graphserve.kernels.moe_config"):
        tiles = moe_config._load(128, 768, 2048, torch.bfloat16, "NVIDIA_H200")
    assert tiles == moe_config.default_tiles(128)
    assert "graphserve tune --tables moe --experts 128 --intermediate 768 --hidden 2048 --dtype bfloat16" in caplog.text
    tuned = moe_config.MoeTiles(
        small_max_pairs=16,
        gemv_gate_up=moe_config.GemvTile(32, 256, 4),
        gemv_down=moe_config.GemvTile(16, 512, 8),
        buckets=(8, 512),
        gate_up=(moe_config.GemmTile(16, 64, 128, 1, 4, 3), moe_config.GemmTile(64, 128, 64, 8, 8, 4)),
        down=(moe_config.GemmTile(16, 128, 128, 1, 4, 4), moe_config.GemmTile(64, 64, 64, 8, 4, 3)),
    )
    path = moe_config.table_path(128, 768, 2048, torch.bfloat16, "NVIDIA_H200")
    assert path.name == "E=128,I=768,H=2048,dtype=bfloat16,device=NVIDIA_H200.json"
    path.write_text(json.dumps({"experts": 128, "device": "NVIDIA_H200", **tuned.to_json()}))
    tables.clear()
    moe_config._load.cache_clear()
    loaded = moe_config._load(128, 768, 2048, torch.bfloat16, "NVIDIA_H200")
    moe_config._load.cache_clear()
    tables.clear()
    assert loaded == tuned
    assert loaded.gemm_tiles(8) == (tuned.gate_up[0], tuned.down[0])
    assert loaded.gemm_tiles(9) == (tuned.gate_up[1], tuned.down[1])
    assert loaded.gemm_tiles(100000) == (tuned.gate_up[1], tuned.down[1])


def test_workspace_bytes_grows_with_the_batch_and_counts_every_buffer():
    layer = FusedMoE(128, 8, 2048, 768, SoftmaxTopK(128, 8, True), dtype=torch.bfloat16, device="meta")
    one, many = layer.workspace_bytes(1), layer.workspace_bytes(256)
    pairs = 256 * 8
    # at least the activation, the per-pair output, the result and the router's output
    assert many >= 2 * (pairs * 768 + pairs * 2048 + 256 * 2048) + 8 * pairs
    assert one < many
