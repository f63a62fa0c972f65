"""Per-card tables: the tune cache's keys and paths, the lookup order (cache, shipped per card, shipped beside the
reader, defaults), the refusal of a table written for another card or version, the start-up line, and
`graphserve tune`'s arguments and time bounds (the measurements replaced by fakes: they need a GPU)."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch

from graphserve import cli
from graphserve.errors import ConfigError
from graphserve.kernels import gemv_config, moe_config, tables
from graphserve.tuning import cli as tune_cli
from graphserve.tuning import runner
from graphserve.tuning.runner import TablePlan, output_dir, run_table
from tests.support.tables_utils import isolate_tables, write_table

CARD = "NVIDIA H100 80GB HBM3"
OTHER = "NVIDIA H200"


def gemv_table(device: str, rows: int, **extra) -> dict:
    return {"device": device, "shapes": [{"name": "s", "n": 64, "k": 32, "linear": rows}], **extra}


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """Cache, shipped-per-card and beside-the-reader folders, all under tmp_path; every lookup forgotten before
    and after."""
    isolate_tables(monkeypatch, tmp_path)
    gemv_config.rule_for.cache_clear()
    yield tmp_path
    tables.clear()
    gemv_config.rule_for.cache_clear()


def test_cache_is_keyed_by_card_and_versions(tmp_path, monkeypatch):
    assert tables.card_key("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert tables.card_key("NVIDIA RTX PRO 6000 Blackwell Server Edition") == \
        "NVIDIA_RTX_PRO_6000_Blackwell_Server_Edition"  # fmt: skip
    v = {"torch": "2.11.0+cu130", "triton": "3.6.0", "graphserve": "0.1.0"}
    assert tables.version_key(v) == "torch-2.11.0+cu130_triton-3.6.0_graphserve-0.1.0"
    monkeypatch.setenv("GRAPHSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert tables.cache_dir(CARD, v) == (tmp_path / "c" / "tables" / "NVIDIA_H100_80GB_HBM3" /
                                         "torch-2.11.0+cu130_triton-3.6.0_graphserve-0.1.0").resolve()  # fmt: skip
    assert tables.cache_dir(CARD, {**v, "triton": "3.7.0"}) != tables.cache_dir(CARD, v)
    assert tables.cache_dir(OTHER, v) != tables.cache_dir(CARD, v)
    monkeypatch.delenv("GRAPHSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tables.cache_root() == (tmp_path / "xdg" / "graphserve").resolve()
    assert not tables.inside_package(tables.cache_root())
    assert set(tables.versions()) == set(tables.VERSIONED) and tables.versions()["torch"] == torch.__version__


def test_lookup_takes_the_cache_then_the_shipped_tables_then_the_defaults(dirs):
    cache = write_table(tables.cache_dir(CARD) / "gemv_rule.json", gemv_table(CARD, 4, versions=tables.versions()))
    shipped = write_table(dirs / "shipped" / "NVIDIA_H100_80GB_HBM3" / "gemv_rule.json", gemv_table(CARD, 2))
    beside = write_table(dirs / "kernels" / "gemv_rule.json", gemv_table(CARD, 1))
    parse = gemv_config.GemvRule.from_json
    for path, rows in ((cache, 4), (shipped, 2), (beside, 1)):
        found = tables.find("gemv_rule.json", CARD, parse, "gemv")
        assert found.path == path and found.table.max_rows("linear", 64, 32) == rows
        assert tables.RESOLVED["gemv"][1] == path
        path.unlink()
        tables.clear()
    assert tables.find("gemv_rule.json", CARD, parse, "gemv") is None
    assert tables.RESOLVED["gemv"] == ("defaults", None)


def test_the_reader_routes_by_the_table_the_lookup_found(dirs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: CARD)
    write_table(dirs / "kernels" / "gemv_rule.json", gemv_table(OTHER, 8))  # the other card's shipped table
    assert gemv_config.rule_for(torch.device("cuda")).limits == {}
    write_table(tables.cache_dir(CARD) / "gemv_rule.json", gemv_table(CARD, 3, versions=tables.versions()))
    tables.clear()
    gemv_config.rule_for.cache_clear()
    assert gemv_config.rule_for(torch.device("cuda")).max_rows("linear", 64, 32) == 3


@pytest.mark.parametrize("table, field", [
    (gemv_table(OTHER, 4, versions="now"), "field 'device' is 'NVIDIA H200', this card is 'NVIDIA H100 80GB HBM3'"),
    ({"shapes": []}, "field 'device' is missing"),
    (gemv_table(CARD, 4), "field 'versions' is missing"),
    ("versions.triton", "field 'versions.triton' is '0.0.1'"),
    ("{not json", "not readable JSON"),
    ({"device": CARD, "versions": "now", "shapes": [{"n": 1, "linear": 2}]}, "KeyError: 'k'"),
])  # fmt: skip
def test_a_table_for_another_card_or_version_is_passed_over_by_file_and_field(dirs, caplog, table, field):
    if table == "versions.triton":
        table = gemv_table(CARD, 4, versions={**tables.versions(), "triton": "0.0.1"})
    elif isinstance(table, dict) and table.get("versions") == "now":
        table["versions"] = tables.versions()
    bad = write_table(tables.cache_dir(CARD) / "gemv_rule.json", table)
    shipped = write_table(dirs / "shipped" / "NVIDIA_H100_80GB_HBM3" / "gemv_rule.json", gemv_table(CARD, 2))
    with caplog.at_level(logging.INFO, logger="graphserve.tables"):
        found = tables.find("gemv_rule.json", CARD, gemv_config.GemvRule.from_json, "gemv")
    assert found.path == shipped  # the next candidate serves
    record = next(r for r in caplog.records if str(bad) in r.getMessage())
    assert field in record.getMessage() and record.levelno == logging.WARNING


def test_shipped_moe_tables_of_other_cards_are_passed_over_quietly(dirs, caplog, monkeypatch):
    monkeypatch.setattr(moe_config, "CONFIG_DIR", dirs / "kernels" / "moe_configs")
    moe_config._load.cache_clear()
    tiles = moe_config.default_tiles(8)
    name = moe_config.table_path(8, 64, 32, torch.bfloat16, "NVIDIA_H100_80GB_HBM3").name
    # a file renamed from another card's: the name says this card, its device field does not
    write_table(dirs / "kernels" / "moe_configs" / name, {"device": "NVIDIA_H200", **tiles.to_json()})
    with caplog.at_level(logging.INFO, logger="graphserve.tables"):
        assert moe_config._load(8, 64, 32, torch.bfloat16, "NVIDIA_H100_80GB_HBM3") == tiles
    passed = [r for r in caplog.records if r.name == "graphserve.tables"]
    assert len(passed) == 1 and passed[0].levelno == logging.INFO and "field 'device'" in passed[0].getMessage()
    assert tables.RESOLVED["moe E=8,I=64,H=32,bfloat16"] == ("defaults", None)
    moe_config._load.cache_clear()


def test_startup_line_names_the_tables_that_serve_and_the_command_for_the_rest(dirs, caplog, monkeypatch):
    assert tables.startup_line(CARD) is None  # nothing looked up: nothing to say
    write_table(dirs / "shipped" / "NVIDIA_H100_80GB_HBM3" / "gemv_rule.json", gemv_table(CARD, 2))
    tables.find("gemv_rule.json", CARD, gemv_config.GemvRule.from_json, "gemv")
    tables.find("fp8_rule.json", CARD, json.loads, "fp8")
    tables.find("moe_configs/x.json", CARD, json.loads, "moe E=128,I=768,H=2048,bfloat16")
    line = tables.startup_line(CARD, "dummy:qwen3-30b-a3b")
    assert line == ("kernel tables on NVIDIA H100 80GB HBM3: tuned: gemv (shipped); defaults: fp8, "
                    "moe E=128,I=768,H=2048,bfloat16 (measure them: graphserve tune --model dummy:qwen3-30b-a3b "
                    "--tables fp8 moe)")  # fmt: skip
    from graphserve.engine import startup

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: CARD)
    with caplog.at_level(logging.INFO, logger="graphserve.startup"):
        startup.log_tables(torch.device("cuda"), "dummy:qwen3-30b-a3b")
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "graphserve.startup"] == \
        [(logging.WARNING, line)]  # fmt: skip


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    tune_cli.add_arguments(p)
    argv = []
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}", *([str(v) for v in value] if isinstance(value, list) else
                                                 [] if value is True else [str(value)])]  # fmt: skip
    return p.parse_args(argv)


def test_tune_arguments_are_checked_by_flag_and_limit():
    models, budget, shapes = tune_cli.check_args(_args(quick=True))
    assert models == ["dummy:llama3-8b", "dummy:qwen3-30b-a3b"] and budget == tune_cli.QUICK_BUDGET_S
    assert shapes == []
    models, budget, _ = tune_cli.check_args(_args(model=["qwen3-0.6b"], budget_s=12))
    assert models == ["dummy:qwen3-0.6b"] and budget == 12
    models, _, shapes = tune_cli.check_args(_args(tables=["moe"], experts=64, hidden=2048, intermediate=1408, top_k=6))
    assert shapes == [(64, 2048, 1408, 6)] and models == []  # that shape alone, not the presets' as well
    for kw, field in [({"model": ["dummy:nope"]}, "--model dummy:nope is not a preset"),
                      ({"budget_s": 0}, "--budget-s 0.0 is invalid"),
                      ({"experts": 8, "tables": ["moe"]}, "needs all of --experts, --hidden and --intermediate"),
                      ({"experts": 8, "hidden": 64, "intermediate": 0, "tables": ["moe"]}, "--intermediate 0"),
                      ({"experts": 8, "hidden": 64, "intermediate": 32, "top_k": 9, "tables": ["moe"]},
                       "--top-k 9 exceeds --experts 8"),
                      ({"experts": 8, "hidden": 64, "intermediate": 32, "tables": ["gemv"]}, "add moe to --tables")]:
        with pytest.raises(ConfigError, match=field):
            tune_cli.check_args(_args(**kw))
    with pytest.raises(SystemExit):
        _args(tables=["gemm"])


def test_tune_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "--quick"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err


def _plan(table: str, units: list[str], clock: list[float], cost: float, fail: str | None = None) -> TablePlan:
    shares = []

    def measure(unit: str, left: float) -> dict:
        shares.append(left)
        clock[0] += cost
        if unit == fail:
            raise RuntimeError("out of shared memory")
        return {"unit": unit}

    def finish(results, earlier):
        before = earlier(f"{table}.json") or {"units": []}
        return [(f"{table}.json", {"units": before["units"] + [r["unit"] for _, r in results]})]

    plan = TablePlan(table, units, measure, finish)
    plan.shares = shares  # type: ignore[attr-defined]
    return plan


def test_a_table_stops_at_its_budget_and_writes_what_was_measured(tmp_path):
    clock = [0.0]
    plan = _plan("gemv", ["a", "b", "c", "d", "e"], clock, cost=10.0, fail="b")
    report = run_table(plan, 25.0, tmp_path, CARD, clock=lambda: clock[0], progress=False)
    assert report.measured == ["a", "c"] and report.failed[0].startswith("b: RuntimeError: out of shared memory")
    assert report.skipped == ["d", "e"] and report.seconds == 30.0
    assert plan.shares == [25.0 / 5, 15.0 / 4, 5.0 / 3]  # each unit's even share of what is left
    written = json.loads((tmp_path / "gemv.json").read_text())
    assert written["units"] == ["a", "c"] and written["device"] == CARD and written["versions"] == tables.versions()
    assert "budget spent before d, e" in report.line() and "failed: b" in report.line()
    # the first unit runs however small the budget; a second run keeps the first's entries (``earlier``)
    plan = _plan("gemv", ["f", "g"], clock, cost=100.0)
    report = run_table(plan, 1.0, tmp_path, CARD, clock=lambda: clock[0], progress=False)
    assert report.measured == ["f"] and report.skipped == ["g"]
    assert json.loads((tmp_path / "gemv.json").read_text())["units"] == ["a", "c", "f"]


def test_a_first_tune_into_the_cache_starts_from_the_shipped_table_for_the_card(dirs):
    """``earlier`` of a table the cache does not hold yet is the card's shipped one: the file the tune writes keeps
    the shipped shapes it did not measure (the engine reads the cache first)."""
    write_table(dirs / "shipped" / "NVIDIA_H100_80GB_HBM3" / "gemv.json", {"device": CARD, "units": ["shipped"]})
    write_table(dirs / "shipped" / "NVIDIA_H200" / "other.json", {"device": OTHER, "units": ["h200"]})
    clock = [0.0]
    for table in ("gemv", "other"):
        report = run_table(_plan(table, ["new"], clock, cost=1.0), 10.0, tables.cache_dir(CARD), CARD,
                           clock=lambda: clock[0], progress=False)  # fmt: skip
        assert report.measured == ["new"]
    assert json.loads((tables.cache_dir(CARD) / "gemv.json").read_text())["units"] == ["shipped", "new"]
    assert json.loads((tables.cache_dir(CARD) / "other.json").read_text())["units"] == ["new"]  # another card's: not


def test_tables_go_to_the_cache_or_out_never_into_the_installed_package(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert output_dir(None, CARD) == tables.cache_dir(CARD)
    assert output_dir(tmp_path / "t", CARD) == tmp_path / "t" / "NVIDIA_H100_80GB_HBM3"
    shipped = tables.PACKAGE_DIR / "kernels" / "tables"
    monkeypatch.setattr(tables, "installed_package", lambda: False)
    assert output_dir(shipped, CARD) == shipped / "NVIDIA_H100_80GB_HBM3"  # a source checkout's shipped tables
    monkeypatch.setattr(tables, "installed_package", lambda: True)
    with pytest.raises(ConfigError, match="--out puts the tables in .* inside the installed graphserve package"):
        output_dir(shipped, CARD)
    monkeypatch.setenv("GRAPHSERVE_CACHE_DIR", str(tables.PACKAGE_DIR / "cache"))
    with pytest.raises(ConfigError, match=r"\$GRAPHSERVE_CACHE_DIR puts the tables in"):
        output_dir(None, CARD)


def test_tune_writes_tables_the_engine_then_reads(dirs, monkeypatch, capsys):
    """The whole command on fake measurements: its files land in the cache and pass the lookup's checks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: CARD)
    built = {}

    def build_plans(which, models, quick, shapes, dtypes):
        built.update(tables=which, models=models, quick=quick)

        def finish(results, earlier):
            return [("gemv_rule.json", gemv_table("ignored: the stamp names the card", 5))]

        return [TablePlan("gemv", ["qwen3-0.6b down"], lambda unit, left: None, finish)]

    monkeypatch.setattr("graphserve.tuning.measure.build_plans", build_plans)
    monkeypatch.setattr(runner, "tqdm", lambda **kw: _NoBar())
    assert cli.main(["tune", "--quick", "--tables", "gemv", "--model", "dummy:qwen3-0.6b"]) == 0
    assert built == {"tables": ["gemv"], "models": ["dummy:qwen3-0.6b"], "quick": True}
    assert "gemv: 1/1 units" in capsys.readouterr().out
    found = tables.find("gemv_rule.json", CARD, gemv_config.GemvRule.from_json, "gemv")
    assert found.source == "cache" and found.table.max_rows("linear", 64, 32) == 5


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set_postfix_str(self, _text):
        pass

    def update(self, _n):
        pass


def test_plans_cut_each_table_into_the_models_shapes_and_derive_rules_as_the_benchmarks_do(monkeypatch):
    """The plans over the benchmarks' measurement functions, built with the GPU's answers faked: their units, and
    the rules their finish derives from rows shaped as the benchmarks' (the timings themselves need a GPU)."""
    from graphserve.tuning import measure

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: CARD)
    monkeypatch.setattr("graphserve.kernels.common.sm_count", lambda device: 132)
    monkeypatch.setattr("graphserve.kernels.fp8_gemm.blockwise_scaled_mm_available", lambda device: True)
    monkeypatch.setattr(measure, "environment", lambda: {"device": CARD, "date": "d", "commit": "c"})
    plans = {p.table: p for p in measure.build_plans(list(measure.TABLES), list(measure.QUICK_MODELS), True,
                                                     [(64, 2048, 1408, 6)], None)}  # fmt: skip
    assert set(plans) == {"gemv", "fp8", "moe", "fp4"}  # no latent attention in these presets
    assert plans["gemv"].units[:4] == ["llama3-8b qkv", "llama3-8b o_proj", "llama3-8b gate_up", "llama3-8b down"]
    assert plans["gemv"].units[4:] == ["qwen3-30b-a3b qkv", "qwen3-30b-a3b o_proj", "qwen3-30b-a3b router"]
    assert plans["fp8"].units[0] == "llama3-8b qkv block128" and len(plans["fp8"].units) == 6
    assert plans["moe"].units == ["E=128 H=2048 I=768 k=8 bfloat16", "E=64 H=2048 I=1408 k=6 bfloat16"]
    # no model named (the default list, --quick): Llama-3-8B's dense projections, then the FP4 presets' experts
    llama = ["dense llama3-8b qkv", "dense llama3-8b o", "dense llama3-8b gate_up", "dense llama3-8b down"]
    assert plans["fp4"].units == llama + ["experts deepseek-v4-flash-l6", "experts qwen3-30b-a3b"]
    assert measure.fp4_plan(list(measure.DEFAULT_MODELS), quick=False).units[:6] == llama + [
        "dense gpt-oss-20b qkv", "dense gpt-oss-20b o"]  # fmt: skip
    # named: their dense shapes, each once (gpt-oss-120b's attention is the 20b's; mistral-7b's are llama's)
    assert measure.fp4_plan(["dummy:gpt-oss-20b", "dummy:llama3-8b", "dummy:gpt-oss-120b", "dummy:mistral-7b"],
                            quick=True).units == ["dense gpt-oss-20b qkv", "dense gpt-oss-20b o", *llama,
                                                  "experts gpt-oss-20b", "experts gpt-oss-120b"]  # fmt: skip
    assert measure.fp4_plan(["dummy:deepseek-v2-lite"], quick=False) is None  # latent attention: no dense units
    mla = measure.mla_plan(["dummy:deepseek-v2-lite", "dummy:deepseek-v3-l4", "dummy:llama3-8b"], quick=True)
    assert mla.units == ["heads=16 bs=1 ctx=4096 cache=bf16", "heads=16 bs=64 ctx=4096 cache=bf16",
                         "heads=128 bs=64 ctx=4096 cache=bf16"]  # fmt: skip

    # gemv: per shape the largest row count up to which gemv won at every count; an earlier table's other shapes stay
    wins = {1: 0.5, 2: 0.7, 4: 1.2, 8: 0.9, 16: 1.1}
    rows = [{"shape": "llama3-8b qkv", "M": m, "N": 6144, "K": 4096, "gemv/cublas": r} for m, r in wins.items()]
    fused = [{"shape": "llama3-8b qkv", "M": m, "N": 6144, "K": 4096, "kind": "norm", "fused/unfused": 0.9 if m < 8
              else 1.0} for m in wins]  # fmt: skip
    earlier = {"shapes": [{"name": "qwen3-0.6b qkv", "n": 4096, "k": 1024, "linear": 8},
                          {"name": "llama3-8b qkv", "n": 6144, "k": 4096, "linear": 16}]}  # fmt: skip
    [(name, rule)] = plans["gemv"].finish([("llama3-8b qkv", {"rows": rows, "fused": fused})], lambda _: earlier)
    assert name == "gemv_rule.json" and rule["device"] == CARD
    assert rule["shapes"] == [earlier["shapes"][0], {"name": "llama3-8b qkv", "n": 6144, "k": 4096, "linear": 2,
                                                     "norm": 4}]  # fmt: skip

    # fp4: only the measured projections get entries (an unmeasured one would read "never stream"); the GEMM tiles'
    # buckets take each row count's fastest tile of either variant, over the earlier table's other shapes
    def tile(variant):
        return {"variant": variant, "block_m": 16, "block_n": 64, "block_k": 32 if variant == "fp8" else 128,
                "group_m": 8, "num_warps": 4, "num_stages": 3, "split_k": 2}  # fmt: skip

    fp4_rows = [{"fmt": fmt, "n": 6144, "k": 4096, "kernel": kernel, "m": m, "ms": ms, "tile": tile(kernel[9:])}
                for fmt in ("nvfp4", "mxfp4") for kernel, m, ms in
                (("fp4 stream", 1, 1.0), ("fp4 stream", 8, 2.0), ("fp4 gemm bf16", 8, 1.5), ("fp4 gemm fp8", 8, 1.0),
                 ("fp4 gemm bf16", 32, 2.0), ("fp4 gemm fp8", 32, float("inf")))]  # fmt: skip
    kept = {"fmt": "nvfp4", "n": 4096, "k": 14336, "stream_max_rows": 8, "fp8_min_rows": 32}
    kept_tiles = {"fmt": "mxfp4", "n": 4096, "k": 4096, "buckets": {"64": tile("fp8")}}
    earlier = {"fp4_rule.json": {"shapes": [kept]}, "fp4_gemm_tiles.json": {"shapes": [kept_tiles]}}
    [(name, rule), (tiles_name, tiles)] = plans["fp4"].finish([("dense llama3-8b qkv", fp4_rows)], earlier.get)
    assert name == "fp4_rule.json" and rule["shapes"] == [kept] + [
        {"fmt": fmt, "n": 6144, "k": 4096, "stream_max_rows": 1, "fp8_min_rows": 0} for fmt in ("nvfp4", "mxfp4")]
    assert tiles_name == "fp4_gemm_tiles.json" and tiles["shapes"][0] == kept_tiles
    assert [(s["fmt"], s["n"], s["buckets"]["8"]["variant"], s["buckets"]["32"]["variant"]) for s in tiles["shapes"][1:]] \
        == [("nvfp4", 6144, "fp8", "bf16"), ("mxfp4", 6144, "fp8", "bf16")]  # fmt: skip
    assert tiles["shapes"][1]["measurements"][-1]["ms"] is None  # did not run: JSON null, not Infinity


def test_a_benchmark_run_on_another_card_writes_beside_the_first_cards_table_never_over_it(dirs):
    assert tables.shipped_path("gemv_rule.json", CARD) == dirs / "kernels" / "gemv_rule.json"  # none yet
    write_table(dirs / "kernels" / "gemv_rule.json", gemv_table(OTHER, 4))
    assert tables.shipped_path("gemv_rule.json", OTHER) == dirs / "kernels" / "gemv_rule.json"
    assert tables.shipped_path("gemv_rule.json", CARD) == dirs / "shipped" / "NVIDIA_H100_80GB_HBM3" / "gemv_rule.json"
    from graphserve.tuning import gemv as bench

    rows = [{"shape": "llama3-8b qkv", "M": m, "N": 6144, "K": 4096, "gemv/cublas": 0.5} for m in (1, 2)]
    bench.write_rule({"environment": {"device": CARD}, "rows": rows})
    found = tables.find("gemv_rule.json", CARD, gemv_config.GemvRule.from_json, "gemv")
    assert found.source == "shipped" and found.table.max_rows("linear", 6144, 4096) == 2
    assert json.loads((dirs / "kernels" / "gemv_rule.json").read_text())["device"] == OTHER
