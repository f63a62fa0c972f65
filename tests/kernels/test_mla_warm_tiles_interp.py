"""kernels/mla_attention.warm_tiles on CPU through Triton's interpreter: each tile it is given runs written
directly and merged, and every launch computes what the PyTorch reference does on its fresh random inputs."""

from __future__ import annotations

from interp_setup import use_interpreter

use_interpreter("graphserve.layers.mla_triton")

import pytest  # noqa: E402
import torch  # noqa: E402
from model_utils import relative_error  # noqa: E402

import graphserve.kernels.mla_attention as mla_kernels  # noqa: E402
from graphserve.kernels.mla_config import MLATile  # noqa: E402
from graphserve.layers.mla_reference import absorbed_decode_batched  # noqa: E402

TILES = (MLATile(False, 16, 16, 4, 1), MLATile(True, 16, 32, 4, 1))  # two BLOCK_N, both layouts


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_warm_tiles_launches_each_tile_direct_and_merged(cache_dtype, monkeypatch):
    launched = []
    real_launch = mla_kernels._launch

    def checked(q_lat, q_rope, cache, block_tables, seq_lens, qsl, scale, max_query_len, out, num_splits, tile):
        out.fill_(float("nan"))
        real_launch(q_lat, q_rope, cache, block_tables, seq_lens, qsl, scale, max_query_len, out, num_splits, tile)
        assert q_lat.abs().sum() > 0 and cache.float().abs().sum() > 0  # random, never zeros
        ref = absorbed_decode_batched(q_lat, q_rope, cache, block_tables, seq_lens, scale)
        assert relative_error(out, ref) < 1e-4, (tile.name, num_splits)
        launched.append((tile.block_n, tile.token_major, num_splits))

    monkeypatch.setattr(mla_kernels, "_launch", checked)
    device = torch.device("cpu")
    # 3 heads, rank 32, rope 16, pages of 16 tokens; 128 tokens of capacity allow two splits of 64
    n = mla_kernels.warm_tiles(TILES, 3, 8, 32, 16, 16, torch.float32, cache_dtype, device, 128)
    assert n == 4 and launched == [(16, False, 1), (16, False, 2), (32, True, 1), (32, True, 2)]


def test_the_layers_warm_up_work_reaches_the_kernel(monkeypatch):
    """layers/warmup_work.py over two MLA layers of one shape on the Triton backend: one tile (fp32 queries take
    DECODE_FP32 whatever the rule), launched written directly and merged, once for both layers."""
    from types import SimpleNamespace

    from torch import nn

    from graphserve.kernels.mla_config import DECODE_FP32
    from graphserve.layers.mla import MLAttention
    from graphserve.layers.mla_rope import DeepseekRotary
    from graphserve.layers.warmup_work import run_warmup_work

    launched = []
    real_launch = mla_kernels._launch
    monkeypatch.setattr(mla_kernels, "_launch", lambda *args: launched.append((args[-1], args[-2])) or real_launch(*args))
    rotary = DeepseekRotary(8, 64, {"rope_type": "default", "rope_theta": 10000.0}, 64, False)
    layers = nn.ModuleList(MLAttention(32, 3, None, 32, 8, 8, 8, False, rotary, 0.3, layer_idx=i) for i in range(2))
    caches = [torch.zeros(2, 16, 1, 40) for _ in layers]
    assert run_warmup_work(layers, SimpleNamespace(name="triton"), caches, 64) == 1
    assert launched == [(DECODE_FP32, 1), (DECODE_FP32, 2)]
