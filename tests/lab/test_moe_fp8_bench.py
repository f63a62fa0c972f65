"""benchmarks.common.merge_rows: benchmarks.moe_fp8 and benchmarks.fp8 add their rows to fp8_decode.json without dropping each other's."""

from __future__ import annotations

import json

from benchmarks import common


def test_moe_rows_replace_their_earlier_rows_and_keep_the_dense_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    label = "dummy:qwen3-30b-a3b --quantization fp8 (uniform routing)"
    dense = {"model": "dummy:llama3-8b --quantization fp8", "bs": 1, "ctx": 512, "step_ms": 3.0}
    (tmp_path / "fp8_decode.json").write_text(json.dumps({
        "environment": {"commit": "old"}, "prefill": [{"model": "dummy:llama3-8b"}],
        "rows": [dense, {"model": label, "bs": 64, "ctx": 1024, "step_ms": 99.0}]}))
    new = {"model": label, "bs": 64, "ctx": 1024, "step_ms": 7.0, "floor_ms": 6.0, "ratio": 7 / 6, "bf16_step_ms": 12.0}
    common.merge_rows("fp8_decode", [new])
    merged = json.loads((tmp_path / "fp8_decode.json").read_text())
    assert [{k: v for k, v in r.items() if k != "measured_at"} for r in merged["rows"]] == [dense, new]
    assert merged["prefill"] == [{"model": "dummy:llama3-8b"}] and merged["environment"]["commit"] != "old"
    # each row names the run that measured it: the dense row its old file's, ours this run's
    assert merged["rows"][0]["measured_at"] == {"commit": "old"}
    assert merged["rows"][1]["measured_at"] == merged["environment"]
    common.merge_rows("fp8_decode", [new])  # a second merge keeps the dense row's provenance
    again = json.loads((tmp_path / "fp8_decode.json").read_text())
    assert again["rows"][0]["measured_at"] == {"commit": "old"}


def test_the_dense_run_keeps_the_moe_rows_and_replaces_its_own_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    moe = {"model": "dummy:qwen3-30b-a3b --quantization fp8 (uniform routing)", "bs": 64, "step_ms": 7.0}
    old_dense = {"model": "dummy:llama3-8b --quantization fp8", "bs": 1, "step_ms": 3.0}
    (tmp_path / "fp8_decode.json").write_text(json.dumps({
        "environment": {"commit": "moe-run"}, "prefill": [{"old": True}], "rows": [old_dense, moe]}))
    dense = [{"model": "dummy:llama3-8b --quantization fp8", "bs": b, "step_ms": 2.0 + b} for b in (1, 256)]
    common.merge_rows("fp8_decode", dense, prefill=[{"model": "dummy:llama3-8b"}])
    merged = json.loads((tmp_path / "fp8_decode.json").read_text())
    assert [(r["model"], r["bs"]) for r in merged["rows"]] == [(moe["model"], 64)] + [(dense[0]["model"], b)
                                                                                      for b in (1, 256)]
    assert merged["rows"][0]["measured_at"] == {"commit": "moe-run"}
    assert merged["prefill"] == [{"model": "dummy:llama3-8b", "measured_at": merged["environment"]}]


def test_a_run_of_fewer_batches_keeps_the_models_other_batches(tmp_path, monkeypatch):
    """A --quick run measures batches 1 and 64 of a model whose batch-256 row an earlier full run wrote: that row
    stays, naming its run; the measured cases are replaced, once each."""
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    model = "dummy:qwen3-30b-a3b --quantization fp8"
    old = [{"model": model, "bs": b, "ctx": c, "step_ms": 1.0} for b, c in ((1, 512), (64, 2048), (256, 2048))]
    (tmp_path / "fp8_decode.json").write_text(json.dumps({"environment": {"commit": "full"}, "rows": old}))
    quick = [{"model": model, "bs": b, "ctx": c, "step_ms": 2.0} for b, c in ((1, 512), (64, 2048))]
    common.merge_rows("fp8_decode", quick)
    rows = json.loads((tmp_path / "fp8_decode.json").read_text())["rows"]
    assert [(r["bs"], r["step_ms"], r["measured_at"].get("commit")) for r in rows] == [
        (256, 1.0, "full"), (1, 2.0, rows[1]["measured_at"]["commit"]), (64, 2.0, rows[1]["measured_at"]["commit"])]
    assert rows[1]["measured_at"]["commit"] != "full"


def test_per_model_tables_keep_the_other_models_entries(tmp_path, monkeypatch):
    """A run of one model (benchmarks.fp8 --models dummy:mixtral-8x7b) replaces that model's accuracy rows and
    keeps the others' with their run; its empty prefill table (a MoE model runs none) keeps the dense model's;
    a table that is not per model (the GEMM rows) is replaced."""
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    llama = {"model": "dummy:llama3-8b --quantization fp8", "top1_agreement": 0.1}
    old_mixtral = {"model": "dummy:mixtral-8x7b --quantization fp8", "top1_agreement": 0.5}
    (tmp_path / "fp8_decode.json").write_text(json.dumps({
        "environment": {"commit": "dense-run"}, "rows": [], "prefill": [{"model": "dummy:llama3-8b", "ratio": 0.7}],
        "accuracy": [llama, old_mixtral], "small_batch": [{"shape": "qkv", "m": 1}]}))
    mixtral = {"model": "dummy:mixtral-8x7b --quantization fp8", "top1_agreement": 0.003}
    common.merge_rows("fp8_decode", [{"model": mixtral["model"], "bs": 1}], prefill=[], accuracy=[mixtral],
                      small_batch=[{"shape": "o_proj", "m": 1}])  # fmt: skip
    merged = json.loads((tmp_path / "fp8_decode.json").read_text())
    assert merged["accuracy"] == [{**llama, "measured_at": {"commit": "dense-run"}},
                                  {**mixtral, "measured_at": merged["environment"]}]
    assert merged["prefill"] == [{"model": "dummy:llama3-8b", "ratio": 0.7, "measured_at": {"commit": "dense-run"}}]
    assert merged["small_batch"] == [{"shape": "o_proj", "m": 1}]


def test_experts_touched_counts_routed_pairs_and_is_none_for_a_dense_model():
    """benchmarks.moe.experts_touched: the experts with a token in the last step, per MoE layer (rows record their
    sum); a dense model has no such layers, and its None is what decode_read_bytes takes as nothing routed to
    count."""
    from types import SimpleNamespace

    import torch

    from benchmarks.moe import experts_touched, touched_total

    layers = [SimpleNamespace(expert_counts=torch.tensor([0, 3, 1, 0])), SimpleNamespace(expert_counts=torch.tensor([2, 0]))]
    assert experts_touched(layers) == [2, 1]
    assert touched_total(experts_touched(layers)) == 3
    assert experts_touched([]) is None and touched_total(None) is None


def test_step_cost_prices_each_layers_experts_as_the_layer_holds_them():
    """A MoE description whose second layer's experts an ignore list keeps in bf16: step_cost takes the per-layer
    counts benchmarks.moe.experts_touched gives and prices that layer's experts at 2 bytes a weight, unscaled."""
    from types import SimpleNamespace

    import torch

    from benchmarks.decode import step_cost
    from graphserve.layers.kv_layout import KVLayout
    from graphserve.models.description import ModelDescription

    kv = KVLayout("kv", num_layers=2, num_heads=1, head_dim=8, dtype=torch.bfloat16)
    desc = ModelDescription(kv=kv, hidden_size=16, vocab_size=32, weight_bytes_per_param=1, dense_params=0,
                            embed_params=512, lm_head_params=0, expert_params=768, local_experts=4, num_experts=4,
                            top_k=2, num_moe_layers=2, embed_bytes_per_param=2, expert_bytes_per_param=1,
                            expert_scale_bytes=12, expert_layers=("model.layers.0.mlp.experts",
                                                                  "model.layers.1.mlp.experts"),
                            kept_expert_layers=("model.layers.1.mlp.experts",))  # fmt: skip
    info = SimpleNamespace(description=desc, num_layers=2, num_heads=1, head_dim=8)
    base = step_cost(info, 1, 4, [0, 0])[0]
    assert step_cost(info, 1, 4, [3, 0])[0] - base == 3 * (768 + 12)
    assert step_cost(info, 1, 4, [0, 3])[0] - base == 3 * 768 * 2
