"""The warm-up compiles every MLA decode tile a card's rule may pick (kernels/mla_config.decode_tiles), not only the
ones its short prompts reach: the tiles listed from a rule read through the table lookup, the split counts that
reach every merge specialization, and the warm-up running the layers' launches once per distinct tile."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from graphserve.engine import warmup
from graphserve.kernels import mla_config, tables
from graphserve.kernels.mla_config import (
    DECODE_FP32,
    MAX_SPLITS,
    MLATile,
    choose_num_splits,
    decode_tile,
    decode_tiles,
    default_decode_tile,
    warm_split_counts,
)
from graphserve.layers.dsa_attention import DsaAttention
from graphserve.layers.mla import MLAttention, mla_backend
from graphserve.layers.mla_rope import DeepseekRotary
from tests.support.tables_utils import isolate_tables, write_table

CARD = "NVIDIA H100 80GB HBM3"
CUDA = torch.device("cuda")  # only named: the lookup asks the card's name, which the tests give
# (cache kind, heads, bs, ctx, tile): several tiles at 16 heads, one repeated, others at 128 heads and for fp8
ENTRIES = [
    ("model", 16, 1, 1024, "hm-h16n16w4s3o2"), ("model", 16, 1, 16384, "hm-h16n32w4s4o2"),
    ("model", 16, 4, 1024, "hm-h16n64w8s2o2"), ("model", 16, 64, 4096, "hm-h16n32w4s4o2"),
    ("model", 16, 256, 1024, "tm-h16n32w4s3o2"), ("model", 128, 64, 4096, "hm-h64n32w8s2o1"),
    ("fp8", 16, 1, 1024, "hm-h16n64w8s2o2"), ("fp8", 16, 64, 16384, "tm-h16n32w4s4o2"),
]  # fmt: skip
MODEL_16 = ["hm-h16n16w4s3o2", "hm-h16n32w4s4o2", "hm-h16n64w8s2o2", "tm-h16n32w4s3o2"]


@pytest.fixture
def rule_in_cache(tmp_path, monkeypatch):
    """A fresh rule for CARD in the tune cache under tmp_path, every lookup forgotten before and after."""
    isolate_tables(monkeypatch, tmp_path, CARD)
    path = write_table(tables.cache_dir(CARD) / "mla_tiles.json", {"device": CARD, "versions": tables.versions(),
                       "entries": [{"cache": c, "heads": h, "bs": b, "ctx": x, "tile": t} for c, h, b, x, t in ENTRIES]})
    yield path
    tables.clear()


def test_the_rule_lists_every_tile_it_can_pick(rule_in_cache):
    tiles = decode_tiles(16, torch.bfloat16, CUDA)
    assert tables.RESOLVED["mla"] == ("cache", rule_in_cache)
    assert [t.name for t in tiles] == MODEL_16  # each once, the repeated one included
    assert decode_tiles(8, torch.bfloat16, CUDA) == tiles  # fewer heads (tp 2): the nearest measured count's
    assert [t.name for t in decode_tiles(128, torch.float16, CUDA)] == ["hm-h64n32w8s2o1"]
    assert [t.name for t in decode_tiles(16, torch.bfloat16, CUDA, "fp8")] == ["hm-h16n64w8s2o2", "tm-h16n32w4s4o2"]
    assert decode_tiles(16, torch.float32, CUDA) == (DECODE_FP32,)
    for cache, heads in (("model", 16), ("fp8", 16), ("model", 128)):  # what the calls pick, whatever their sizes
        listed = set(decode_tiles(heads, torch.bfloat16, CUDA, cache))
        picked = {decode_tile(heads, bs, ctx, torch.bfloat16, CUDA, cache)
                  for bs in (1, 2, 3, 5, 17, 64, 100, 512) for ctx in (16, 272, 1024, 3000, 4096, 8192, 65536)}
        assert picked == listed, (cache, heads, picked)
    # no rule for the card: the code default alone
    rule_in_cache.unlink()
    tables.clear()
    assert decode_tiles(16, torch.bfloat16, CUDA) == (default_decode_tile(16, torch.bfloat16),)
    assert mla_config.MLARule("x", ()).tiles_for(16) == ()


def test_warm_split_counts_reach_every_merge_a_call_can_launch():
    for max_context in (16, 64, 65, 200, 1024, 4096, 4112, 163840):
        counts = warm_split_counts(max_context)
        assert counts[0] == 1 and all(1 <= s <= MAX_SPLITS for s in counts)
        warmed = {1 << (s - 1).bit_length() for s in counts if s > 1}  # the merge's BLOCK_S
        for capacity in range(16, max_context + 1, 16 if max_context <= 4112 else 4096):
            for batch, head_blocks, sms, occupancy in ((1, 1, 132, 2), (3, 1, 132, 1), (1, 8, 78, 4), (40, 1, 132, 2)):
                s = choose_num_splits(batch, head_blocks, capacity, sms, occupancy)
                assert s == 1 or 1 << (s - 1).bit_length() in warmed, (max_context, capacity, batch, s)


def _mla_model(dtype: torch.dtype) -> tuple[nn.Module, list[torch.Tensor]]:
    """Three MLA layers of one shape and a DSA layer, tiny, with their latent caches (page 16)."""
    rotary = DeepseekRotary(8, 64, {"rope_type": "default", "rope_theta": 10000.0}, 64, False)
    dims = dict(hidden_size=32, num_heads=4, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=8, attention_bias=False, rotary=rotary, scale=0.3)
    layers = [MLAttention(**dims, layer_idx=i) for i in range(3)] + [DsaAttention(**dims, layer_idx=3, indexer=None)]
    model = nn.ModuleList(layers).to(dtype)
    return model, [torch.zeros(2, 16, 1, 40, dtype=dtype) for _ in layers]


def test_the_warm_up_runs_each_tile_once_through_the_layers(rule_in_cache, monkeypatch):
    rule = mla_config.rule_for(CUDA)
    assert len(rule.entries) == len(ENTRIES)
    # patched where the backend the layers reach looks them up (a module the interpreter tests imported again
    # would hold other copies); the rule is given for the CPU the caches live on here
    backend = type(mla_backend(SimpleNamespace(name="triton")))
    hook_globals = backend.warmup_work.__globals__
    monkeypatch.setitem(hook_globals["decode_tiles"].__globals__, "rule_for", lambda device: rule)
    calls = []
    monkeypatch.setitem(hook_globals, "warm_tiles", lambda tiles, *shape: calls.append((tiles, shape)) or 1)
    model, caches = _mla_model(torch.bfloat16)
    core = SimpleNamespace(max_model_len=4000, runner=SimpleNamespace(
        model=model, attn_backend=SimpleNamespace(name="triton"), kv_caches=caches))
    assert warmup.kernel_warmups(core) == len(MODEL_16)
    assert [tiles[0].name for tiles, _ in calls] == MODEL_16 and all(len(tiles) == 1 for tiles, _ in calls)
    heads, nope, rank, rope, page, dtype, cache_dtype, device, max_context = calls[0][1]
    assert (heads, nope, rank, rope, page, dtype, cache_dtype) == (4, 8, 32, 8, 16, torch.bfloat16, torch.bfloat16)
    assert max_context >= 4000 and device.type == "cpu"
    calls.clear()
    fixed = MLATile(False, 16, 32, 4, 2)  # a backend given a tile warms that one alone
    core.runner.attn_backend = SimpleNamespace(name="triton", mla=backend(fixed))
    assert warmup.kernel_warmups(core) == 1 and calls[0][0] == (fixed,)
    calls.clear()
    core.runner.attn_backend = SimpleNamespace(name="torch")  # the PyTorch backend: nothing to compile
    assert warmup.kernel_warmups(core) == 0 and calls == []
    assert warmup.kernel_warmups(SimpleNamespace(runner=SimpleNamespace(), max_model_len=64)) == 0


def test_the_token_count_tables_switch_where_the_ladder_reaches():
    """The other measured rules pick by a step's row (or pair) count, not its context, and are measured at doubling
    counts: each bucket (previous count, count] holds a power of two the warm-up's ladder runs, and each route
    switches at a power of two its prefill lengths pass on both sides. A table measured elsewhere would leave a
    bucket to be compiled in service."""
    from graphserve.tuning import fp4, fp8_route, gemv

    ladder = set(warmup.token_ladder(2048)) | set(warmup.prefill_lengths(2048, 16, 4000))
    shipped = sorted(mla_config.RULE_PATH.parent.glob("**/*_rule.json"))
    assert len(shipped) >= 6
    counts = [gemv.BATCHES, fp8_route.ROWS, fp8_route.QUICK_ROWS, fp4.STREAM_ROWS, fp4.GEMM_ROWS]
    for path in shipped:
        data = json.loads(path.read_text())
        for shape in data.get("shapes", []) + data.get("mlps", []):
            counts.append(sorted(int(row["m"]) for row in shape.get("rows", [])))
            limits = [shape.get(k) for k in ("linear", "silu_mul", "norm", "stream_max_rows", "fp8_min_rows")]
            assert all(n & (n - 1) == 0 for n in limits if n), (path.name, shape)
    for rows in counts:
        for low, high in zip([0, *rows], rows):
            assert any(low < t <= high for t in ladder), (rows, low, high)
