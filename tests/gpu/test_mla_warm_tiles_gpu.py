"""After kernels/mla_attention.warm_tiles has run the tiles this card's rule may pick, MLA decode calls at any
batch and block-table width compile nothing: the tile each picks was warmed, written directly or merged, and the
split count, the table's width and where an eager step's upload puts the table are no specialization of their
own. Each call is checked against the reference."""

from __future__ import annotations

import pytest
import torch
from gpu_utils import rel_err

from graphserve.engine.compile_watch import CompileWatch
from graphserve.kernels.mla_attention import mla_attention, warm_tiles
from graphserve.kernels.mla_config import cache_kind, decode_tiles
from graphserve.layers.mla_reference import absorbed_decode_batched

RANK, ROPE, NOPE, PAGE, MAX_MODEL_LEN = 512, 64, 128, 16, 4096


@pytest.mark.parametrize("heads, cache_dtype", [(16, torch.bfloat16), (16, torch.float8_e4m3fn), (128, torch.bfloat16)])
def test_decode_calls_after_warm_tiles_compile_nothing(heads, cache_dtype):
    dev, dt = torch.device("cuda"), torch.bfloat16
    tiles = decode_tiles(heads, dt, dev, cache_kind(cache_dtype))
    late: list[str] = []
    watch = CompileWatch(lambda name, diff: late.append(f"{name} ({diff})"))
    try:
        warm_tiles(tiles, heads, NOPE, RANK, ROPE, PAGE, dt, cache_dtype, dev, MAX_MODEL_LEN + PAGE)
        watch.ready()
        gen = torch.Generator(device=dev).manual_seed(0)
        max_blocks = MAX_MODEL_LEN // PAGE
        cache = torch.randn(max_blocks * 8 + 1, PAGE, 1, RANK + ROPE, generator=gen, device=dev, dtype=dt)
        cache = cache.to(cache_dtype)
        for batch in (1, 3, 4, 5, 16, 37, 64, 200):
            for width in (1, 2, 5, 16, 37, 64, 100, 256, max_blocks + 1):
                if batch * width > 8 * max_blocks:
                    continue
                ids = (torch.randperm(cache.shape[0] - 1, generator=gen, device=dev)[: batch * width] + 1).int()
                lens = torch.randint(1, width * PAGE + 1, (batch,), generator=gen, device=dev, dtype=torch.int32)
                qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
                # laid out as an eager decode step uploads them (engine/runner.py): lens, query starts, then the
                # tables, in one int32 buffer, so the last two start at offsets that follow the batch
                upload = torch.cat((lens, qsl, ids))
                lens, qsl = upload[:batch], upload[batch : 2 * batch + 1]
                tables = upload[2 * batch + 1 :].view(batch, width)
                q = torch.randn(batch, heads, NOPE + ROPE, generator=gen, device=dev, dtype=dt)
                q_lat = torch.randn(heads, batch, RANK, generator=gen, device=dev, dtype=dt)
                o_lat = torch.full_like(q_lat, float("nan"))
                mla_attention(q_lat.transpose(0, 1), q[..., NOPE:], cache, tables, lens, qsl, 0.07, max_query_len=1,
                              out=o_lat.transpose(0, 1))  # fmt: skip
                ref = absorbed_decode_batched(q_lat.transpose(0, 1), q[..., NOPE:], cache, tables, lens, 0.07)
                assert rel_err(o_lat.transpose(0, 1), ref) < 2e-2, (batch, width)
    finally:
        watch.close()
    assert late == [], f"{len(late)} kernels compiled after warm_tiles ({[t.name for t in tiles]}):\n" + "\n".join(late)
