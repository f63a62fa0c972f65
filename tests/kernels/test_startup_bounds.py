"""Start-up's synthetic steps stay inside the model's tables.

The memory plan measures a mixed step with a whole prefill chunk. Run as one prompt, a 2048-token
chunk under --max-model-len 1024 put positions 1024..2047 into the fused attention prologue, whose
rotary table has max_model_len rows: on an H200 that read faulted (an illegal memory access reported
at the next kernel load) or read whatever followed the table, depending on the allocator's layout.
Here the prologue runs under the interpreter's bounds checker (tests/support/interp_bounds.py) with the
positions of start-up's mixed step.
"""

from __future__ import annotations

import pytest
import test_kernels_interp  # noqa: F401  (runs the kernels under the interpreter when there is no GPU)
import torch
from interp_bounds import bounds_checked

from graphserve.engine.startup import mixed_step_lens
from graphserve.kernels.qk_rope_kv import qk_norm_rope_kv_write
from graphserve.kernels.rotary import rotary_cos_sin

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter's accesses (CPU only)")
HEADS, KV_HEADS, HEAD_DIM, PAGE = 2, 1, 16, 16


@pytest.mark.parametrize(("chunk", "max_running", "max_model_len"),
                         [(2048, 16, 1024), (2048, 4, 512), (2048, 8, 1000), (512, 3, 4096), (100, 1, 100)])
def test_mixed_step_keeps_the_chunk_and_every_prompt_within_max_model_len(chunk, max_running, max_model_len):
    lens = mixed_step_lens(chunk, max_running, max_model_len)
    assert max(lens) <= max_model_len
    assert lens.count(1) >= max_running - 1
    assert sum(lens) == chunk + max_running - 1  # the activation peak sees every token of the chunk


def prologue_positions(query_lens: list[int]) -> torch.Tensor:
    """Each fresh prompt's positions 0..n-1, as start-up's synthetic batch lays them out."""
    return torch.cat([torch.arange(n) for n in query_lens])


def run_prologue(positions: torch.Tensor, max_model_len: int) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens = positions.numel()
    cos, sin = rotary_cos_sin(max_model_len, HEAD_DIM)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    cache = torch.zeros(2, -(-tokens // PAGE) + 1, PAGE, KV_HEADS, HEAD_DIM)
    slots = torch.arange(PAGE, PAGE + tokens)  # past block 0, the dummy block
    qk_norm_rope_kv_write(qkv, positions, cos, sin, cache, slots, HEADS, KV_HEADS, HEAD_DIM)


def test_the_checker_catches_a_prompt_longer_than_the_rotary_table():
    with bounds_checked(), pytest.raises(Exception, match="_qk_norm_rope_kv_kernel: load out of bounds"):
        run_prologue(prologue_positions([128, 1, 1]), max_model_len=64)


def test_the_mixed_step_reads_only_rows_of_the_rotary_table():
    with bounds_checked() as launched:
        run_prologue(prologue_positions(mixed_step_lens(128, 3, 64)), max_model_len=64)
    assert launched == ["_qk_norm_rope_kv_kernel"]
