"""benchmarks/fp8_route.py on CPU: the tiles it sweeps are ones the streaming kernel takes, and a run that
measures some row counts keeps the earlier table's entries for the others."""

from __future__ import annotations

import pytest

from benchmarks.fp8_route import SHAPES, candidates, rule_from_rows, tile_label
from graphserve.kernels.fp8_config import MAX_BLOCK_N, MAX_FMA_ROWS, Fp8Rule, StreamConfig, tile_cap

ENV = {"device": "NVIDIA H200", "date": "2026-12-01", "commit": "abc1234", "torch": "2.11", "triton": "3.6"}


@pytest.mark.parametrize("channel", [False, True])
@pytest.mark.parametrize("m", [1, 2, 4, 16, 32, 64])
@pytest.mark.parametrize("name", list(SHAPES))
def test_swept_tiles_are_valid_for_the_kernel(name: str, m: int, channel: bool) -> None:
    n, k = SHAPES[name]
    tiles = candidates(m, n, k, sms=132, channel=channel)
    assert tiles, (name, m)
    labels = [tile_label(c) for c in tiles]
    # per-token x frees the FP8 dot's step from the scale block: wider steps are swept, and only then
    assert any(c.block_k > 128 and c.fp8_dot for c in tiles) == (channel and m > 16), (name, m)
    for cfg in tiles:
        cfg.validate()  # what the routing table's loader checks
        assert labels.count(tile_label(cfg)) == 1, tile_label(cfg)  # the result file's times name their tile
        assert cfg.block_n <= (MAX_BLOCK_N if cfg.fp8_dot else tile_cap(128, 128, k)) and k % cfg.block_k == 0
        assert cfg.split_k == 1 or cfg.block_k * 2 * cfg.split_k <= k  # every split keeps two tiles of K
        assert m <= MAX_FMA_ROWS or (cfg.use_dot and cfg.block_n >= 16)
        # an FP8-dot step past the 128-column scale block only where x comes quantized per token
        assert not cfg.fp8_dot or cfg.block_k <= 128 or (channel and cfg.a8 and m > 16)
        if m > MAX_FMA_ROWS:  # one to four programs an SM, or an even wave or two of the FP8 dot on quantized x
            programs = cfg.num_programs(n)
            steps = k // cfg.block_k
            assert 132 <= programs <= 4 * 132 or (cfg.a8 and (99 <= programs <= 132 or 198 <= programs <= 264))
            assert -(-steps // -(-steps // cfg.split_k)) == cfg.split_k  # the launch runs every split it names


def _row(name: str, m: int, best: str, cfg: StreamConfig | None = None, scales: str = "block128") -> dict:
    n, k = SHAPES[name]
    return {"shape": name, "scales": scales, "n": n, "k": k, "m": m, "best": best,
            **({"stream_config": vars(cfg)} if cfg else {})}


def test_a_partial_run_keeps_the_other_row_counts() -> None:
    fma = StreamConfig(8, 2048, 4, 2, False)
    dot = StreamConfig(128, 128, 8, 3, True, split_k=4)
    first = rule_from_rows([_row("llama3-8b qkv", 1, "stream", fma), _row("llama3-8b qkv", 64, "scaled_mm"),
                            _row("llama3-8b qkv", 256, "scaled_mm"), _row("llama3-8b down", 1, "w8a8")], ENV, None)
    second = rule_from_rows([_row("llama3-8b qkv", 64, "stream", dot)], ENV, first)
    rule = Fp8Rule.from_json(second)
    n, k = SHAPES["llama3-8b qkv"]
    assert rule.route(1, n, k, "block128").config == fma  # not measured again: kept
    assert rule.route(64, n, k, "block128").config == dot  # measured again: replaced
    assert rule.route(200, n, k, "block128").path == "scaled_mm"
    assert rule.route(1, *SHAPES["llama3-8b down"], "block128").path == "w8a8"  # another shape: kept
    # a table from another card keeps nothing
    other = rule_from_rows([_row("llama3-8b qkv", 64, "stream", dot)], {**ENV, "device": "NVIDIA H100"}, first)
    assert [s["name"] for s in other["shapes"]] == ["llama3-8b qkv"] and len(other["shapes"][0]["rows"]) == 1


def test_prologues_follow_the_layers_limits() -> None:
    from benchmarks.fp8_route import prologue
    from graphserve.layers.quant.fp8 import NORM_PROLOGUE_MAX_ROWS, SILU_PROLOGUE_MAX_ROWS

    assert prologue("llama3-8b qkv", 1) == prologue("llama3-8b gate_up", NORM_PROLOGUE_MAX_ROWS) == "norm"
    assert prologue("llama3-8b gate_up", NORM_PROLOGUE_MAX_ROWS + 1) is None
    assert prologue("llama3-8b down", SILU_PROLOGUE_MAX_ROWS) == "silu"
    assert prologue("llama3-8b down", SILU_PROLOGUE_MAX_ROWS + 1) is None
    assert prologue("qwen3-30b-a3b o_proj", 1) is None


def test_routed_stream_tiles_compile_for_hopper_without_spills():
    """Every streaming-matmul tile the committed table routes llama3-8b to (per-channel and block scales, with the
    prologue the layer fuses),
    compiled for sm_90 without a GPU (Triton + ptxas, benchmarks/kernel_ptxas.py): no register spills, shared
    memory within an SM's, at least one program per SM."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import json; from benchmarks.kernel_ptxas import fp8_stream_reports\n"
            "for r in fp8_stream_reports(): print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True).stdout
    from benchmarks.kernel_ptxas import SM90_SHARED_BYTES

    rows = [json.loads(line) for line in out.splitlines()]
    assert any("m1 " in r["shape"] for r in rows) and any("fp8 dot" in r["shape"] for r in rows), rows
    assert any("channel" in r["shape"] and "a8 fp8 dot" in r["shape"] for r in rows), rows  # the per-token tiles
    for r in rows:
        assert r["spill_bytes"] == 0 and r["shared_bytes"] <= SM90_SHARED_BYTES and r["programs_per_sm"] >= 1, r


def test_a_run_of_one_scale_kind_keeps_the_other_kinds_entries() -> None:
    """``--scales channel`` and ``--scales block128`` write entries of their own for the same shape."""
    fma = StreamConfig(8, 2048, 4, 2, False)
    a8 = StreamConfig(64, 128, 4, 3, True, split_k=4, fp8_dot=True, a8=True)
    block = rule_from_rows([_row("llama3-8b qkv", 64, "scaled_mm"), _row("llama3-8b qkv", 1, "stream", fma)], ENV, None)
    both = Fp8Rule.from_json(rule_from_rows([_row("llama3-8b qkv", 64, "stream", a8, "channel")], ENV, block))
    n, k = SHAPES["llama3-8b qkv"]
    assert both.route(64, n, k, "block128").path == "scaled_mm" and both.route(1, n, k, "block128").config == fma
    assert both.route(64, n, k, "channel").config == a8 and both.route(65, n, k, "channel") is None


def test_moe_streaming_tiles_of_the_fp8_tables_compile_for_hopper():
    """The MoE streaming kernels with every shipped FP8 expert table's tiles at its shape, compiled for sm_90
    without a GPU (benchmarks/kernel_ptxas.moe_stream_reports): every tile fits (shared memory, one program an SM
    at least), and the tiles that step across scale blocks (``K_SCALES``, whose per-column scale loads add
    registers) do not spill."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import json; from benchmarks.kernel_ptxas import moe_stream_reports\n"
            "for r in moe_stream_reports(): print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True).stdout
    from benchmarks.kernel_ptxas import SM90_SHARED_BYTES

    rows = [json.loads(line) for line in out.splitlines()]
    wide = [r for r in rows if "k_scales" in r["shape"]]
    assert wide and any("gate_up" in r["shape"] for r in wide) and any("down" in r["shape"] for r in wide), rows
    for r in rows:
        assert r["shared_bytes"] <= SM90_SHARED_BYTES and r["programs_per_sm"] >= 1, r
    for r in wide:
        assert r["spill_bytes"] == 0, r


def test_every_entry_names_the_run_that_measured_it() -> None:
    """A partial run stamps the entries it writes with its own commit; the entries it keeps carry theirs, and an
    earlier table's unstamped entry is stamped as measured at or before that table's run."""
    fma = StreamConfig(8, 2048, 4, 2, False)
    first = rule_from_rows([_row("llama3-8b qkv", 1, "stream", fma), _row("llama3-8b down", 1, "w8a8")], ENV, None)
    assert all(e["measured_at"] == {"commit": "abc1234", "date": "2026-12-01"} for s in first["shapes"]
               for e in s["rows"])
    legacy = {**first, "shapes": [{**s, "rows": [{k: v for k, v in e.items() if k != "measured_at"}
                                                 for e in s["rows"]]} for s in first["shapes"]]}
    later = {**ENV, "commit": "def5678", "date": "2026-12-02"}
    second = rule_from_rows([_row("llama3-8b qkv", 2, "stream", fma)], later, legacy)
    stamps = {(s["name"], e["m"]): e["measured_at"] for s in second["shapes"] for e in s["rows"]}
    assert stamps[("llama3-8b qkv", 2)] == {"commit": "def5678", "date": "2026-12-02"}
    inherited = {"commit": "abc1234", "date": "2026-12-01", "at_or_before": True}
    assert stamps[("llama3-8b qkv", 1)] == stamps[("llama3-8b down", 1)] == inherited
    assert second["measured"]["commit"] == "def5678"
    # a stamped entry keeps its own stamp through a later run
    third = rule_from_rows([_row("llama3-8b down", 1, "scaled_mm")], {**later, "commit": "0123abc"}, second)
    again = {(s["name"], e["m"]): e["measured_at"] for s in third["shapes"] for e in s["rows"]}
    assert again[("llama3-8b qkv", 2)]["commit"] == "def5678" and again[("llama3-8b down", 1)]["commit"] == "0123abc"
    assert "at_or_before" not in again[("llama3-8b down", 1)]
    assert Fp8Rule.from_json(third).route(2, *SHAPES["llama3-8b qkv"], "block128").config == fma  # still loads
    # an earlier table that names no run leaves its entries unstamped, not stamped with nothing
    nameless = rule_from_rows([_row("llama3-8b qkv", 2, "stream", fma)], later, {**legacy, "measured": {}})
    assert all("measured_at" not in e for s in nameless["shapes"] if s["name"] == "llama3-8b down" for e in s["rows"])


def test_every_fma_tile_is_swept_for_some_shape() -> None:
    """A tile no shape can take (its step wider than K, or a split leaving under two steps) is never compiled nor
    timed: the list holds none."""
    from benchmarks.fp8_route import FMA_TILES, fma_config

    swept = {c for n, k in SHAPES.values() for c in candidates(1, n, k, sms=132)}
    for entry in FMA_TILES:
        assert fma_config(*entry) in swept, entry
