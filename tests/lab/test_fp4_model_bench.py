"""benchmarks/fp4_model.py on CPU: the rows' ratios, comparisons and targets from given step times and ceilings (no
GPU), judged on unrounded numbers; the gpt-oss reference figure is never a measured row."""

from __future__ import annotations

import pytest

from benchmarks.fp4_model import AS_FP8, DECODE_TARGETS, GPT_OSS, LLAMA, add_ratios, decode_rows, prefill_rows
from benchmarks.fp8 import MatmulPeak
from benchmarks.roofline import ReadBandwidth


def _run(step_ms: float, read: float, prefill_ms: float | None = None) -> dict:
    steps = {(1, 512): {"step_ms": step_ms, "read_bytes": read, "flops": 2e10},
             (64, 2048): {"step_ms": 8 * step_ms, "read_bytes": 4 * read, "flops": 1e12}}
    return {"steps": steps, "prefill_ms": prefill_ms, "prefill_tflops": 400.0}


def test_fp4_rows_meet_targets_on_unrounded_numbers():
    bw = ReadBandwidth({"stream_read": 3000.0})  # GB/s: 3e9 bytes a ms
    bf16, fp8 = MatmulPeak({"probe": 700.0}), MatmulPeak({"probe": 1400.0})
    cases = [(1, 512), (64, 2048)]
    none, fp8_run = _run(6.0, 16e9, 100.0), _run(3.5, 9e9, 60.0)
    nvfp4 = _run(2.7, 5.4e9, 119.0)  # bs 1: exactly 1.5 x its floor (5.4 GB at 3 TB/s = 1.8 ms)
    label = f"{LLAMA} --quantization nvfp4"
    rows = decode_rows(label, nvfp4, cases, "card", none, fp8_run)
    rows += decode_rows(f"{GPT_OSS} (mxfp4 experts as published)", _run(4.0, 6e9), [(1, 512)], "card")
    prefill = prefill_rows({"nvfp4": nvfp4, "fp8": fp8_run, "none": none}, "card")
    add_ratios(rows, prefill, bw, bf16, fp8)
    bs1, bs64, oss = rows
    assert bs1["floor_ms"] == pytest.approx(1.8) and bs1["ratio"] == pytest.approx(1.5)
    assert bs1["vs_bf16"] == pytest.approx(0.45) and bs1["vs_fp8"] == pytest.approx(2.7 / 3.5)
    assert bs1["target"] == DECODE_TARGETS[(label, 1, 512)]
    assert bs1["meets_target"] is (bs1["ratio"] <= 1.5 and bs1["vs_bf16"] <= 0.45)
    # bs 64: 21.6 GB read in 21.6 ms at 3 TB/s is 7.2 ms; 1e12 FLOPs at 700 TFLOP/s is 1.43 ms: read-bound, 3x
    assert bs64["floor_bound"] == "read" and bs64["ratio"] == pytest.approx(3.0) and bs64["meets_target"] is False
    assert oss["ratio"] == pytest.approx(2.0) and oss["meets_target"] is False and "vs_bf16" not in oss
    fp4_prefill = next(r for r in prefill if r["model"] == label)
    assert fp4_prefill["vs_fp8"] == pytest.approx(60.0 / 119.0) and fp4_prefill["meets_target"] is True
    assert next(r for r in prefill if r["model"].endswith("fp8"))["meets_target"] is None
    # the same step a little slower fails the bound it sat on
    slow = decode_rows(label, _run(2.7001, 5.4e9, 119.0), cases[:1], "card", none, fp8_run)
    add_ratios(slow, [], bw, bf16, fp8)
    assert slow[0]["meets_target"] is False


def test_the_fp4_load_as_fp8_rows_take_fp8_ceilings_and_no_fp4_target():
    """The NVFP4 model converted to FP8 at load: its floor from its own (FP8) bytes, the FP8 matmul peak, its step
    over the FP4 model's, and none of the FP4 targets (its prefill is no NVFP4 prefill)."""
    bw = ReadBandwidth({"stream_read": 3000.0})
    bf16, fp8 = MatmulPeak({"probe": 700.0}), MatmulPeak({"probe": 1400.0})
    none, fp8_run, nvfp4 = _run(6.0, 16e9, 100.0), _run(3.5, 9e9, 60.0), _run(2.7, 5.4e9, 119.0)
    as_fp8 = _run(3.6, 9e9, 62.0)
    label = f"{LLAMA} --quantization {AS_FP8}"
    rows = decode_rows(label, as_fp8, [(1, 512), (64, 2048)], "card", none, fp8_run, nvfp4)
    prefill = prefill_rows({"nvfp4": nvfp4, AS_FP8: as_fp8, "fp8": fp8_run, "none": none}, "card")
    add_ratios(rows, prefill, bw, bf16, fp8)
    bs1, bs64 = rows
    assert bs1["peak_tflops"] == 1400.0 and bs1["floor_ms"] == pytest.approx(3.0) and bs1["ratio"] == pytest.approx(1.2)
    assert bs1["vs_nvfp4"] == pytest.approx(3.6 / 2.7) and bs1["vs_fp8"] == pytest.approx(3.6 / 3.5)
    assert bs1["target"] is None and bs1["meets_target"] is None and bs64["target"] is None
    row = next(r for r in prefill if r["model"] == label)
    assert row["vs_fp8"] == pytest.approx(60.0 / 62.0) and row["target"] is None and row["meets_target"] is None


def test_only_gpt_oss_is_parsed_and_refused_beside_what_it_leaves_out():
    from benchmarks.fp4_model import parse_args

    args = parse_args(["--only", "gpt-oss"])
    assert args.only == "gpt-oss" and not args.skip_gpt_oss and args.result_name == "fp4_decode"
    assert parse_args([]).only is None
    with pytest.raises(SystemExit):
        parse_args(["--only", "gpt-oss", "--skip-gpt-oss"])
    with pytest.raises(SystemExit):
        parse_args(["--only", "gpt-oss", "--widenings", "word"])
    with pytest.raises(SystemExit):
        parse_args(["--only", "llama"])


def test_only_gpt_oss_runs_that_model_alone_and_merges_its_rows(monkeypatch, tmp_path, capsys):
    """--only gpt-oss: no llama3-8b model runs; the gpt-oss rows at bs 1 and 8 join the file's earlier rows, whose
    prefill and accuracy tables stay; the SGLang figure is recorded as not measured here."""
    import json

    from benchmarks import common, fp4_model
    from graphserve.tuning.timing import start_run

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    earlier = {"model": f"{LLAMA} --quantization nvfp4", "bs": 1, "ctx": 512, "step_ms": 2.7}
    common.merge_rows("fp4_decode", [earlier], prefill=[{"model": LLAMA, "ms": 119.0}],
                      accuracy=[{"model": LLAMA, "top1_agreement": 0.9}])
    bw = ReadBandwidth({"stream_read": 3000.0})
    monkeypatch.setattr(fp4_model, "probes", lambda: ("card", bw, MatmulPeak({"p": 700.0}), MatmulPeak({"p": 1400.0})))
    monkeypatch.setattr(fp4_model, "settle_ceilings", lambda *a: None)
    monkeypatch.setattr(fp4_model, "release_gpu_memory", lambda: None)
    loaded = []

    def run_model(name, quantization, cases, bw, prefill):
        loaded.append((name, quantization, cases))
        steps = {c: {"step_ms": 4.0 * c[0] ** 0.5, "read_bytes": 6e9, "flops": 1e10} for c in cases}
        return {"steps": steps}

    monkeypatch.setattr(fp4_model, "run_model", run_model)
    start_run()  # a second run: the earlier row keeps naming the first
    fp4_model.main(["--only", "gpt-oss"])
    assert loaded == [(GPT_OSS, "none", [(1, 512), (8, 512)])]
    data = json.loads((tmp_path / "fp4_decode.json").read_text())
    oss = [r for r in data["rows"] if r["model"].startswith(GPT_OSS)]
    assert [(r["bs"], r["ctx"]) for r in oss] == [(1, 512), (8, 512)]
    assert oss[0]["ratio"] == pytest.approx(2.0) and oss[0]["meets_target"] is False  # 4 ms over 6 GB at 3 TB/s
    assert oss[0]["tok_s"] == pytest.approx(250.0) and oss[1]["target"] is None
    assert any(r["model"] == earlier["model"] and r["step_ms"] == 2.7 for r in data["rows"])
    assert data["prefill"][0]["ms"] == 119.0 and data["accuracy"][0]["top1_agreement"] == 0.9
    ref = data["reference"]["gpt-oss-120b"]
    assert ref["measured_here"] is False and ref["tok_s"] == 318.5
    (ceilings,) = data["ceilings"].values()  # this run's, which its rows name; the earlier run stored none
    assert ceilings["measured_at"]["run_id"] == oss[0]["measured_at"]["run_id"] != data["rows"][0]["measured_at"]["run_id"]
    out = capsys.readouterr().out
    assert "250.0 tok/s on one card (this run), 2.00 x its floor" in out and "NOT from this run" in out


def test_the_dequant_fp8_prefill_row_takes_the_nvfp4_target_and_the_override_only_past_decode_rows():
    """The NVFP4 model with its prefill GEMMs forced onto dequant_fp8: its prefill row is an NVFP4 prefill (the
    0.5 x FP8 target); the override takes every call past 64 rows, leaves decode rows to the table and is undone."""
    import torch

    from benchmarks.fp4_model import DEQUANT_FP8, dequant_fp8_prefill
    from graphserve.kernels import fp4_gemm

    none, fp8_run, nvfp4, forced = _run(6.0, 16e9, 100.0), _run(3.5, 9e9, 60.0), _run(2.7, 5.4e9, 150.0), \
        _run(2.7, 5.4e9, 110.0)  # fmt: skip
    prefill = prefill_rows({"nvfp4": nvfp4, DEQUANT_FP8: forced, "fp8": fp8_run, "none": none}, "card")
    add_ratios([], prefill, ReadBandwidth({"stream_read": 3000.0}), MatmulPeak({"p": 700.0}), MatmulPeak({"p": 1400.0}))
    by_model = {r["model"]: r for r in prefill}
    assert by_model[f"{LLAMA} --quantization nvfp4"]["meets_target"] is False  # 60 / 150 < 0.5
    assert by_model[f"{LLAMA} --quantization {DEQUANT_FP8}"]["meets_target"] is True  # 60 / 110
    table_tile = fp4_gemm.gemm_tile
    cpu = torch.device("cpu")
    with dequant_fp8_prefill():
        assert fp4_gemm.gemm_tile("nvfp4", 4096, 4096, 65, cpu, "bf16").variant == "dequant_fp8"
        assert fp4_gemm.gemm_tile("nvfp4", 4096, 4096, 64, cpu, "fp8").variant == "fp8"
    assert fp4_gemm.gemm_tile is table_tile
