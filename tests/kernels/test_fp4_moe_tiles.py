"""The FP4 routed experts' tile table (kernels/fp4_moe_config.py): lookup through kernels/tables.py (a table for
another card or version passed over, a shape it does not list falling back to the defaults, which are the tile every
call took before tables), the plan a call gets from it, and the tuner's table built from bucket rows as
graphserve/tuning/fp4_moe.py measures them (the timings themselves need a GPU)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from graphserve.kernels import fp4_moe_config as cfg
from graphserve.kernels import tables
from graphserve.kernels.fp4_moe_config import Fp4MoeTile
from tests.support.tables_utils import isolate_tables, write_table

CARD = "NVIDIA H100 80GB HBM3"
OTHER = "NVIDIA H200"
V4 = ("nvfp4", 256, 2048, 4096)  # (fmt, experts, intermediate, hidden)
CUDA = torch.device("cuda")  # named only: the lookup asks the card's name, which the tests fake


def _tile(variant, bm=16, bn=64, bk=None, warps=4, stages=3):
    return {"variant": variant, "block_m": bm, "block_n": bn, "block_k": bk or (32 if variant == "fp8" else 128),
            "group_m": 8, "num_warps": warps, "num_stages": stages}  # fmt: skip


def _table(device, shapes=None, **extra):
    shapes = shapes if shapes is not None else [{
        "fmt": "nvfp4", "experts": 256, "intermediate": 2048, "hidden": 4096, "stream_max_pairs": 6,
        "buckets": {"24": {"gate_up": _tile("bf16", bn=128), "down": _tile("bf16")},
                    "384": {"gate_up": _tile("fp8", bn=128, warps=8, stages=4), "down": _tile("fp8")}}}]  # fmt: skip
    return {"device": device, "shapes": shapes, **extra}


@pytest.fixture
def card(tmp_path, monkeypatch):
    isolate_tables(monkeypatch, tmp_path, CARD)
    yield tmp_path
    tables.clear()


def _default_plan(pairs, num_local=256, inter=2048, hidden=4096, group=16):
    bm = 16 if pairs / num_local <= 16 else 32 if pairs / num_local <= 64 else 64
    return cfg.Fp4MoePlan("stream" if pairs <= 32 else "gemm", Fp4MoeTile("bf16", bm, 64, max(group, 128), 8, 4, 3),
                          Fp4MoeTile("bf16", bm, 64, max(group, 128), 8, 4, 3))  # fmt: skip


def test_without_a_table_every_call_takes_the_tile_it_took_before(card):
    """No table anywhere: the streaming path up to 32 pairs, then the bf16 variant with BLOCK_N 64, BLOCK_K 128,
    4 warps, 3 stages and BLOCK_M by the pairs an expert gets; the start-up line names the command."""
    for pairs in (6, 32, 33, 384, 8192, 100000):
        assert cfg.plan(*V4[:1], 256, 2048, 4096, pairs, CUDA) == _default_plan(pairs)
    small = cfg.plan("mxfp4", 4, 96, 64, 40, CUDA)  # K 64 and 96: the step is K's power of two, at most 128
    assert (small.gate_up.block_k, small.down.block_k, small.gate_up.block_m) == (64, 128, 16)
    line = tables.startup_line(CARD)
    assert "fp4 experts E=256,I=2048,H=4096,nvfp4" in line and "graphserve tune --tables fp4" in line
    assert cfg.plan("nvfp4", 256, 2048, 4096, 6, torch.device("cpu")) == _default_plan(6)  # CPU: no lookup


def test_a_listed_shape_takes_its_buckets_tiles_and_stream_crossover(card):
    write_table(tables.cache_dir(CARD) / cfg.TABLE_NAME, _table(CARD, versions=tables.versions()))
    plans = {p: cfg.plan("nvfp4", 256, 2048, 4096, p, CUDA) for p in (6, 7, 24, 25, 384, 5000)}
    assert plans[6].path == "stream" and plans[7].path == "gemm"  # the measured crossover, not 32
    assert plans[7].gate_up == plans[24].gate_up == Fp4MoeTile("bf16", 16, 128, 128, 8, 4, 3)
    assert plans[25].gate_up == plans[384].gate_up == plans[5000].gate_up == Fp4MoeTile("fp8", 16, 128, 32, 8, 8, 4)
    assert plans[384].down.variant == "fp8"
    assert tables.RESOLVED[cfg.table_label(V4)][0] == "cache"
    # another shape on the same card: not in the table, so the defaults, and the start-up line says so
    assert cfg.plan("mxfp4", 128, 2880, 2880, 400, CUDA) == _default_plan(400, 128, 2880, 2880, 32)
    assert tables.RESOLVED["fp4 experts E=128,I=2880,H=2880,mxfp4"] == ("defaults", None)
    # forcing a variant takes its default tiles whatever the table says
    forced = cfg.plan("nvfp4", 256, 2048, 4096, 384, CUDA, variant="fp8")
    assert forced.gate_up == Fp4MoeTile("fp8", 16, 64, 32, 8, 4, 4) and forced.path == "gemm"


@pytest.mark.parametrize("where, table, field", [
    ("shipped", _table(OTHER), "field 'device' is 'NVIDIA H200', this card is 'NVIDIA H100 80GB HBM3'"),
    ("cache", _table(CARD, versions={"torch": "0", "triton": "0", "graphserve": "0"}), "field 'versions.torch'"),
    ("cache", _table(CARD, versions="now", shapes=[{"fmt": "nvfp4", "experts": 256, "intermediate": 2048,
                                                    "hidden": 4096, "stream_max_pairs": 0, "buckets": {
        "8": {"gate_up": _tile("fp8", bk=64), "down": _tile("fp8")}}}]), "the fp8 variant steps 32 columns"),
    ("cache", _table(CARD, versions="now", shapes=[{"fmt": "nvfp4", "experts": 256, "intermediate": 2048,
                                                    "hidden": 4096, "stream_max_pairs": 0, "buckets": {
        "8": {"gate_up": _tile("bf16", bm=32), "down": _tile("bf16")}}}]), "block_m 32 and down's 16 must be equal"),
    ("cache", _table(CARD, versions="now", shapes=[{"fmt": "nvfp8", "experts": 256, "intermediate": 2048,
                                                    "hidden": 4096, "stream_max_pairs": 0, "buckets": {
        "8": {"gate_up": _tile("bf16"), "down": _tile("bf16")}}}]), "field 'fmt' is 'nvfp8', must be one of"),
])  # fmt: skip
def test_a_table_for_another_card_or_version_or_with_a_bad_tile_is_passed_over(card, caplog, where, table, field):
    if table.get("versions") == "now":
        table = {**table, "versions": tables.versions()}
    base = tables.cache_dir(CARD) if where == "cache" else card / "shipped" / tables.card_key(CARD)
    bad = write_table(base / cfg.TABLE_NAME, table)
    with caplog.at_level(logging.INFO, logger="graphserve.tables"):
        assert cfg.plan("nvfp4", 256, 2048, 4096, 384, CUDA) == _default_plan(384)
    message = next(r.getMessage() for r in caplog.records if str(bad) in r.getMessage())
    assert field in message
    assert tables.RESOLVED[cfg.table_label(V4)] == ("defaults", None)


def test_a_shipped_table_serves_where_the_cache_has_none(card):
    write_table(card / "shipped" / tables.card_key(CARD) / cfg.TABLE_NAME, _table(CARD))
    assert cfg.plan("nvfp4", 256, 2048, 4096, 384, CUDA).gate_up.variant == "fp8"
    assert tables.RESOLVED[cfg.table_label(V4)][0] == "shipped"


def _row(model, tokens, k, stream, gemm, variant="bf16"):
    tile = Fp4MoeTile(variant, 16, 64, 32 if variant == "fp8" else 128)
    return {"model": model, "fmt": "nvfp4", "tokens": tokens, "pairs": tokens * k, "experts_read": tokens * k,
            "bytes": 1000 * tokens, "stream_ms": stream, "gemm_bf16_default_ms": gemm * 1.2,
            "gemm_bf16_best_ms": gemm * 1.1, "gemm_fp8_best_ms": gemm, "gemm_mixed_ms": float("inf"), "gemm_ms": gemm,
            "gate_up": "g", "down": "d", "tiles": (tile, tile)}  # fmt: skip


def test_the_tuner_writes_a_table_the_reader_takes_and_keeps_other_shapes(card):
    """Bucket rows as measure_shape returns them: the stream crossover is the last bucket of an unbroken run of
    stream wins; the table keeps an earlier run's other shapes; the benchmark rows divide by the read floor."""
    from graphserve.tuning import fp4_moe

    rows = [_row("deepseek-v4-flash-l6", 1, 6, 0.1, 0.2), _row("deepseek-v4-flash-l6", 4, 6, 0.3, 0.25, "fp8"),
            _row("deepseek-v4-flash-l6", 16, 6, 0.2, 0.3), _row("deepseek-v4-flash-l6", 64, 6, float("inf"), 0.5)]
    kept = {"fmt": "mxfp4", "experts": 128, "intermediate": 2880, "hidden": 2880, "stream_max_pairs": 4,
            "buckets": {"4": {"gate_up": _tile("bf16"), "down": _tile("bf16")}}}  # fmt: skip
    earlier = {"shapes": [kept, {**kept, "fmt": "nvfp4", "experts": 256, "intermediate": 2048, "hidden": 4096}]}
    table = fp4_moe.table_from({"deepseek-v4-flash-l6": rows, "qwen3-30b-a3b": []}, earlier, CARD)
    assert [s["fmt"] for s in table["shapes"]] == ["mxfp4", "nvfp4"]  # V4's entry replaced, gpt-oss's kept
    v4 = table["shapes"][1]
    assert v4["stream_max_pairs"] == 6 and sorted(map(int, v4["buckets"])) == [6, 24, 96, 384]
    assert v4["buckets"]["24"]["gate_up"]["variant"] == "fp8"
    assert v4["measurements"][3]["stream_ms"] is None  # not timed: JSON null, not Infinity
    write_table(tables.cache_dir(CARD) / cfg.TABLE_NAME, {**table, **tables.stamp(CARD)})
    assert cfg.plan("nvfp4", 256, 2048, 4096, 6, CUDA).path == "stream"
    assert cfg.plan("nvfp4", 256, 2048, 4096, 20, CUDA).gate_up.variant == "fp8"
    bench = fp4_moe.bench_rows(rows[:1], lambda nbytes: nbytes / 1e6)
    assert [r["kernel"] for r in bench] == ["stream", "gemm-bf16 default tile", "gemm-bf16 best tile",
                                            "gemm-fp8 best tile"]  # fmt: skip
    assert bench[0]["ratio"] == pytest.approx(0.1 / 1e-3) and bench[0]["gbs"] == pytest.approx(1000 / 0.1 / 1e6)


def test_candidates_start_at_the_default_and_fit_the_shape():
    from graphserve.tuning import fp4_moe

    bf16 = fp4_moe.candidates("bf16", 16, 16, 4096, quick=False)
    assert bf16[0] == cfg.default_tile("bf16", 16, 16, 4096) and len(set(bf16)) == len(bf16) > 4
    assert all(t.block_k <= 128 for t in fp4_moe.candidates("bf16", 16, 32, 96, quick=False))
    fp8 = fp4_moe.candidates("fp8", 32, 16, 2048, quick=True)
    assert len(fp8) == 4 and all(t.block_k == 32 and t.block_n >= 64 and t.block_m == 32 for t in fp8)
    assert fp4_moe.candidates("fp8", 16, 16, 720, quick=False) == []  # 720 is not whole 32-column steps
    assert fp4_moe.block_ms(384, 256) == [16] and fp4_moe.block_ms(2048, 256) == [16]
    assert fp4_moe.block_ms(4096, 256) == [16, 32]


def test_graphserve_tune_fp4_plans_the_named_presets_experts_and_writes_their_table(card):
    from graphserve.tuning import measure

    plan = measure.fp4_plan(["dummy:deepseek-v4-flash-l6"], quick=False)
    assert plan.units == ["experts deepseek-v4-flash-l6"]  # no Llama-3-8B: no projection rule
    rows = [_row("deepseek-v4-flash-l6", 64, 6, float("inf"), 0.5, "fp8")]
    [(name, table)] = plan.finish([("experts deepseek-v4-flash-l6", rows)], lambda _name: None)
    assert name == cfg.TABLE_NAME and table["device"] == CARD
    assert table["shapes"][0]["stream_max_pairs"] == 0 and table["shapes"][0]["buckets"]["384"]["down"]["variant"] == "fp8"


def test_the_sweep_keeps_the_fastest_tiles_and_stops_at_its_time_share(monkeypatch):
    """measure_shape's logic on the CPU with the timings faked (a GPU times the real calls): the fp8 variant faster at
    gate_up, the bf16 one at down, the streaming path faster up to 8 pairs; a spent share leaves out later batches."""
    from graphserve.tuning import fp4_moe

    monkeypatch.setattr(fp4_moe, "DEVICE", torch.device("cpu"))
    monkeypatch.setitem(fp4_moe.SHAPES, "tiny", (8, 128, 64, 2, "nvfp4", "silu", True))
    timed = []

    def fake_ms(case, batch, path, tiles=None):
        pairs = batch[2].numel()
        timed.append((pairs, path, tiles))
        if path == "stream":
            return 0.1 * pairs
        gu, dn = tiles
        gu_ms = (0.5 if gu.variant == "fp8" else 1.0) * (1 + abs(gu.block_n - 128) / 256)
        dn_ms = (1.0 if dn.variant == "fp8" else 0.6) * (1 + abs(dn.num_stages - 4) / 8)
        return gu_ms + dn_ms

    monkeypatch.setattr(fp4_moe.Case, "ms", fake_ms)
    rows = fp4_moe.measure_shape("tiny", budget_s=1e6, quick=False, tokens=(1, 4, 64))
    assert [r["pairs"] for r in rows] == [2, 8, 128]
    best = rows[2]["tiles"]
    assert best[0].variant == "fp8" and best[0].block_n == 128 and best[1].variant == "bf16"
    assert best[1].num_stages == 4 and best[0].block_m == best[1].block_m == 16
    assert rows[2]["gemm_ms"] == rows[2]["gemm_mixed_ms"] < min(rows[2]["gemm_fp8_best_ms"],
                                                                 rows[2]["gemm_bf16_best_ms"])  # fmt: skip
    assert rows[2]["gemm_bf16_best_ms"] <= rows[2]["gemm_bf16_default_ms"] and rows[2]["stream_ms"] == 12.8
    entry = fp4_moe.entry_from_rows(rows)
    assert entry.stream_max_pairs == 8 and entry.buckets == (2, 8, 128)
    assert all(t is None or t[0].block_m == t[1].block_m for _, _, t in timed)
    assert fp4_moe.bench_rows(rows[2:], lambda b: 1.0)[0]["kernel"] == "stream"
    assert len(fp4_moe.measure_shape("tiny", budget_s=0.0, quick=True)) == 1  # the first batch, then the share is spent


def test_grouped_gemm_compiles_for_hopper_in_both_variants():
    """Both grouped-GEMM variants at V4's expert shape and their default tiles, decode (BLOCK_M 16) and prefill
    (BLOCK_M 64), compiled for sm_90 without a GPU (Triton + ptxas, benchmarks/kernel_ptxas.py): they build (the bf16
    variant's BLOCK_M 64 did not with x as the MMA's first operand), fit an SM and do not spill."""
    import os
    import subprocess
    import sys

    code = ("import json; from benchmarks.kernel_ptxas import fp4_moe_gemm_reports\n"
            "for r in fp4_moe_gemm_reports(('deepseek-v4-flash',)): print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True).stdout
    from benchmarks.kernel_ptxas import SM90_SHARED_BYTES

    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 8 and {r["kernel"] for r in rows} == {"_fp4_moe_gemm_kernel", "_fp4_moe_gemm_fp8_kernel"}
    for r in rows:
        assert r["spill_bytes"] == 0 and r["shared_bytes"] <= SM90_SHARED_BYTES and r["programs_per_sm"] >= 1, r


def test_a_cache_listing_other_shapes_leaves_the_shipped_entries_in_force(card):
    """A user's tune of gpt-oss's experts writes a cache table without DeepSeek-V4's shape: V4 still takes the
    shipped entry for this card, gpt-oss the cache's (each shape looked up cache first, then shipped)."""
    write_table(card / "shipped" / tables.card_key(CARD) / cfg.TABLE_NAME, _table(CARD))
    oss = {"fmt": "mxfp4", "experts": 32, "intermediate": 2880, "hidden": 2880, "stream_max_pairs": 4,
           "buckets": {"64": {"gate_up": _tile("bf16", bn=32), "down": _tile("bf16", bn=32)}}}  # fmt: skip
    write_table(tables.cache_dir(CARD) / cfg.TABLE_NAME, _table(CARD, [oss], versions=tables.versions()))
    assert cfg.plan("nvfp4", 256, 2048, 4096, 384, CUDA).gate_up.variant == "fp8"
    assert tables.RESOLVED[cfg.table_label(V4)][0] == "shipped"
    assert cfg.plan("mxfp4", 32, 2880, 2880, 40, CUDA).gate_up == Fp4MoeTile("bf16", 16, 32, 128, 8, 4, 3)
    assert tables.RESOLVED[cfg.table_label(("mxfp4", 32, 2880, 2880))][0] == "cache"


def test_streaming_kernels_compile_for_hopper_in_both_down_grids():
    """The streaming gate_up and both down grids (per token; per pair with fp32 terms) at V4's and gpt-oss's expert
    shapes, compiled for sm_90 without a GPU: they build, fit an SM and do not spill."""
    import os
    import subprocess
    import sys

    code = ("import json; from benchmarks.kernel_ptxas import fp4_moe_stream_reports\n"
            "for r in fp4_moe_stream_reports(): print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["shape"].split(" ", 1)[1] for r in rows] == ["gate_up", "down per token", "down per pair"] * 2
    for r in rows:
        assert r["spill_bytes"] == 0 and r["programs_per_sm"] >= 2, r
