"""/metrics carries each MoE layer's routing balance, summed over the steps' telemetry records."""

from __future__ import annotations

from graphserve.engine.telemetry import StepRecord
from graphserve.server.metrics import ServerMetrics


def _record(step: int, pairs: list[int], busiest: list[int]) -> StepRecord:
    return StepRecord(step=step, time=0.0, kind="decode", batch_size=4, padded_size=4, graph=True, mode="graph",
                      num_tokens=4, prefill_tokens=0, decode_tokens=4, step_ms=1.0, running=4, waiting=0,
                      kv_usage=0.1, experts_touched=sum(busiest), max_expert_load=max(busiest),
                      layer_max_expert_load=busiest, layer_routed_pairs=pairs)


def test_expert_load_counters_per_layer_sum_over_steps():
    m = ServerMetrics(lambda: None)
    m.on_step(_record(1, [8, 8], [3, 2]))
    m.on_step(_record(2, [8, 8], [4, 2]))
    text = m.render().decode()
    assert 'graphserve:moe_routed_pairs_total{layer="0"} 16.0' in text
    assert 'graphserve:moe_routed_pairs_total{layer="1"} 16.0' in text
    assert 'graphserve:moe_busiest_expert_pairs_total{layer="0"} 7.0' in text
    assert 'graphserve:moe_busiest_expert_pairs_total{layer="1"} 4.0' in text


def test_dense_steps_add_no_moe_series():
    m = ServerMetrics(lambda: None)
    m.on_step(StepRecord(step=1, time=0.0, kind="decode", batch_size=1, padded_size=1, graph=False, mode="eager",
                         num_tokens=1, prefill_tokens=0, decode_tokens=1, step_ms=1.0, running=1, waiting=0,
                         kv_usage=0.0))
    assert "moe_routed_pairs_total{" not in m.render().decode()
