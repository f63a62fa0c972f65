"""benchmarks/fp8_layer_stream_ws.py's Gluon kernel without a GPU: compiled for sm_90 (Triton + ptxas), it fits
one program an SM in the shared memory its tile plans for, without spills; a tile the weights do not divide is
refused by name. (Gluon kernels do not run in Triton's interpreter: the benchmark checks the launch's every stage
against benchmarks.fp8_layer_stream.reference_layer on the GPU before it times it.)"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.fp8_layer_stream import INTERMEDIATE, random_weights
from benchmarks.fp8_layer_stream_ws import SCRATCH_BYTES, TILES, LayerStreamWS, WsTile

ROOT = Path(__file__).resolve().parents[1]


def test_the_kernel_compiles_for_sm90_within_the_shared_memory_its_tile_plans() -> None:
    """The benchmark's first tile and the one whose stream ran fastest (64 rows, two boxes a slot, 8 warps) at
    llama3-8b's shapes: the ring, the staged row and the barriers are what the kernel allocates (the compiler adds
    scratch of its own, under 1 KB), within an H200 SM's 227 KB, and nothing spills."""
    code = (
        "import json\n"
        "from benchmarks.fp8_layer_stream_ws import TILES, WsTile\n"
        "from benchmarks.kernel_ptxas import layer_stream_ws_reports\n"
        "for r in layer_stream_ws_reports([TILES[0], WsTile(64, 256, 5, 2, 8)]): print(json.dumps(r))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}).stdout  # fmt: skip
    from benchmarks.kernel_ptxas import SM90_SHARED_BYTES

    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["shape"] for r in rows] == [TILES[0].label(), "64x256x2x5/8w"]
    assert (
        rows[0]["planned_shared_bytes"] == TILES[0].shared_bytes(INTERMEDIATE) == 23 * 32 * 256 + 64 * 256 * 2 + 23 * 16
    )
    for r in rows:
        assert r["planned_shared_bytes"] <= r["shared_bytes"] <= r["planned_shared_bytes"] + SCRATCH_BYTES, r
        assert r["shared_bytes"] <= SM90_SHARED_BYTES and r["spill_bytes"] == 0, r


def test_every_benchmark_tile_fits_an_h200_sm() -> None:
    from benchmarks.kernel_ptxas import SM90_SHARED_BYTES

    assert all(t.shared_bytes(INTERMEDIATE) + SCRATCH_BYTES <= SM90_SHARED_BYTES for t in TILES)


@pytest.mark.parametrize(
    "args, message",
    [
        ((48, 256, 4), "WsTile bn=48: must be a power of two >= 1"),
        ((32, 512, 4), "WsTile bk=512: must be a power of two >= 16 and <= 256"),  # past one TMA box
        ((32, 8, 4), "WsTile bk=8: must be a power of two >= 16 and <= 256"),
        ((32, 256, 4, 3), "WsTile sub=3: must be a power of two >= 1"),
        ((32, 256, 4, 1, 6), "WsTile warps=6: must be a power of two >= 1"),
        ((32, 256, 0), "WsTile nbuf=0: at least 1 slot"),
    ],
)
def test_a_tile_the_kernel_cannot_take_is_refused_naming_the_field(args, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        WsTile(*args)


@pytest.mark.parametrize(
    "tile, field",
    [
        (WsTile(64, 256, 4), "tile rows 64 must divide qkv 800"),
        (WsTile(32, 256, 4, 4), "slot columns 4 x 256 must divide hidden 512"),  # 1024 columns a slot
        (WsTile(32, 128, 4), "intermediate 1536 must be a multiple of 8 x bk 128"),  # 1536 = 12 x 128
    ],
)
def test_a_tile_the_weights_do_not_divide_is_refused(tile: WsTile, field: str) -> None:
    w = random_weights(1, 512, 800, 1536, torch.device("cpu"))
    with pytest.raises(ValueError, match=field):
        LayerStreamWS(w, tile, 4)


def test_no_programs_is_refused() -> None:
    w = random_weights(1, 512, 768, 2048, torch.device("cpu"))
    with pytest.raises(ValueError, match="programs=0"):
        LayerStreamWS(w, WsTile(32, 256, 4), 0)
    stream = LayerStreamWS(w, WsTile(32, 256, 4), 2)  # a tile that divides: buffers for one layer
    assert stream.gu.shape == (1, 4096) and stream.cnt.shape == (1, 4) and len(stream.descs) == 4
