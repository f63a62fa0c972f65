"""Measuring the MoE presets' projections (benchmarks.gemv --models) adds their shapes to the gemv
results and rule without dropping the shapes an earlier run measured on the same card."""

from __future__ import annotations

from benchmarks.gemv import MODEL_SHAPES, SHAPES, merge_with_earlier, rule_from_results
from graphserve.kernels.gemv_config import GemvRule


def _run(device: str, commit: str, shapes: dict[str, float]) -> dict:
    rows = [{"shape": name, "M": m, "N": SHAPES[name][0], "K": SHAPES[name][1], "gemv/cublas": ratio}
            for name, ratio in shapes.items() for m in (1, 2)]  # fmt: skip
    return {"environment": {"device": device, "date": "d", "commit": commit}, "rows": rows, "fused": []}


def test_moe_presets_name_shapes_the_benchmark_measures():
    for model in ("dummy:qwen3-30b-a3b", "dummy:mixtral-8x7b", "dummy:gpt-oss-20b", "dummy:gpt-oss-120b"):
        assert MODEL_SHAPES[model] and all(name in SHAPES for name in MODEL_SHAPES[model])
    assert SHAPES["qwen3-30b-a3b qkv"] == ((32 + 2 * 4) * 128, 2048)
    # gpt-oss's bf16 projections as its preset builds them: q/k/v fused, o_proj, the router, the head
    from graphserve.models.presets import PRESETS

    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        cfg = PRESETS[name]["config"]
        heads, kv, dim, hidden = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                                  cfg["hidden_size"])  # fmt: skip
        assert SHAPES["gpt-oss qkv"] == ((heads + 2 * kv) * dim, hidden)
        assert SHAPES["gpt-oss o_proj"] == (hidden, heads * dim)
        assert SHAPES[f"{name} router"] == (cfg["num_local_experts"], hidden)
        assert SHAPES["gpt-oss lm_head"] == (cfg["vocab_size"], hidden)


def test_a_partial_run_keeps_the_earlier_shapes_with_their_provenance():
    earlier = _run("Card X", "old", {"llama3-8b qkv": 1.2, "qwen3-0.6b qkv": 0.5})
    now = _run("Card X", "new", {"llama3-8b qkv": 0.8, "qwen3-30b-a3b router": 0.5})
    merged = merge_with_earlier(now, earlier)
    by_shape = {(r["shape"], r["M"]): r for r in merged["rows"]}
    assert len(by_shape) == len(merged["rows"]) == 6
    assert by_shape[("llama3-8b qkv", 1)]["measured"]["commit"] == "new"  # re-measured: the new row only
    assert by_shape[("qwen3-0.6b qkv", 1)]["measured"]["commit"] == "old"
    rule = GemvRule.from_json(rule_from_results(merged))
    assert rule.max_rows("linear", *SHAPES["qwen3-0.6b qkv"]) == 2
    assert rule.max_rows("linear", *SHAPES["llama3-8b qkv"]) == 2
    assert rule.max_rows("linear", *SHAPES["qwen3-30b-a3b router"]) == 2


def test_rows_from_another_card_are_not_carried():
    merged = merge_with_earlier(_run("Card Y", "new", {"qwen3-30b-a3b qkv": 0.9}),
                                _run("Card X", "old", {"qwen3-0.6b qkv": 0.5}))  # fmt: skip
    assert {r["shape"] for r in merged["rows"]} == {"qwen3-30b-a3b qkv"}
