"""Every tile the shipped MoE tile tables (graphserve/kernels/moe_configs/) name computes the experts, on CPU
through Triton's interpreter: a table is written by the tuner, which times tiles and never checks what they
compute, so each (gate_up, down) pair a table's buckets hold and its streaming tiles run here on a small expert
shape against the PyTorch reference.

The shapes are small stand-ins (4 experts of 256 x 256, top-2, a few tokens, so every tile holds rows past the
pair count); fp8 tables get 128x128 block scales as ``--quantization fp8`` and the shipped checkpoints store
them, the other tables fp16 weights (the interpreter's bf16 dot is unusable, tests/kernels/test_fp8_stream_interp.py).
The GEMM path takes the W8A8 rule as the engine does; a tile that quantizes its activations (``a8``) is held to
the bound tests/kernels/test_moe_fp8_a8_interp.py uses for the interpreter's e4m3 rounding.
"""

from __future__ import annotations

import json

import torch
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error

use_interpreter()

import pytest  # noqa: E402

from graphserve.kernels.moe_config import CONFIG_DIR, MoeTiles  # noqa: E402
from graphserve.kernels.moe_fp8_reference import experts_fp8_reference  # noqa: E402
from graphserve.kernels.moe_fused import fused_experts  # noqa: E402
from graphserve.kernels.moe_reference import experts_reference, softmax_topk_reference  # noqa: E402
from graphserve.layers.quant.fp8_moe import quantize_stack  # noqa: E402

DEVICE = kernel_device()
E, H, INTER, TOP_K, TOKENS = 4, 256, 256, 2, 5
BLOCK = (128, 128)
TABLES = sorted(CONFIG_DIR.glob("*.json"))


def _table_cases() -> list:
    """(table name, path, tiles) for every distinct tile pair of every shipped table."""
    cases = []
    for path in TABLES:
        data = json.loads(path.read_text())
        tiles = MoeTiles.from_json(data)
        fp8 = data["dtype"] == "float8_e4m3fn"
        pairs = dict.fromkeys(zip(tiles.gate_up, tiles.down))
        cases += [pytest.param(fp8, "gemm", pair, id=f"{path.stem[:40]}-gemm{i}") for i, pair in enumerate(pairs)]
        if tiles.small_max_pairs and tiles.gemv_gate_up is not None:
            cases.append(pytest.param(fp8, "gemv", (tiles.gemv_gate_up, tiles.gemv_down), id=f"{path.stem[:40]}-gemv"))
    return cases


def test_the_tables_are_found():
    assert len(TABLES) >= 6 and all(json.loads(p.read_text())["buckets"] for p in TABLES)


@pytest.mark.parametrize("fp8,path,pair", _table_cases())
def test_every_shipped_tile_computes_the_experts(fp8, path, pair):
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float16
    x = (torch.randn(TOKENS, H, generator=gen)).to(DEVICE, dtype)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, INTER, generator=gen) * INTER**-0.5
    topk_w, topk_ids = softmax_topk_reference(torch.randn(TOKENS, E, generator=gen).to(DEVICE), TOP_K, True)
    tiles = {"gemm_tiles": pair} if path == "gemm" else {"gemv_tiles": pair}
    if fp8:
        (qg, sg), (qu, su), (q2, s2) = (quantize_stack(w.to(DEVICE), BLOCK) for w in (w13[:, :INTER], w13[:, INTER:], w2))
        q13, s13 = torch.cat([qg, qu], 1), torch.cat([sg, su], 1).contiguous()
        out = fused_experts(x, q13, q2, topk_w, topk_ids, w13_scale=s13, w2_scale=s2.contiguous(), weight_block=BLOCK,
                            path=path, **tiles)  # fmt: skip
        plain = experts_fp8_reference(x, q13, q2, s13, s2, BLOCK, topk_w, topk_ids)
        quantized = experts_fp8_reference(x, q13, q2, s13, s2, BLOCK, topk_w, topk_ids, w8a8=True)
        assert plain.abs().max() > 0.1
        # the interpreter's e4m3 rounding of the activations (a8 tiles, W8A8's launch): a bound a wrong scale
        # block, a missed K step or a lost tile exceeds many times
        assert min(relative_error(out, ref) for ref in (plain, quantized)) < 0.1
    else:
        out = fused_experts(x, w13.to(DEVICE, dtype), w2.to(DEVICE, dtype), topk_w, topk_ids, path=path, **tiles)
        want = experts_reference(x.float(), w13.to(DEVICE), w2.to(DEVICE), topk_w, topk_ids)
        assert want.abs().max() > 0.1
        assert relative_error(out, want) < 2e-2
