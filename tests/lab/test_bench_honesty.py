"""The benchmarks' denominators on CPU: a merged result file keeps each run's ceilings beside the rows divided by
them; the floors take every rate the run reached and the probes' second round before any ratio; the matmul peaks
are the best of both probes and the run's own matmuls; targets are judged on unrounded numbers; no floor and no
samples are written as None, not 0.0."""

from __future__ import annotations

import json

import pytest

from benchmarks import common
from benchmarks.fp8 import (
    PREFILL_TARGET,
    MatmulPeak,
    add_ratios,
    decode_target,
    meets_target,
    observe_gemm_peaks,
    settle_ceilings,
)
from benchmarks.fp8_route import HEAD_DIM, attention_group, settle_floor
from benchmarks.ncu_kernels import read_report
from benchmarks.results_md import render
from benchmarks.roofline import ReadBandwidth
from benchmarks.step_breakdown import family_rows


class RecordingBandwidth(ReadBandwidth):
    """A ReadBandwidth whose second probe round is given (no GPU), recording the order of the calls made on it."""

    def __init__(self, methods: dict[str, float], again: dict[str, float], l2_bytes: int = 0) -> None:
        super().__init__(dict(methods), None, l2_bytes)
        self.again, self.calls = again, []

    def observe(self, label: str, nbytes: float, ms: float) -> None:
        self.calls.append("observe")
        super().observe(label, nbytes, ms)

    def probe_again(self, nbytes: int = 0) -> None:
        self.calls.append("probe_again")
        for method, gbs in self.again.items():
            self.methods[method] = max(self.methods.get(method, 0.0), gbs)

    def floor_ms(self, nbytes: float) -> float:
        self.calls.append("floor_ms")
        return super().floor_ms(nbytes)


# --- merged result files: per-run ceilings and row stamps -------------------------------------------------------


def _results(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    return tmp_path / "fp8_decode.json"


def test_merged_file_keeps_each_runs_ceilings_and_drops_those_of_runs_with_no_row_left(tmp_path, monkeypatch):
    path = _results(tmp_path, monkeypatch)
    llama = "dummy:llama3-8b --quantization fp8"
    qwen = "dummy:qwen3-30b-a3b --quantization fp8"
    old_env = {"date": "2026-12-01", "commit": "old"}
    path.write_text(json.dumps({  # a file from before run ids: one run's ceilings, the file's environment its run
        "environment": old_env, "ceilings": {"read": {"best_gbs": 4000.0}, "fp8_matmul_tflops": 1300.0},
        "rows": [{"model": llama, "bs": 1, "ctx": 512, "ratio": 1.5, "measured_at": old_env},
                 {"model": qwen, "bs": 64, "ctx": 2048, "ratio": 1.33, "measured_at": old_env}]}))

    first = common.start_run()
    common.merge_rows("fp8_decode", [{"model": llama, "bs": 1, "ctx": 512, "ratio": 1.4, "floor_gbs": 4200.0}],
                      ceilings={"read": {"best_gbs": 4200.0}, "fp8_matmul_tflops": 1400.0})
    merged = json.loads(path.read_text())
    assert set(merged["ceilings"]) == {"before run ids: 2026-12-01 old", first["run_id"]}
    old_row, new_row = merged["rows"]
    assert old_row["model"] == qwen and new_row["model"] == llama
    assert new_row["measured_at"]["run_id"] == first["run_id"] == merged["environment"]["run_id"]
    assert new_row["measured_at"]["started"] == first["started"]
    # each row finds the ceilings it was divided by, however many runs the file holds
    assert common.ceilings_for(merged, old_row)["read"]["best_gbs"] == 4000.0
    assert common.ceilings_for(merged, old_row)["fp8_matmul_tflops"] == 1300.0
    assert common.ceilings_for(merged, new_row)["read"]["best_gbs"] == 4200.0
    assert common.ceilings_for(merged, new_row)["fp8_matmul_tflops"] == 1400.0

    second = common.start_run()
    assert second["run_id"] != first["run_id"]
    common.merge_rows("fp8_decode", [{"model": qwen, "bs": 64, "ctx": 2048, "ratio": 1.31}],
                      ceilings={"read": {"best_gbs": 4100.0}, "fp8_matmul_tflops": 1350.0})
    merged = json.loads(path.read_text())
    # the old run's last row was replaced: its ceilings go; the first run's llama row stays, and so do its ceilings
    assert set(merged["ceilings"]) == {first["run_id"], second["run_id"]}
    by_model = {r["model"]: r for r in merged["rows"]}
    assert common.ceilings_for(merged, by_model[llama])["read"]["best_gbs"] == 4200.0
    assert common.ceilings_for(merged, by_model[qwen])["read"]["best_gbs"] == 4100.0
    assert by_model[llama]["measured_at"]["run_id"] == first["run_id"]
    assert by_model[qwen]["measured_at"]["run_id"] == second["run_id"]

    # a merge without ceilings (benchmarks.moe_fp8's) keeps the others' as they are
    common.start_run()
    common.merge_rows("fp8_decode", [{"model": "dummy:mixtral-8x7b --quantization fp8", "bs": 64, "ctx": 2048}])
    assert set(json.loads(path.read_text())["ceilings"]) == {first["run_id"], second["run_id"]}

    # results_md renders the per-run ceilings one row a run, and the rows with their run
    table = render(f"{path}:ceilings=measured_at.run_id,read.best_gbs,fp8_matmul_tflops")
    assert f"| {first['run_id']} | 4,200.0 | 1,400.0 |" in table
    assert f"| {second['run_id']} | 4,100.0 | 1,350.0 |" in table


def test_a_file_from_before_run_ids_reads_as_one_runs_ceilings_and_still_renders(tmp_path):
    env = {"date": "2026-11-30", "commit": "abc"}
    payload = {"environment": env, "ceilings": {"read": {"best_gbs": 4321.0}},
               "rows": [{"model": "m", "bs": 1, "ctx": 512, "ratio": 1.2996, "floor_ms": None}]}
    assert common.ceilings_for(payload, payload["rows"][0]) == {"measured_at": env, "read": {"best_gbs": 4321.0}}
    # a row of some earlier run, kept by a merge of before: no ceilings are known for it, so none are claimed
    assert common.ceilings_for(payload, {"measured_at": {"commit": "older"}}) is None
    path = tmp_path / "old.json"
    path.write_text(json.dumps(payload))
    assert "| m | 1.2996 | — |" in render(f"{path}=model,ratio,floor_ms")
    assert "| 4,321.0 |" in render(f"{path}:ceilings=read.best_gbs")


# --- ratios rendered and judged on the unrounded numbers --------------------------------------------------------


def test_ratio_columns_never_round_onto_a_target(tmp_path):
    assert common.ratio_text(1.3004) == "1.3004" and common.ratio_text(1.2996) == "1.2996"
    assert common.ratio_text(1.30004) == "1.30004"  # 4 decimals would read 1.3000, a value it is not
    assert common.ratio_text(0.44996) == "0.44996"  # nor may a miss of a >= 0.45 target read 0.4500
    assert common.ratio_text(1.3) == "1.3000" and common.ratio_text(1.25) == "1.2500"
    assert common.ratio_text(1.3000000000000003) == "1.3000000000000003"
    cols = ("ratio", "stream/floor", "vs_bf16", "dram_pct", "bf16_ratio", "step_ms", "floor_ms", "duration_us")
    assert [c for c in cols if common.is_ratio_column(c)] == ["ratio", "stream/floor", "vs_bf16", "dram_pct", "bf16_ratio"]


def test_decode_targets_apply_to_the_issues_rows_only_and_use_raw_values():
    llama = {"model": "dummy:llama3-8b --quantization fp8", "bs": 1, "ctx": 512}
    target = decode_target(llama)
    assert target == {"ratio_max": 1.3, "vs_bf16_max": 0.6}
    assert meets_target({**llama, "ratio": 1.2996, "vs_bf16": 0.5996}, target) is True
    assert meets_target({**llama, "ratio": 1.3004, "vs_bf16": 0.5996}, target) is False  # renders 1.300 at 3 decimals
    assert meets_target({**llama, "ratio": 1.2, "vs_bf16": 0.6004}, target) is False
    assert decode_target({**llama, "bs": 256, "ctx": 2048}) == {"ratio_max": 1.3}
    qwen = {"model": "dummy:qwen3-30b-a3b --quantization fp8", "bs": 64, "ctx": 2048}
    assert meets_target({**qwen, "ratio": 1.3499}, decode_target(qwen)) is True
    assert meets_target({**qwen, "ratio": 1.3501}, decode_target(qwen)) is False
    # the other variants, cases and models have no target: None, not False
    assert decode_target({**llama, "model": "dummy:llama3-8b --quantization fp8 --kv-cache-dtype fp8_e4m3"}) is None
    assert decode_target({**llama, "model": "dummy:llama3-8b --quantization fp8-block"}) is None
    assert decode_target({**qwen, "bs": 1, "ctx": 512}) is None
    assert meets_target({"ratio": 9.0}, None) is None
    assert meets_target({"ratio": 0.45}, PREFILL_TARGET) is True
    assert meets_target({"ratio": 0.4499}, PREFILL_TARGET) is False


# --- fp8: peaks re-measured and raised by the run's own matmuls, floors settled before the ratios ---------------


def test_fp8_ratios_take_the_ceilings_settled_after_the_work():
    bw = RecordingBandwidth({"matvec": 4000.0}, again={"matvec": 4400.0})
    fp8, bf16 = MatmulPeak(), MatmulPeak()
    fp8.observe("probe, before the work", 1200.0)
    bf16.observe("probe, before the work", 700.0)
    # a w8a8 GEMM of 16384 x 4096 x 4096 in 400 us: 1374.4 TFLOP/s, above the first probe
    observe_gemm_peaks([{"shape": "llama3-8b o_proj", "m": 16384, "n": 4096, "k": 4096, "w8a8_us": 400.0,
                         "bf16_us": 900.0, "stream_us": None}], fp8, bf16)
    assert fp8.method == "llama3-8b o_proj m=16384 w8a8"
    assert fp8.tflops == pytest.approx(2 * 16384 * 4096 * 4096 / 400.0 / 1e6)
    fp8.observe("dummy:llama3-8b fp8 prefill 8x2048", 900.0)
    bf16.observe("dummy:llama3-8b bf16 prefill 8x2048", 720.0)  # the bf16 prefill beat its probe (and the GEMM's 611)
    settle_ceilings(bw, fp8, bf16, matmul_probes=lambda: (1300.0, 710.0))
    assert bw.calls == ["probe_again"] and bw.best_gbs == 4400.0

    decode = [{"model": "dummy:llama3-8b --quantization fp8", "bs": 1, "ctx": 512, "step_ms": 2.6008,
               "read_bytes": 8.8e9, "flops": 16e9, "bf16_step_ms": 4.5, "bf16_read_bytes": 16.1e9}]
    prefill = [{"model": "dummy:llama3-8b", "fp8_tflops": 900.0, "bf16_tflops": 720.0}]
    add_ratios(decode, prefill, bw, fp8, bf16)
    r = decode[0]
    assert r["floor_ms"] == pytest.approx(8.8e9 / 4400e6) and r["ratio"] == pytest.approx(1.3004)
    assert (r["floor_gbs"], r["floor_method"], r["floor_bound"]) == (4400.0, "matvec", "read")
    assert r["fp8_peak_tflops"] == fp8.tflops and r["vs_bf16"] == pytest.approx(2.6008 / 4.5)
    # 1.3004 reads 1.300 at 3 decimals, and misses the 1.3 asked
    assert r["target"] == {"ratio_max": 1.3, "vs_bf16_max": 0.6} and r["meets_target"] is False
    p = prefill[0]
    assert p["ratio"] == pytest.approx(900.0 / 1374.389534) and p["fp8_peak_method"] == "llama3-8b o_proj m=16384 w8a8"
    assert p["bf16_peak_tflops"] == 720.0 and p["bf16_ratio"] == 1.0
    assert p["bf16_peak_method"] == "dummy:llama3-8b bf16 prefill 8x2048"
    assert p["meets_target"] is True


# --- fp8_route: the rows' own rates and the second probe round before stream/floor -------------------------------


def test_fp8_route_floors_take_the_pools_rates_and_the_second_probes_first():
    # one 16 MB o_proj copy is under twice a 50 MB L2; the cycled pool of 16 copies (268 MB) is not
    row = {"shape": "llama3-8b o_proj", "m": 1, "n": 4096, "k": 4096, "weight_bytes": 16_793_600, "pool": 16,
           "bf16_pool": 8, "stream_us": 3.6, "w8a8_us": 9.0, "read_us": 3.9, "bf16_us": 8.5, "scaled_mm_us": None}
    bw = RecordingBandwidth({"stream_read": 4200.0}, again={"stream_read": 4300.0}, l2_bytes=50 << 20)
    bw.observe("one copy alone", row["weight_bytes"], row["stream_us"] / 1e3)
    assert bw.observed == {}  # what the pool is for
    bw.calls.clear()
    settle_floor([row], bw)
    assert bw.calls[:5] == ["observe"] * 4 + ["probe_again"] and "floor_ms" not in bw.calls[:5]
    stream_gbs = row["weight_bytes"] / row["stream_us"] / 1e3  # 4664.9 GB/s: beats both probe rounds
    assert bw.best_method == "llama3-8b o_proj m=1 stream" and bw.best_gbs == pytest.approx(stream_gbs)
    assert row["stream/floor"] == pytest.approx(1.0) and row["floor_gbs"] == pytest.approx(stream_gbs)
    assert row["floor_method"] == "llama3-8b o_proj m=1 stream"
    assert bw.observed["llama3-8b o_proj m=1 bf16"] == pytest.approx(2 * 4096 * 4096 / 8.5 / 1e3)


def test_fp8_route_second_probe_round_raises_the_floor_before_the_ratio():
    row = {"shape": "llama3-8b qkv", "m": 1, "n": 6144, "k": 4096, "weight_bytes": 25_190_400, "pool": 11,
           "bf16_pool": 6, "stream_us": 8.0, "read_us": None, "w8a8_us": None, "bf16_us": None}
    bw = RecordingBandwidth({"stream_read": 3000.0}, again={"stream_read": 4000.0})
    settle_floor([row], bw)
    floor_us = row["weight_bytes"] / 4000e6 * 1e3
    assert row["stream/floor"] == pytest.approx(8.0 / floor_us) and row["floor_method"] == "stream_read"


def test_o_proj_input_is_timed_as_decode_attention_writes_it():
    k = 4096
    assert attention_group("llama3-8b o_proj", True, 64, k) == k  # per channel: one scale a row
    assert attention_group("qwen3-30b-a3b o_proj", True, 1, k) == k
    assert attention_group("llama3-8b o_proj", True, 8192, k) is None  # past the attention kernel's row counters
    assert attention_group("llama3-8b o_proj", False, 64, k) == HEAD_DIM == 128  # 128x128 blocks: one a head
    assert attention_group("llama3-8b qkv", True, 1, k) is None
    assert attention_group("llama3-8b down", False, 1, 14336) is None


# --- step_breakdown: floors where a floor exists, after the step's own rate and the second probes ----------------


def test_step_breakdown_writes_no_floor_where_there_is_none_and_settles_the_rate_first():
    per = {"matmul": [7.0, 225], "attention": [1.0, 32], "norm": [0.2, 65], "sampling (argmax)": [0.01, 1]}
    weights, kv = 8.0e9, 1.0e9
    # the matmuls read at 1,142.9 GB/s and attention at 1,000; the step's 9 GB in 7.5 ms is 1,200 GB/s, and the
    # replay alone's in 7.45 ms 1,208.1: above both probe rounds (1,000 then 1,200)
    bw = RecordingBandwidth({"matvec": 1000.0}, again={"matvec": 1200.0})
    rows = {r["family"]: r for r in family_rows(per, 7.5, 7.45, weights, kv, bw)}
    assert bw.calls.index("probe_again") > max(i for i, c in enumerate(bw.calls) if c == "observe")
    assert bw.calls.index("floor_ms") > bw.calls.index("probe_again")
    best = (weights + kv) / 7.45 / 1e6
    assert bw.best_method == "decode step (graph replay)" and bw.best_gbs == pytest.approx(best)
    assert rows["matmul"]["floor_ms"] == pytest.approx(weights / (best * 1e6))
    assert rows["attention"]["floor_ms"] == pytest.approx(kv / (best * 1e6))
    assert rows["norm"]["floor_ms"] is None and rows["sampling (argmax)"]["floor_ms"] is None
    assert rows["between kernels (step - sum)"]["floor_ms"] is None
    assert rows["between kernels (step - sum)"]["ms"] == pytest.approx(7.5 - 8.21)
    assert rows["step: graph replay + argmax"]["floor_ms"] == pytest.approx(7.45)
    assert rows["graph replay alone"]["kernels"] == 322


def test_step_breakdown_gives_attention_no_floor_where_other_kernels_read_the_cache():
    # a compressed or sparse model: the indexer and compressor read part of the cache, so the attention kernels'
    # time over the whole cache's bytes would be a rate no kernel reached (it would beat the probes)
    per = {"matmul": [7.0, 225], "attention": [0.01, 6]}
    weights, kv = 8.0e9, 1.0e9
    bw = RecordingBandwidth({"matvec": 1000.0}, again={"matvec": 1200.0})
    rows = {r["family"]: r for r in family_rows(per, 7.5, 7.45, weights, kv, bw, attention_owns_kv=False)}
    assert rows["attention"]["floor_ms"] is None
    assert bw.best_method == "decode step (graph replay)"
    assert rows["step: graph replay + argmax"]["floor_ms"] == pytest.approx(7.45)


# --- ncu_kernels: no samples, no shares ------------------------------------------------------------------------


def test_ncu_stall_shares_are_none_without_samples(tmp_path):
    stall = "smsp__pcsamp_warps_issue_stalled_"
    (tmp_path / "details.csv").write_text(
        '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
        '"0","_fp8_gemv_kernel","Duration","us","5.0"\n"1","_stream_read_kernel","Duration","us","4.0"\n'
        '"2","_decode_split_kernel","Duration","us","9.0"\n')
    (tmp_path / "raw.csv").write_text(
        f'"ID","{stall}long_scoreboard","{stall}wait","{stall}barrier"\n"","","",""\n'
        '"0","0","0","0"\n"1","30","10","n/a"\n"2","6","3","1"\n')
    zero, unknown, sampled = read_report(str(tmp_path / "details.csv"), str(tmp_path / "raw.csv"), ["a", "b", "c"])
    assert zero["stalls"] is None and zero["duration_us"] == 5.0
    assert unknown["stalls"] is None  # a counter ncu left n/a: the shares of the others would be of an unknown total
    assert sampled["stalls"] == {"long_scoreboard": 0.6, "wait": 0.3, "barrier": 0.1}
