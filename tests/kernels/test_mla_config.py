"""The MLA decode tile and split choice (kernels/mla_config.py): names, bad tiles, the split count
from static sizes, the measured rule read back from the JSON the sweep writes, and the default
tiles compiled for Hopper."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphserve.kernels.mla_config import (
    DECODE_FEW_HEADS,
    DECODE_FP32,
    DECODE_MANY_HEADS,
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    SAFE_DECODE,
    MLARule,
    MLATile,
    choose_num_splits,
    decode_tile,
    load_rule,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tile", [DECODE_FEW_HEADS, DECODE_MANY_HEADS, MLATile(True, 32, 64, 8, 3, 1, block_t=4)])
def test_tile_names_round_trip(tile):
    assert MLATile.parse(tile.name) == tile


@pytest.mark.parametrize(("kwargs", "field"), [({"block_h": 8}, "block_h"), ({"block_n": 48}, "block_n"),
                                               ({"num_warps": 3}, "num_warps"), ({"num_stages": 0}, "num_stages"),
                                               ({"occupancy": 0}, "occupancy"), ({"block_t": 3}, "block_t")])
def test_bad_tiles_name_the_field(kwargs, field):
    fields = {"token_major": False, "block_h": 16, "block_n": 16, "num_warps": 4, "num_stages": 2, **kwargs}
    with pytest.raises(ValueError, match=f"MLATile.{field}={kwargs[field]}"):
        MLATile(**fields)
    with pytest.raises(ValueError, match="expected like"):
        MLATile.parse("h16n16w4s2")


def test_decode_splits_fill_whole_waves_from_static_sizes():
    sms = 132
    assert choose_num_splits(256, 1, 4096, sms) == 1  # the batch alone fills a wave
    assert choose_num_splits(64, 1, 4096, sms) == 4  # 256 of 264 slots, where 5 splits would start a 2nd wave
    assert choose_num_splits(64, 1, 4096, sms, occupancy=1) == 2  # 128 of 132 slots at one program per SM
    assert choose_num_splits(16, 8, 4096, sms) == 2  # V3's 128 heads in blocks of 16: 256 programs
    assert choose_num_splits(1, 1, 1 << 20, sms) <= MAX_SPLITS
    assert choose_num_splits(1, 1, 3 * MIN_SPLIT_TOKENS, sms) == 3  # never shorter than MIN_SPLIT_TOKENS
    for occupancy in (1, 2, 4):
        slots = occupancy * sms
        for batch in (1, 2, 3, 8, 16, 24, 40):
            splits = choose_num_splits(batch, 1, 8192, sms, occupancy)
            waves = batch * splits / slots
            # a mostly full last wave, or as many splits as the context allows (within the 85% rule)
            assert waves / -(-waves // 1) > 0.4 or splits >= 0.85 * MAX_SPLITS, (occupancy, batch, splits)


def _rule(entries: list[tuple[int, int, int, str]]) -> dict:
    return {"device": "NVIDIA H200", "entries": [{"heads": h, "bs": b, "ctx": c, "tile": t} for h, b, c, t in entries]}


def test_rule_takes_the_nearest_measured_point():
    rule = MLARule.from_json(_rule([(16, 1, 4096, "tm-h16n64w4s3o2"), (16, 64, 4096, "hm-h16n32w4s2o2"),
                                    (16, 64, 16384, "tm-h16n64w4s4o1"), (128, 64, 4096, "hm-h64n32w8s2o1")]))
    assert rule.tile(16, 1, 1024).name == "tm-h16n64w4s3o2"
    assert rule.tile(16, 48, 4096).name == "hm-h16n32w4s2o2"
    assert rule.tile(16, 256, 32768).name == "tm-h16n64w4s4o1"
    assert rule.tile(8, 64, 4096).name == "hm-h16n32w4s2o2"  # V2-Lite at tp 2: the 16-head rows
    assert rule.tile(64, 2, 4096).name == "hm-h64n32w8s2o1"  # V3 at tp 2: nearer 128 heads than 16
    assert MLARule("x", ()).tile(16, 1, 1024) is None


def test_rule_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "mla_tiles.json"
    assert load_rule.__wrapped__(str(path)).entries == ()  # no file: the code defaults
    path.write_text(json.dumps(_rule([(16, 64, 4096, "tm-h16n64w4s3o2")])))
    rule = load_rule.__wrapped__(str(path))
    assert rule.device == "NVIDIA H200" and rule.tile(16, 64, 4096) == MLATile(True, 16, 64, 4, 3, 2)
    path.write_text(json.dumps({"device": "d", "entries": [{"heads": 16, "bs": 1, "ctx": 64}]}))
    with pytest.raises(ValueError, match="no 'tile'"):
        load_rule.__wrapped__(str(path))


def test_defaults_without_a_rule():
    cpu = torch.device("cpu")
    assert decode_tile(16, 64, 4096, torch.bfloat16, cpu) == DECODE_FEW_HEADS
    assert decode_tile(128, 64, 4096, torch.bfloat16, cpu) == DECODE_MANY_HEADS
    assert decode_tile(128, 64, 4096, torch.float32, cpu) == DECODE_FP32


def test_sweep_winners_become_a_rule_the_kernel_reads(tmp_path, monkeypatch):
    """benchmarks/mla.py --sweep: the fastest tile per point goes into the rule, next to the default's time."""
    from benchmarks import mla

    for names in (*mla.CANDIDATES.values(), *mla.QUICK_CANDIDATES.values()):
        for name in names:
            MLATile.parse(f"{name}o1")  # every candidate is a valid tile
    rows = []
    for tile, ms in ((DECODE_FEW_HEADS.name, 0.20), ("tm-h16n64w4s3o2", 0.12), ("tm-h16n64w4s3o1", 0.15)):
        rows.append({"heads": 16, "bs": 64, "ctx": 4096, "tile": tile, "splits": 4, "ms": ms, "bytes": 3e8,
                     "flops": 1e10})
    rows.append({"heads": 16, "bs": 1, "ctx": 4096, "tile": "tm-h16n64w4s2o1", "splits": 60, "ms": 0.01,
                 "bytes": 5e6, "flops": 1e8})
    for r in rows:
        r.update(us=r["ms"] * 1e3, pct_bw=50.0, tflops=1.0)
    best = mla.winners(rows)
    assert [(w["bs"], w["tile"]) for w in best] == [(1, "tm-h16n64w4s2o1"), (64, "tm-h16n64w4s3o2")]
    assert best[1]["default_tile"] == DECODE_FEW_HEADS.name and best[1]["speedup"] == pytest.approx(0.20 / 0.12)
    monkeypatch.delenv("OUT", raising=False)
    path = tmp_path / "mla_tiles.json"
    mla.write_rule({"environment": {"device": "NVIDIA H200", "date": "d"}, "winners": best}, path)
    rule = load_rule.__wrapped__(str(path))
    assert rule.device == "NVIDIA H200"
    assert rule.tile(16, 2, 4096) == MLATile(True, 16, 64, 4, 2, 1)
    assert rule.tile(16, 128, 8192) == MLATile(True, 16, 64, 4, 3, 2)


def test_sweep_winners_find_the_default_timed_under_another_occupancy():
    """An occupancy whose split count an earlier one already gave is not timed again: its name goes to that row's
    ``also``, and the winners still find the default's time there."""
    from benchmarks import mla

    default = DECODE_MANY_HEADS
    other = dataclasses.replace(default, occupancy=2 if default.occupancy != 2 else 1)
    rows = [{"heads": 128, "bs": 1, "ctx": 1024, "tile": tile, "splits": 14, "ms": ms, "us": ms * 1e3,
             "pct_bw": 5.0, "tflops": 1.0, **extra}
            for tile, ms, extra in ((other.name, 0.03, {"also": [default.name]}), ("tm-h64n32w8s3o1", 0.02, {}))]
    (best,) = mla.winners(rows)
    assert best["tile"] == "tm-h64n32w8s3o1" and best["default_tile"] == default.name
    assert best["default_us"] == pytest.approx(30.0) and best["speedup"] == pytest.approx(1.5)


def test_an_fp8_cache_sweep_adds_its_tiles_beside_the_model_dtype_caches(tmp_path, monkeypatch):
    """``--sweep --cache fp8_e4m3``: its winners go into the rule as the fp8 cache's, the bf16 cache's entries stay
    (each naming its run); a call on an fp8 cache takes the fp8 entries, and with none, the model dtype's."""
    from benchmarks import mla

    monkeypatch.delenv("OUT", raising=False)
    path = tmp_path / "mla_tiles.json"
    path.write_text(json.dumps({**_rule([(16, 64, 4096, "tm-h16n64w4s3o2")]), "measured": {"commit": "bf16-run"}}))
    assert load_rule.__wrapped__(str(path)).tile(16, 64, 4096, "fp8") == MLATile(True, 16, 64, 4, 3, 2)
    rows = [{"cache": "float8_e4m3fn", "heads": 16, "bs": 64, "ctx": 4096, "tile": tile, "splits": 4, "ms": ms,
             "us": ms * 1e3, "pct_bw": 50.0, "tflops": 1.0, "bytes": 1.5e8, "flops": 1e10}
            for tile, ms in (("hm-h16n16w4s2o2", 0.09), (DECODE_FEW_HEADS.name, 0.16))]
    best = mla.winners(rows)
    assert [(w["cache"], w["tile"]) for w in best] == [("float8_e4m3fn", "hm-h16n16w4s2o2")]
    mla.write_rule({"environment": {"device": "NVIDIA H200", "commit": "fp8-run"}, "winners": best}, path)
    written = json.loads(path.read_text())
    assert [(e["cache"], e["tile"], e["measured_at"]["commit"]) for e in written["entries"]] == [
        ("model", "tm-h16n64w4s3o2", "bf16-run"), ("fp8", "hm-h16n16w4s2o2", "fp8-run")]
    rule = load_rule.__wrapped__(str(path))
    assert rule.tile(16, 64, 4096, "fp8") == MLATile(False, 16, 16, 4, 2, 2)
    assert rule.tile(16, 64, 4096) == rule.tile(16, 64, 4096, "model") == MLATile(True, 16, 64, 4, 3, 2)
    written["entries"][1]["cache"] = "fp4"
    path.write_text(json.dumps(written))
    with pytest.raises(ValueError, match="cache='fp4': one of model, fp8"):
        load_rule.__wrapped__(str(path))


def test_default_tiles_fit_hopper_and_pipeline_their_loads():
    """Compiled for sm_90 without a GPU (Triton + ptxas, benchmarks/mla_ptxas.py): each default decode tile
    fits the shared memory, spills no registers, and fits as many programs per SM as its occupancy
    says; a third stage adds a whole cache tile of buffer (the loads really are multi-buffered); and the
    fallback tile needs less shared memory than either default, spilling nothing."""
    two_stages = dataclasses.replace(DECODE_FEW_HEADS, num_stages=2).name
    names = [DECODE_FEW_HEADS.name, DECODE_MANY_HEADS.name, two_stages, SAFE_DECODE.name]
    out = subprocess.run([sys.executable, "-m", "benchmarks.mla_ptxas", "--json", *names], cwd=ROOT, check=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True).stdout
    rows = {r["tile"]: r for r in map(json.loads, out.splitlines())}
    for name in names[:2]:
        row = rows[name]
        assert row["fits_sm90"] and row["spill_bytes"] == 0, row
        assert row["programs_per_sm"] >= MLATile.parse(name).occupancy, row
    tile_bytes = DECODE_FEW_HEADS.block_n * (512 + 64) * 2
    assert rows[DECODE_FEW_HEADS.name]["shared_bytes"] >= rows[two_stages]["shared_bytes"] + tile_bytes
    safe = rows[SAFE_DECODE.name]
    assert safe["spill_bytes"] == 0 and safe["shared_bytes"] < min(rows[n]["shared_bytes"] for n in names[:2]), safe


def test_sweep_stops_at_a_gpu_fault_and_skips_a_tile_that_does_not_compile(monkeypatch):
    """A launch that faults poisons the CUDA context: the sweep stops there, naming the tile, split count and
    point, instead of reporting every later tile as skipped; a tile that fails to compile is only skipped."""
    import benchmarks.mla as bench

    case = object.__new__(bench.DecodeCase)  # the point's sizes only: no launch reaches a GPU here
    case.heads, case.batch, case.ctx, case.cache_dtype, case.nbytes, case.expected = 16, 1, 1024, torch.bfloat16, 1e6, None
    case.q_lat = case.q_rope = case.cache = case.tables = case.lens = case.qsl = case.out = None
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    tile = MLATile.parse("hm-h16n16w4s2o2")

    def compile_error(*args, **kwargs):
        raise ValueError("shape mismatch in tl.dot")

    monkeypatch.setattr(bench, "mla_attention", compile_error)
    assert case.time_ms(tile, 14) is None

    def fault(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(bench, "mla_attention", fault)
    with pytest.raises(bench.SweepAborted, match=r"hm-h16n16w4s2o2 \(splits 14\) at heads=16 bs=1 ctx=1024"):
        case.time_ms(tile, 14)
