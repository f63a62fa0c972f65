"""The dense FP4 GEMM's tile table (kernels/fp4_gemm_config.py): lookup through kernels/tables.py (a table for another
card or version passed over, a malformed entry refused naming its field, a shape it does not list falling back to
the defaults), the defaults' grid on a 132-SM card, and the tuner's candidates and per-preset shapes (the timings
themselves need a GPU)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import triton

from graphserve.kernels import fp4_gemm_config as cfg
from graphserve.kernels import tables
from graphserve.kernels.fp4_gemm_config import Fp4GemmConfig, Fp4GemmTile
from tests.support.tables_utils import isolate_tables, write_table

CARD = "NVIDIA H100 80GB HBM3"
OTHER = "NVIDIA H200"
CUDA = torch.device("cuda")  # named only: the lookup asks the card's name, which the tests fake
O_PROJ = ("nvfp4", 4096, 4096)


def _tile(variant, bm=16, bn=64, bk=None, split=1):
    return {"variant": variant, "block_m": bm, "block_n": bn, "block_k": bk or (32 if variant == "fp8" else 128),
            "group_m": 8, "num_warps": 4, "num_stages": 3, "split_k": split}  # fmt: skip


def _table(device, buckets=None, **extra):
    buckets = buckets or {"16": _tile("bf16", bn=32, split=4), "64": _tile("fp8", bm=64, split=2),
                          "4096": _tile("fp8", bm=128, bn=128)}  # fmt: skip
    return {"device": device, "shapes": [{"fmt": "nvfp4", "n": 4096, "k": 4096, "buckets": buckets}], **extra}


@pytest.fixture
def card(tmp_path, monkeypatch):
    isolate_tables(monkeypatch, tmp_path, CARD)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(cfg, "sm_count", lambda device: 132)
    yield tmp_path
    tables.clear()


def _programs(c: Fp4GemmConfig, m: int, n: int, k: int) -> int:
    from graphserve.kernels.fp4_gemm import k_split

    return triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n) * triton.cdiv(k, k_split(c, k))


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (5120, 2880)])
def test_defaults_fill_the_card(n, k):
    """No table: at decode batches the grid holds about two programs an SM (narrower column tiles, then K split),
    never the one-program-a-64-column-tile grid of before (64 programs for o_proj on 132 SMs)."""
    for m in (9, 16, 33, 64, 128):
        for variant in ("bf16", "fp8"):
            c = cfg.default_config(variant, m, n, k, 16, 132)
            c.check("default", variant, 16, k)
            assert _programs(c, m, n, k) >= 132, (variant, m, c)
            assert (c.block_m < 64) == (m <= 32)  # x the MMA's first operand below 64 rows a tile
    big = cfg.default_config("bf16", 16384, n, k, 16, 132)
    assert (big.block_m, big.block_n, big.split_k) == (128, 64, 1)


def test_without_a_table_a_call_takes_the_rules_variant_and_the_default_tile(card):
    tile = cfg.gemm_tile(*O_PROJ, 64, CUDA, "fp8")
    assert tile == Fp4GemmTile("fp8", cfg.default_config("fp8", 64, 4096, 4096, 16, 132))
    assert cfg.gemm_tile("mxfp4", 40, 80, 20, CUDA, "fp8").variant == "bf16"  # 32 does not divide K
    # prefill rows: dequantized to bf16 for cuBLAS (dequant_fp8 only where a tuned table names it); under
    # DEFAULT_DEQUANT_ROWS not
    assert cfg.gemm_tile(*O_PROJ, 512, CUDA, "fp8") == Fp4GemmTile("dequant", cfg.default_config(
        "dequant", 512, 4096, 4096, 16, 132))  # fmt: skip
    assert cfg.gemm_tile(*O_PROJ, 511, CUDA, "fp8").variant == "fp8"
    line = tables.startup_line(CARD)
    assert "fp4 gemm N=4096,K=4096,nvfp4" in line and "graphserve tune --tables fp4" in line
    tables.clear()
    assert cfg.gemm_tile(*O_PROJ, 64, torch.device("cpu"), "bf16").variant == "bf16"  # CPU: no lookup
    assert tables.startup_line(CARD) is None


def test_dequant_fp8_is_no_default_and_is_refused_without_fp8_tensor_cores(card, monkeypatch):
    """Without a table prefill rows take the bf16 "dequant" on every card, FP8 tensor cores or not; asked for on a
    card without them (below sm_89), "dequant_fp8" is refused naming the card and the limit (fp4_gemm's check)."""
    for cap, fp8 in (((8, 0), False), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert cfg.fp8_tensor_cores(CUDA) == fp8
        assert cfg.gemm_tile(*O_PROJ, 4096, CUDA, "fp8").variant == "dequant", cap
        cfg.gemm_tile.cache_clear()
    assert not cfg.fp8_tensor_cores(torch.device("cpu"))
    cfg.check_fp8_tensor_cores("fp4_gemm", "dequant_fp8", CUDA)  # sm_90: passes
    cfg.check_fp8_tensor_cores("fp4_gemm", "dequant_fp8", torch.device("cpu"))  # the interpreter: passes
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"fp4_gemm: variant='dequant_fp8' multiplies e4m3 on the tensor cores, "
                                         r"sm_89 and later; NVIDIA H100 80GB HBM3 is sm_80"):
        cfg.check_fp8_tensor_cores("fp4_gemm", "dequant_fp8", CUDA)


def test_a_listed_shape_takes_its_buckets_tile_whatever_the_rule_says(card):
    write_table(tables.cache_dir(CARD) / cfg.TABLE_NAME, _table(CARD, versions=tables.versions()))
    tiles = {m: cfg.gemm_tile(*O_PROJ, m, CUDA, "bf16") for m in (9, 16, 17, 64, 65, 100000)}
    assert tiles[9] == tiles[16] == Fp4GemmTile("bf16", Fp4GemmConfig(16, 32, 128, 8, 4, 3, 4))
    assert tiles[17] == tiles[64] == Fp4GemmTile("fp8", Fp4GemmConfig(64, 64, 32, 8, 4, 3, 2))
    assert tiles[65].config.block_n == tiles[100000].config.block_n == 128  # past the largest bucket: the largest
    assert tables.RESOLVED[cfg.table_label(O_PROJ)][0] == "cache"
    # another shape on the same card: the defaults, and the start-up line says so
    assert cfg.gemm_tile("nvfp4", 6144, 4096, 64, CUDA, "bf16").config == cfg.default_config("bf16", 64, 6144, 4096,
                                                                                            16, 132)  # fmt: skip
    assert tables.RESOLVED["fp4 gemm N=6144,K=4096,nvfp4"] == ("defaults", None)


def test_a_shipped_table_serves_where_the_cache_has_none(card):
    write_table(card / "shipped" / tables.card_key(CARD) / cfg.TABLE_NAME, _table(CARD))
    assert cfg.gemm_tile(*O_PROJ, 64, CUDA, "bf16").variant == "fp8"
    assert tables.RESOLVED[cfg.table_label(O_PROJ)][0] == "shipped"


@pytest.mark.parametrize("where, table, field", [
    ("shipped", _table(OTHER), "field 'device' is 'NVIDIA H200', this card is 'NVIDIA H100 80GB HBM3'"),
    ("cache", _table(CARD, versions={"torch": "0", "triton": "0", "graphserve": "0"}), "field 'versions.torch'"),
    ("cache", _table(CARD, {"64": {k: v for k, v in _tile("bf16").items() if k != "variant"}}, versions="now"),
     "KeyError: 'variant'"),
    ("cache", _table(CARD, {"64": {**_tile("bf16"), "blok_m": 16}}, versions="now"), "'blok_m'"),
    ("cache", _table(CARD, {"64": _tile("fp8", bk=64)}, versions="now"),
     "fp4 gemm N=4096,K=4096,nvfp4 bucket 64: the fp8 variant steps 32 columns"),
    ("cache", _table(CARD, {"64": _tile("bf16", bm=8)}, versions="now"), "bucket 64: block_m=8 must be at least 16"),
    ("cache", _table(CARD, {"64": _tile("bf16", split=12)}, versions="now"), "split_k=12 must be 1 to 8"),
    ("cache", _table(CARD, {"0": _tile("bf16")}, versions="now"), "field 'buckets' must hold row counts >= 1"),
    ("cache", _table(CARD, {"64": _tile("dequant")}, versions="now"), "bucket 64: variant 'dequant' serves more than"),
    ("cache", _table(CARD, {"16": _tile("dequant_fp8"), "4096": _tile("dequant_fp8")}, versions="now"),
     "bucket 16: variant 'dequant_fp8' serves more than 64 rows only"),
    ("cache", _table(CARD, {"4096": _tile("dequant_fp8", bk=24)}, versions="now"),
     "bucket 4096: block_k=24 must be a power of two"),
    ("cache", _table(CARD, {"4096": {**_tile("dequant_fp8"), "variant": "fp4"}}, versions="now"),
     "bucket 4096: variant='fp4' must be one of ('bf16', 'fp8', 'dequant', 'dequant_fp8')"),
])  # fmt: skip
def test_a_table_for_another_card_or_version_or_with_a_bad_entry_is_passed_over(card, caplog, where, table, field):
    if table.get("versions") == "now":
        table = {**table, "versions": tables.versions()}
    base = tables.cache_dir(CARD) if where == "cache" else card / "shipped" / tables.card_key(CARD)
    bad = write_table(base / cfg.TABLE_NAME, table)
    with caplog.at_level(logging.INFO, logger="graphserve.tables"):
        tile = cfg.gemm_tile(*O_PROJ, 64, CUDA, "bf16")
    assert tile == Fp4GemmTile("bf16", cfg.default_config("bf16", 64, 4096, 4096, 16, 132))
    message = next(r.getMessage() for r in caplog.records if str(bad) in r.getMessage())
    assert field in message
    assert tables.RESOLVED[cfg.table_label(O_PROJ)] == ("defaults", None)


def test_the_tuner_measures_the_presets_dense_shapes_from_the_default_tile():
    from graphserve.tuning import fp4_gemm

    assert fp4_gemm.dense_shapes("dummy:llama3-8b") == {"qkv": (6144, 4096), "o": (4096, 4096),
                                                        "gate_up": (28672, 4096), "down": (4096, 14336)}  # fmt: skip
    assert fp4_gemm.dense_shapes("gpt-oss-20b") == {"qkv": (5120, 2880), "o": (2880, 4096)}  # experts: not dense
    assert fp4_gemm.dense_shapes("deepseek-v4-flash-l6") == {}
    for variant in cfg.VARIANTS:
        for m in (8, 64, 128, 4096) if variant not in cfg.DEQUANT_VARIANTS else (128, 4096):
            tiles = fp4_gemm.candidates(variant, m, 5120, 2880, 16, 132, quick=False)
            assert tiles[0] == cfg.default_config(variant, m, 5120, 2880, 16, 132) and len(set(tiles)) == len(tiles)
            for t in tiles:
                t.check("candidate", variant, 16, 2880)
            assert len(fp4_gemm.candidates(variant, m, 5120, 2880, 16, 132, quick=True)) <= fp4_gemm.QUICK_CANDIDATES
    assert fp4_gemm.candidates("fp8", 64, 64, 80, 16, 132, quick=False) == []  # 32 does not divide K
    for variant in cfg.DEQUANT_VARIANTS:  # decode rows: not timed
        assert fp4_gemm.candidates(variant, 64, 5120, 2880, 16, 132, quick=False) == []
    assert fp4_gemm.candidates("dequant_fp8", 4096, 5120, 2880, 32, 132, quick=False) == \
        fp4_gemm.candidates("dequant", 4096, 5120, 2880, 32, 132, quick=False)  # the same conversion tiles
    assert [c.block_n for c in fp4_gemm.candidates("dequant", 4096, 5120, 2880, 32, 132, quick=False)] == [32, 64, 32]


def test_the_sweep_keeps_each_rows_fastest_tile_and_stops_at_its_time_share(card, monkeypatch):
    """measure_projection's logic on the CPU with the timings faked (a GPU times the real calls): the fp8 variant
    fastest at 64 rows with split-K, dequant at 128 and dequant_fp8 at 4096 (handed each weight's row scales), the
    streaming kernel only at 1 row; a spent share leaves out later rows; the table it writes is what the reader takes,
    and the rule comes from the same rows."""
    from graphserve.tuning import fp4 as bench
    from graphserve.tuning import fp4_gemm

    monkeypatch.setattr(fp4_gemm, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(bench, "copies_for", lambda nbytes: 2)
    monkeypatch.setattr(bench, "fp4_weights", lambda n, k, fmt, copies: [(None, None, None)] * copies)
    monkeypatch.setattr(fp4_gemm, "fp8_tensor_cores", lambda device: True)
    monkeypatch.setattr(fp4_gemm, "fp8_row_scales", lambda packed, scale, fmt: f"row scales {fmt}")

    def fake_ms(calls):
        m = calls[0].args[0].shape[0]
        if "config" not in calls[0].keywords:  # the streaming kernel
            return 0.01 * m
        variant, c = calls[0].keywords["variant"], calls[0].keywords["config"]
        if variant == "dequant_fp8":
            assert all(c.keywords["fp8_row_scale"].startswith("row scales") for c in calls)
        base = {"bf16": 0.5, "fp8": 0.3, "dequant": 0.02 if m >= 128 else 5.0,
                "dequant_fp8": 0.01 if m >= 1024 else 5.0}[variant]  # fmt: skip
        return base / c.split_k + 0.001 * c.block_n

    monkeypatch.setattr(bench, "graph_ms", fake_ms)
    rows = fp4_gemm.measure_projection("dummy:llama3-8b", "o", 1e6, True, 132, CARD)
    assert sorted({r["m"] for r in rows}) == [1, 16, 64, 128, 4096]
    kernels = {(r["m"], r["kernel"]) for r in rows if r["fmt"] == "nvfp4"}
    assert (1, "fp4 stream") in kernels and (1, "fp4 gemm bf16") not in kernels  # below 8 rows: no GEMM
    assert (64, "fp4 gemm dequant") not in kernels and (128, "fp4 gemm dequant") in kernels
    assert (64, "fp4 gemm dequant_fp8") not in kernels and (4096, "fp4 gemm dequant_fp8") in kernels
    table = fp4_gemm.table_from(rows, None, CARD)
    entry = cfg.Fp4GemmTable.from_json(table).shapes[O_PROJ]
    assert entry.buckets == (16, 64, 128, 4096)
    assert entry.tile(64).variant == "fp8" and entry.tile(64).config.split_k > 1
    assert entry.tile(128).variant == "dequant" and entry.tile(4096).variant == "dequant_fp8"
    rule = bench.derive_rule(rows, CARD)["shapes"][0]
    assert rule == {"fmt": "nvfp4", "n": 4096, "k": 4096, "stream_max_rows": 1, "fp8_min_rows": 16}
    write_table(tables.cache_dir(CARD) / cfg.TABLE_NAME, {**table, **tables.stamp(CARD)})
    assert cfg.gemm_tile(*O_PROJ, 50, CUDA, "bf16") == entry.tile(64)

    clock = iter(range(0, 10**6, 100))  # every check of the clock: 100 s later
    monkeypatch.setattr(fp4_gemm.time, "monotonic", lambda: next(clock))
    short = fp4_gemm.measure_projection("dummy:llama3-8b", "o", 150, True, 132, CARD)
    assert sorted({r["m"] for r in short}) == [64, 4096]  # the share spent after one row count past it


def test_the_plan_counts_the_dequant_variants_weight_in_the_prefill_peak():
    """`graphserve plan` of an NVFP4 Llama-3-8B: the prefill peak holds gate_up dequantized to bf16 (the dequant
    variant's transient weight); a bf16 model's plan does not, nor do decode rows the variant never serves."""
    from graphserve.analysis.plan import build_plan, load_hf_config
    from graphserve.models.registry import describe_model

    hf = load_hf_config(str(Path(__file__).resolve().parents[1] / "data" / "llama3_8b_config.json"))
    fp4, bf16 = (build_plan(hf, gpu_memory_gb=80, quantization=q, chunked_prefill_size=2048) for q in ("nvfp4", "none"))
    gate_up = 28672 * 4096 * 2
    assert fp4["prefill_activation_bytes"] - gate_up == describe_model(hf, torch.bfloat16, 1).activation_bytes(
        2048, sampled_rows=2)  # fmt: skip
    assert "FP4 dequant" in fp4["table"] and "FP4 dequant" not in bf16["table"]
    assert bf16["prefill_activation_bytes"] == fp4["prefill_activation_bytes"] - gate_up
    small = build_plan(hf, gpu_memory_gb=80, quantization="nvfp4", chunked_prefill_size=64, input_len=64)
    assert "FP4 dequant" not in small["table"]


def test_the_plan_counts_the_larger_of_the_two_dequant_variants_transients():
    """dequant_fp8 holds the weight at a byte a weight (half of dequant's bf16) beside x quantized per token: at a
    chunk of 32768 rows down's (x 14336 wide) passes dequant's largest, gate_up at two bytes a weight, and the plan
    counts it."""
    from graphserve.analysis.plan import build_plan, load_hf_config
    from graphserve.models.registry import describe_model

    hf = load_hf_config(str(Path(__file__).resolve().parents[1] / "data" / "llama3_8b_config.json"))
    rows, n, k = 32768, 4096, 14336
    fp4 = build_plan(hf, gpu_memory_gb=80, quantization="nvfp4", chunked_prefill_size=rows)
    base = describe_model(hf, torch.bfloat16, 1).activation_bytes(rows, sampled_rows=rows // 1024)
    assert fp4["prefill_activation_bytes"] - base == n * k + rows * (k + 4) > 2 * 28672 * 4096
