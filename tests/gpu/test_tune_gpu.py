"""`graphserve tune` on whatever card runs it: it measures the gemv routing of one preset and the MoE tiles of a small
expert shape into a per-user cache of its own, and the engine's readers then take those tables, for this card, from
that cache. Timings are not asserted (they are the card's); what is: the tables exist, name this card and these
versions, pass the lookup's checks, and route calls that still compute what the references compute."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from gpu_utils import rel_err

from graphserve import cli
from graphserve.kernels import gemv_config, moe_config, tables
from graphserve.kernels.gemv import gemv, gemv_reference
from graphserve.layers import linear as linear_mod


def _forget() -> None:
    tables.clear()
    gemv_config.rule_for.cache_clear()
    moe_config._load.cache_clear()


def test_tune_writes_this_cards_tables_and_the_engine_reads_them(tmp_path, monkeypatch, gen):
    monkeypatch.setenv("GRAPHSERVE_CACHE_DIR", str(tmp_path))
    _forget()
    argv = ["tune", "--quick", "--tables", "gemv", "moe", "--model", "dummy:qwen3-0.6b", "--budget-s", "20",
            "--experts", "8", "--hidden", "512", "--intermediate", "256", "--top-k", "2", "--dtype", "bfloat16"]
    try:
        assert cli.main(argv) == 0
        card = torch.cuda.get_device_name(0)
        folder = tables.cache_dir(card)
        gemv_file = folder / "gemv_rule.json"
        written = json.loads(gemv_file.read_text())
        assert written["device"] == card and written["versions"] == tables.versions()
        assert {s["name"] for s in written["shapes"]} <= {"qwen3-0.6b qkv", "qwen3-0.6b o_proj", "qwen3-0.6b gate_up",
                                                          "qwen3-0.6b down", "qwen3-0.6b lm_head"}  # fmt: skip
        rule = gemv_config.rule_for(torch.device("cuda"))
        assert tables.RESOLVED["gemv"] == ("cache", gemv_file)
        # whatever the card chose, a routed projection computes what the reference computes
        shape = written["shapes"][0]
        w = torch.randn(shape["n"], shape["k"], device="cuda", generator=gen).to(torch.bfloat16) * shape["k"] ** -0.5
        for rows in (1, rule.max_rows("linear", shape["n"], shape["k"]) + 1):
            x = torch.randn(rows, shape["k"], device="cuda", generator=gen).to(torch.bfloat16)
            y = gemv(x, w) if linear_mod.use_gemv(x, w) else F.linear(x, w)
            assert rel_err(y, gemv_reference(x, w)) < 2e-2, rows

        moe_file = folder / "moe_configs" / moe_config.table_path(8, 256, 512, torch.bfloat16,
                                                                  moe_config.device_name(torch.device("cuda"))).name
        assert json.loads(moe_file.read_text())["versions"] == tables.versions()
        tiles = moe_config.moe_tiles(8, 256, 512, torch.bfloat16, torch.device("cuda"))
        assert tables.RESOLVED["moe E=8,I=256,H=512,bfloat16"] == ("cache", moe_file)
        assert tiles.buckets and tiles == moe_config.MoeTiles.from_json(json.loads(moe_file.read_text()))
    finally:
        _forget()
