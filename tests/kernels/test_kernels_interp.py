"""Every Triton kernel against its plain-PyTorch reference, on CPU through Triton's interpreter.

fp32, tiny shapes, fresh random inputs; outputs are poisoned with NaN first so an element the
kernel forgot to write shows up. The bf16/fp16 and realistic-shape versions live in tests/gpu.
"""

from __future__ import annotations

import os
import sys

import torch
from model_utils import relative_error
from paged_utils import shuffled_tables


def _use_interpreter() -> None:
    """Make this module's kernels run under Triton's CPU interpreter.

    Triton decides interpreter or compiler when each @triton.jit runs, its own library included,
    so TRITON_INTERPRET must be set before triton is imported. Other test modules may already
    have imported it (torch._dynamo does, through transformers); without a GPU, triton and the
    kernel modules are then dropped from the import cache and imported afresh under the
    interpreter. Modules that imported them earlier keep their own (compiled) copies.
    """
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        if torch.cuda.is_available():
            return  # a whole-suite run on a GPU machine: these checks then run compiled on the GPU
        # triton._C (the compiled extension and its submodules) stays: it cannot be loaded twice
        stale = [m for m in sys.modules if m.split(".")[0] == "triton" and not m.startswith("triton._C")]
        stale += [m for m in sys.modules if m.startswith("graphserve.kernels")]
        stale.append("graphserve.layers.attention_triton")
        for name in stale:
            sys.modules.pop(name, None)
    os.environ.setdefault("TRITON_INTERPRET", "1")


_use_interpreter()

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from graphserve.kernels.activation import silu_and_mul, silu_and_mul_reference  # noqa: E402
from graphserve.kernels.decode_attention import (  # noqa: E402
    DEFAULT_TILE,
    FP8_CACHE_TILE,
    FP8_SMALL_TILE,
    DecodeTile,
    choose_num_splits,
    choose_tile,
    counters_numel,
    decode_attention,
    decode_attention_reference,
    decode_plan,
    workspace_numel,
)
from graphserve.kernels.extend_attention import extend_attention, extend_attention_reference  # noqa: E402
from graphserve.kernels.kv_write import kv_write, kv_write_reference  # noqa: E402
from graphserve.kernels.norm import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from graphserve.kernels.rotary import apply_rotary, apply_rotary_reference, rotary_cos_sin  # noqa: E402
from graphserve.layers.attention import TorchAttentionBackend  # noqa: E402
from graphserve.layers.attention_triton import TritonAttentionBackend  # noqa: E402
from graphserve.layers.forward_batch import ForwardBatch  # noqa: E402

if isinstance(tl.standard.cdiv, InterpretedFunction):
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    # triton was imported compiled before this module (a whole-suite run on a GPU machine):
    # the same fp32 checks then run compiled on the GPU
    DEVICE = torch.device("cuda")
else:
    raise RuntimeError("Triton's interpreter could not be switched on and there is no GPU to compile for")


RTOL = 1e-3


def randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE)


def nans(*shape: int) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEVICE)


def paged_setup(seq_lens: list[int], num_kv_heads: int, head_dim: int, page: int, gen: torch.Generator):
    """A random cache and block tables that hand out shuffled blocks (never the dummy block 0)."""
    num_blocks, tables = shuffled_tables(seq_lens, page, gen, spare_blocks=3)
    cache = randn(2, num_blocks, page, num_kv_heads, head_dim, gen=gen)
    return cache, tables.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def slots_of(tables: torch.Tensor, seq: int, positions: range, page: int) -> list[int]:
    return [int(tables[seq, p // page]) * page + p % page for p in positions]


def test_kv_write_matches_reference_and_touches_only_its_slots():
    gen = torch.Generator().manual_seed(1)
    cache = nans(2, 6, 16, 2, 32)
    k, v = randn(5, 2, 32, gen=gen), randn(5, 2, 32, gen=gen)
    slots = torch.tensor([17, 3, 95, 40, 0], device=DEVICE)  # slot 0: a padding row's dummy slot
    ref = cache.clone()
    kv_write(k, v, cache, slots)
    kv_write_reference(k, v, ref, slots)
    assert torch.equal(cache.nan_to_num(7.0), ref.nan_to_num(7.0))
    flat = cache.view(2, -1, 2, 32)
    assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)
    assert int(flat.isnan().any(-1).any(-1).sum()) == 2 * (96 - 5)  # every other slot untouched


def test_kv_write_reads_strided_k_v():
    """k and v as column slices of one fused qkv projection output, as a model produces them."""
    gen = torch.Generator().manual_seed(2)
    qkv = randn(4, 3, 2, 32, gen=gen)
    k, v = qkv[:, 1], qkv[:, 2]
    cache, ref = randn(2, 3, 16, 2, 32, gen=gen), None
    ref = cache.clone()
    slots = torch.tensor([5, 6, 20, 33], device=DEVICE)
    kv_write(k, v, cache, slots)
    kv_write_reference(k, v, ref, slots)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "seq_lens", "num_splits", "fused_merge", "min_split_len"),
    [
        (4, 2, 32, [5, 40, 17], None, True, 128),  # GQA, lengths off the block size, single split (direct store)
        (4, 4, 64, [1, 33], None, True, 128),  # MHA, one-token context
        (8, 2, 32, [150, 70, 9], 3, True, 64),  # three splits merged in-kernel: full, partial and empty pieces
        (8, 2, 32, [150, 70, 9], 3, False, 64),  # the same through the separate merge launch
        (8, 2, 32, [300, 70, 9], 5, True, 128),  # 128-token splits: 3 of 5 used, then 1, then 1
        (8, 2, 32, [300, 70, 9], 5, False, 128),  # the separate merge reads the empty splits too
        (2, 1, 32, [200], 4, True, 64),  # one kv head serving two query heads, four splits
        (6, 2, 32, [300, 0], 5, True, 64),  # a group of 3 (off a power of two); a padding row of length 0
        (16, 1, 64, [400, 190], 7, True, 64),  # 16 query heads on one kv head, splits off a power of two
        (16, 1, 64, [900, 190], 7, True, 192),  # splits of three inner steps, 5 of 7 used
    ],
)
def test_decode_attention_matches_reference(
    num_heads, num_kv_heads, head_dim, seq_lens, num_splits, fused_merge, min_split_len
):
    gen = torch.Generator().manual_seed(3)
    page = 16
    cache, tables, lens = paged_setup(seq_lens, num_kv_heads, head_dim, page, gen)
    q = randn(len(seq_lens), num_heads, head_dim, gen=gen)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    decode_attention(q, cache, tables, lens, scale, out=out, num_splits=num_splits, fused_merge=fused_merge,
                     min_split_len=min_split_len)  # fmt: skip
    ref = decode_attention_reference(q, cache, tables, lens, scale)
    assert not out.isnan().any()
    assert relative_error(out, ref) < RTOL


def test_decode_attention_merges_in_kernel_and_leaves_counters_zero():
    """Two calls on one set of counters (as layers and graph replays share them), and a merge in chunks:
    with 32 heads per kv head at head_dim 128 one merge step holds 4 splits, so 6 one-step splits take
    two (the running sums rescaled between them)."""
    gen = torch.Generator().manual_seed(6)
    cache, tables, lens = paged_setup([370, 45, 200], 1, 128, 16, gen)
    counters = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    workspace = nans(3 * 32 * 6 * 129)
    for _ in range(2):
        q = randn(3, 32, 128, gen=gen)
        out = decode_attention(q, cache, tables, lens, 0.1, num_splits=6, workspace=workspace, counters=counters,
                               min_split_len=64)  # fmt: skip
        assert relative_error(out, decode_attention_reference(q, cache, tables, lens, 0.1)) < RTOL
        assert not counters.any()
    with pytest.raises(ValueError, match="counters hold 2 torch.int32"):
        decode_attention(q, cache, tables, lens, 0.1, num_splits=6, counters=counters[:2])
    with pytest.raises(ValueError, match="min_split_len=96 must be a positive multiple of the tile's block_n=64"):
        decode_attention(q, cache, tables, lens, 0.1, num_splits=6, min_split_len=96)
    with pytest.raises(ValueError, match="min_split_len=64 must be a positive multiple of the tile's block_n=128"):
        decode_attention(q, cache, tables, lens, 0.1, num_splits=6, min_split_len=64, tile=FP8_SMALL_TILE)
    for bad, message in ((DecodeTile(96), r"block_n=96 must be a power of two in 16\.\.256"),
                         (DecodeTile(512), r"block_n=512 must be a power of two in 16\.\.256"),
                         (DecodeTile(64, 3), "num_warps=3 must be 1, 2, 4 or 8"),
                         (DecodeTile(64, 4, 0), "num_stages=0 at least 1")):
        with pytest.raises(ValueError, match=message):
            decode_attention(q, cache, tables, lens, 0.1, tile=bad)


def test_decode_attention_uses_given_workspace_and_checks_its_size():
    gen = torch.Generator().manual_seed(4)
    cache, tables, lens = paged_setup([130, 64], 2, 32, 16, gen)
    q = randn(2, 4, 32, gen=gen)
    need = 2 * 4 * 3 * (32 + 1)
    workspace = nans(need + 10)
    out = decode_attention(q, cache, tables, lens, 0.2, num_splits=3, workspace=workspace)
    assert not workspace[:need].isnan().any()  # the partials went to the caller's scratch
    assert relative_error(out, decode_attention_reference(q, cache, tables, lens, 0.2)) < RTOL
    with pytest.raises(ValueError, match="workspace holds 10"):
        decode_attention(q, cache, tables, lens, 0.2, num_splits=3, workspace=nans(10))


def test_num_splits_fill_the_gpu_from_static_sizes():
    sms = 132
    assert choose_num_splits(1, 8, 8192, sms) == 32  # batch 1, long context: capped at MAX_SPLITS
    assert choose_num_splits(4, 8, 8192, sms) == 9  # 4*8*9 = 288 programs >= 2 per SM
    assert choose_num_splits(256, 8, 8192, sms) == 1  # the batch alone fills the GPU
    assert choose_num_splits(1, 8, 300, sms) == 5  # short capacity: splits of one 64-token inner step
    # scratch covers the largest batch * splits of any batch size that splits at all
    splits = {b: choose_num_splits(b, 8, 1 << 30, sms) for b in range(1, 300)}
    rows = max(b * s for b, s in splits.items() if s > 1)
    assert rows == 64  # batch 32 at 2 splits
    assert workspace_numel(32, 8, 128, sms) == rows * 32 * 129
    # merge counters: one per (sequence, kv head) of the largest batch that splits (batch 32)
    assert counters_numel(8, sms) == 32 * 8


def test_an_fp8_cache_takes_three_splits_only_where_it_measured_faster():
    """An fp8 cache with 4+ kv heads: about 512 programs of 128-token steps from 32 to 255 (sequence, kv head) pairs,
    3 splits from 256 to 4095 pairs where the bf16 rule gives fewer; the bf16 rule elsewhere. Its scratch and counters cover those batches, a bf16 cache's stay as
    they were."""
    sms, fp8 = 132, torch.float8_e4m3fn
    # (batch, kv heads): (bf16 splits, fp8 splits) on 132 SMs at an 8192-token block table
    want = {(2, 8): (17, 17), (3, 4): (22, 22),  # under 32 pairs: the bf16 rule
            (4, 8): (9, 16), (8, 8): (5, 8), (16, 8): (3, 4), (31, 8): (2, 3),  # 32-255 pairs: 512 programs
            (32, 8): (2, 3), (64, 8): (1, 3), (511, 8): (1, 3),  # 256-4095 pairs: 3 splits
            (512, 8): (1, 1), (64, 4): (2, 3), (1023, 4): (1, 3), (1024, 4): (1, 1),  # from 4096 pairs: the bf16 rule
            (200, 2): (1, 1), (300, 1): (1, 1)}  # under 4 kv heads: the bf16 rule
    got = {key: (choose_num_splits(*key, 8192, sms), choose_num_splits(*key, 8192, sms, fp8_cache=True))
           for key in want}
    assert got == want
    assert choose_num_splits(64, 8, 8192, sms, fp8_cache=True) == 3 and choose_num_splits(64, 8, 8192, sms) == 1
    assert choose_num_splits(64, 8, 128, sms, fp8_cache=True) == 2  # never more splits than 64-token steps
    assert workspace_numel(32, 8, 128, sms, fp8) == 511 * 3 * 32 * 129  # batch 511 at 3 splits
    assert counters_numel(8, sms, fp8) == 511 * 8
    # the launch shape: 128-token steps from 32 pairs, the 2-warp 64-token tile from 256, with 4+ kv heads
    assert [choose_tile(b, h, True) for b, h in ((3, 8), (4, 8), (31, 8), (32, 8), (4096, 8), (256, 1))] == \
        [DEFAULT_TILE, FP8_SMALL_TILE, FP8_SMALL_TILE, FP8_CACHE_TILE, FP8_CACHE_TILE, DEFAULT_TILE]
    assert choose_tile(4096, 8) == DEFAULT_TILE
    assert choose_num_splits(8, 4, 1040, sms, fp8_cache=True) == 9  # never more splits than 128-token steps
    assert choose_num_splits(1, 8, 1024, sms) == 16 and choose_num_splits(1, 8, 1024, sms, step=128) == 8  # a given step
    assert workspace_numel(32, 8, 128, sms, torch.bfloat16) == workspace_numel(32, 8, 128, sms)
    # the pair decode_attention runs: each band's tile, and the splits at that tile's step
    assert decode_plan(64, 8, 8192, sms, True) == (FP8_CACHE_TILE, 3)
    assert decode_plan(8, 4, 1040, sms, True) == (FP8_SMALL_TILE, 9)
    assert decode_plan(1, 8, 1024, sms) == (DEFAULT_TILE, 16)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "seq_lens", "query_lens"),
    [
        (4, 2, [20, 9, 5], [20, 9, 5]),  # plain prefill, varlen, GQA
        (4, 2, [37, 70], [9, 70]),  # cached prefix of 28; two query tiles of a 70-token prompt
        (2, 1, [33, 18, 50], [1, 18, 3]),  # mixed: a decode row beside prefill and extend rows
    ],
)
def test_extend_attention_matches_reference(num_heads, num_kv_heads, seq_lens, query_lens):
    gen = torch.Generator().manual_seed(5)
    head_dim, page = 32, 16
    cache, tables, lens = paged_setup(seq_lens, num_kv_heads, head_dim, page, gen)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = randn(int(starts[-1]), num_heads, head_dim, gen=gen)
    out = torch.full_like(q, float("nan"))
    extend_attention(q, cache, tables, lens, starts, max(query_lens), 0.25, out=out)
    ref = extend_attention_reference(q, cache, tables, lens, starts, 0.25)
    assert not out.isnan().any()
    assert relative_error(out, ref) < RTOL


def test_rms_norm_and_fused_add_match_reference():
    gen = torch.Generator().manual_seed(6)
    x = randn(3, 5, 96, gen=gen) * 3
    res = randn(3, 5, 96, gen=gen)
    w = randn(96, gen=gen)
    out = torch.full_like(x, float("nan"))
    rms_norm(x, w, 1e-6, out=out)
    assert not out.isnan().any() and relative_error(out, rms_norm_reference(x, w, 1e-6)) < RTOL
    normed, new_res = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    fused_add_rms_norm(x, res, w, 1e-5, out=normed, residual_out=new_res)
    ref_normed, ref_res = fused_add_rms_norm_reference(x, res, w, 1e-5)
    assert not normed.isnan().any() and not new_res.isnan().any()
    assert relative_error(normed, ref_normed) < RTOL and relative_error(new_res, ref_res) < RTOL


def test_rotary_in_place_matches_reference_with_partial_rotation():
    gen = torch.Generator().manual_seed(7)
    cos, sin = rotary_cos_sin(64, 32, base=500.0, device=DEVICE)  # rot_dim 32 of head_dim 64: the tail is left alone
    q, k = randn(6, 4, 64, gen=gen), randn(6, 2, 64, gen=gen)
    positions = torch.randint(0, 64, (6,), generator=gen).to(DEVICE)
    ref_q, ref_k = apply_rotary_reference(q, k, positions, cos, sin)
    q_tail = q[..., 32:].clone()
    apply_rotary(q, k, positions, cos, sin)
    assert relative_error(q, ref_q) < RTOL and relative_error(k, ref_k) < RTOL
    assert torch.equal(q[..., 32:], q_tail)


def test_rotary_on_strided_qkv_views():
    gen = torch.Generator().manual_seed(8)
    cos, sin = rotary_cos_sin(32, 32, device=DEVICE)
    qkv = randn(5, 4 + 2 + 2, 32, gen=gen)
    q, k = qkv[:, :4], qkv[:, 4:6]
    v_before = qkv[:, 6:].clone()
    positions = torch.arange(5, device=DEVICE) * 3
    ref_q, ref_k = apply_rotary_reference(q, k, positions, cos, sin)
    apply_rotary(q, k, positions, cos, sin)
    assert relative_error(q, ref_q) < RTOL and relative_error(k, ref_k) < RTOL
    assert torch.equal(qkv[:, 6:], v_before)


def test_silu_and_mul_matches_reference():
    gen = torch.Generator().manual_seed(9)
    x = randn(7, 2 * 1100, gen=gen) * 4  # 1100: two column tiles, the second partial
    out = nans(7, 1100)
    silu_and_mul(x, out=out)
    assert not out.isnan().any()
    assert relative_error(out, silu_and_mul_reference(x)) < RTOL


def _batch(mode, q_lens, seq_lens, tables, cache, slots) -> ForwardBatch:
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    total = int(starts[-1])
    return ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(total, dtype=torch.int64, device=DEVICE),
        positions=torch.zeros(total, dtype=torch.int64, device=DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables,
        logits_indices=starts[1:].long() - 1,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        kv_caches=[cache],
    )


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_triton_backend_matches_torch_backend(mode):
    gen = torch.Generator().manual_seed(10)
    page, hkv, hq, d = 16, 2, 4, 32
    seq_lens = [21, 50]
    q_lens = [21, 14] if mode == "prefill" else [1, 1]
    cache, tables, _ = paged_setup(seq_lens, hkv, d, page, gen)
    slots = []
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        slots += slots_of(tables, i, range(n - ql, n), page)
    total = sum(q_lens)
    q, k, v = (randn(total, h, d, gen=gen) for h in (hq, hkv, hkv))
    caches = [cache.clone(), cache.clone()]
    outs = []
    for backend, c in zip((TritonAttentionBackend(), TorchAttentionBackend()), caches):
        outs.append(backend.forward(q, k, v, 0, _batch(mode, q_lens, seq_lens, tables, c, slots), 0.3))
    assert torch.equal(caches[0], caches[1])
    assert relative_error(outs[0], outs[1]) < RTOL
