"""The MLA kernels against their PyTorch references, on CPU through Triton's interpreter.

fp32, tiny shapes whose sizes are not powers of two, fresh random inputs, outputs poisoned with NaN:
the fused prologue (norm, both rotary layouts, cache write, an fp8 cache saturating), absorbed attention for decode (one
split written directly and several merged, one head block and several, both tile layouts, an fp8
cache) and for extend over a cached prefix, and a whole DeepSeek-V3 model on the
Triton MLA backend against transformers. The bf16 real-shape and CUDA-graph versions live in
tests/gpu/test_mla.py.
"""

from __future__ import annotations

import os
import sys

import torch
from model_utils import relative_error
from paged_utils import shuffled_tables


def _use_interpreter() -> None:
    """Run this module's kernels under Triton's interpreter when there is no GPU (see test_moe_interp.py)."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        if torch.cuda.is_available():
            return
        stale = [m for m in sys.modules if m.split(".")[0] == "triton" and not m.startswith("triton._C")]
        stale += [m for m in sys.modules if m.startswith("graphserve.kernels") or m == "graphserve.layers.mla_triton"]
        for name in stale:
            sys.modules.pop(name, None)
    os.environ.setdefault("TRITON_INTERPRET", "1")


_use_interpreter()

import pytest  # noqa: E402

import graphserve.kernels.mla_attention as mla_kernels  # noqa: E402
from graphserve.kernels.mla_attention import mla_attention  # noqa: E402
from graphserve.kernels.mla_config import MLATile  # noqa: E402
from graphserve.kernels.mla_prologue import mla_prologue, mla_prologue_reference  # noqa: E402
from graphserve.layers.mla_reference import absorbed_attention_reference  # noqa: E402
from graphserve.layers.mla_rope import DeepseekRotary  # noqa: E402
from graphserve.layers.mla_triton import TritonMLABackend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RANK, ROPE, NOPE, HEADS = 24, 8, 8, 5


def latent_setup(seq_lens: list[int], page: int, gen: torch.Generator):
    """A random latent cache and block tables over shuffled blocks (never the dummy block 0)."""
    num_blocks, tables = shuffled_tables(seq_lens, page, gen, spare_blocks=3)
    cache = torch.randn(num_blocks, page, 1, RANK + ROPE, generator=gen).to(DEVICE)
    return cache, tables.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("interleaved", [True, False])
def test_prologue_matches_reference(interleaved):
    gen = torch.Generator().manual_seed(0)
    tokens = 5
    rotary = DeepseekRotary(ROPE, 64, {"rope_type": "default", "rope_theta": 10000.0}, 64, interleaved)
    q = torch.randn(tokens, HEADS, NOPE + ROPE, generator=gen).to(DEVICE)
    fused = torch.randn(tokens, 7 + RANK + ROPE, generator=gen).to(DEVICE)
    kv_a = fused[:, 7:]  # a strided slice of a fused projection, as the model passes it
    positions = torch.tensor([0, 9, 33, 4, 63], device=DEVICE)
    weight = (1 + 0.2 * torch.randn(RANK, generator=gen)).to(DEVICE)
    slots = torch.tensor([17, 3, 45, 40, 0], device=DEVICE)  # slot 0: a padding row's dummy slot
    cache = torch.full((6, 8, 1, RANK + ROPE), float("nan"), device=DEVICE)
    q_ref, cache_ref = q.clone(), cache.clone()
    cos_sin = rotary.cos_sin_cache.to(DEVICE)
    mla_prologue(q, kv_a, positions, cos_sin, weight, 1e-6, cache, slots, NOPE, interleaved)
    mla_prologue_reference(q_ref, kv_a, positions, cos_sin, weight, 1e-6, cache_ref, slots, NOPE, interleaved)
    assert relative_error(q, q_ref) < 1e-5
    flat, flat_ref = cache.view(-1, RANK + ROPE), cache_ref.view(-1, RANK + ROPE)
    assert relative_error(flat[slots], flat_ref[slots]) < 1e-5
    assert int(flat.isnan().any(-1).sum()) == 48 - 5  # every other slot untouched


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_prologue_writes_an_fp8_cache_saturating(model_dtype):
    """An e4m3 cache: the latent normed in fp32, rounded to the model dtype, times the weight, then cast;
    the rope key rotated, rounded to the model dtype, then cast. Values past +-448 (a large norm weight, a
    large rope key) store as +-448, e4m3's largest finite value, never NaN."""
    gen = torch.Generator().manual_seed(1)
    tokens = 5
    rotary = DeepseekRotary(ROPE, 64, {"rope_type": "default", "rope_theta": 10000.0}, 64, False)
    q = torch.randn(tokens, HEADS, NOPE + ROPE, generator=gen).to(model_dtype).to(DEVICE)
    kv_a = torch.randn(tokens, RANK + ROPE, generator=gen)
    kv_a[:, 3] = torch.tensor([3.0, -3.0, 3.0, -3.0, 3.0])  # normed to about +-2.5, times 600 below
    kv_a[1, RANK] = 1000.0  # the rope key's first element, at position 0: rotated by cos 1, sin 0
    kv_a = kv_a.to(model_dtype).to(DEVICE)
    weight = 1 + 0.2 * torch.randn(RANK, generator=gen)
    weight[3] = 600.0
    weight = weight.to(model_dtype).to(DEVICE)
    positions = torch.tensor([7, 0, 33, 4, 63], device=DEVICE)
    slots = torch.tensor([17, 3, 45, 40, 9], device=DEVICE)
    cache = torch.full((6, 8, 1, RANK + ROPE), float("nan"), device=DEVICE).to(torch.float8_e4m3fn)
    q_ref, cache_ref = q.clone(), cache.clone()
    cos_sin = rotary.cos_sin_cache.to(DEVICE)
    mla_prologue(q, kv_a, positions, cos_sin, weight, 1e-6, cache, slots, NOPE, False)
    mla_prologue_reference(q_ref, kv_a, positions, cos_sin, weight, 1e-6, cache_ref, slots, NOPE, False)
    assert relative_error(q, q_ref) < (1e-5 if model_dtype == torch.float32 else 1e-2)
    got = cache.view(-1, RANK + ROPE)[slots].float()
    want = cache_ref.view(-1, RANK + ROPE)[slots].float()
    assert not got.isnan().any() and not want.isnan().any()
    assert got[:, 3].tolist() == [448.0, -448.0, 448.0, -448.0, 448.0] and float(got[1, RANK]) == 448.0
    if DEVICE.type == "cpu":  # Triton 3.6's interpreter drops the carry of an e4m3 rounding (test_fp8_interp.py)
        carry = (got != want) & (want.abs().log2() == want.abs().log2().round()) & (got == want / 2)
        got = torch.where(carry, want, got)
    # the same roundings in the same order, so equal but where the two sides' fp32 (the kernel's sqrt and
    # division, torch's rsqrt) or bf16 (the interpreter truncates, torch rounds to nearest) roundings differ
    # next to an e4m3 midpoint: there one e4m3 step apart, 2^-3 relative, or 2^-9 (the smallest subnormal)
    # absolute, where the interpreter gave -0.0 for torch's -2^-9 in fp32
    assert ((got - want).abs() <= want.abs() * 2**-3 + 2**-9).all()
    assert float((got == want).float().mean()) > (0.98 if model_dtype == torch.float32 else 0.9)
    assert int(cache.view(-1, RANK + ROPE).float().isnan().any(-1).sum()) == 48 - 5  # every other slot untouched


HEAD_MAJOR = MLATile(False, 16, 16, 4, 1)
TOKEN_MAJOR = MLATile(True, 16, 32, 4, 1)


class LaunchCounter:
    """Stands in for the merge kernel: counts its launches and runs the real one."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def decode_case(heads: int, seq_lens: list[int], cache_dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    cache, tables, lens = latent_setup(seq_lens, 16, gen)
    batch = len(seq_lens)
    q_lat = torch.randn(batch, heads, RANK, generator=gen).to(DEVICE)
    q_rope = torch.randn(batch, heads, ROPE, generator=gen).to(DEVICE)
    return cache.to(cache_dtype), tables, lens, q_lat, q_rope


@pytest.mark.parametrize("tile", [HEAD_MAJOR, TOKEN_MAJOR], ids=lambda t: t.name)
@pytest.mark.parametrize(("heads", "num_splits"), [(HEADS, 1), (HEADS, 3), (HEADS, 11), (21, 1), (21, 4)])
def test_decode_matches_reference(tile, heads, num_splits, monkeypatch):
    """Every decode path: one split written directly (no merge launch) or several merged; one head
    block (5 heads) or two (21 heads over blocks of 16); both tile layouts."""
    seq_lens = [1, 37, 150, 0]  # the last row is CUDA-graph padding: no context, output 0
    cache, tables, lens, q_lat, q_rope = decode_case(heads, seq_lens, torch.float32, seed=heads * 100 + num_splits)
    merge = LaunchCounter(mla_kernels._mla_merge_kernel)
    monkeypatch.setattr(mla_kernels, "_mla_merge_kernel", merge)
    qsl = torch.arange(5, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q_lat, float("nan"))
    mla_attention(q_lat, q_rope, cache, tables, lens, qsl, 0.3, max_query_len=1, out=out, num_splits=num_splits,
                  tile=tile)
    ref = absorbed_attention_reference(q_lat[:3], q_rope[:3], cache, tables, [1, 1, 1], seq_lens[:3], 0.3)
    assert relative_error(out[:3], ref) < 1e-5
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert merge.launches == (0 if num_splits == 1 else 1)


@pytest.mark.parametrize("tile", [HEAD_MAJOR, TOKEN_MAJOR], ids=lambda t: t.name)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_reads_an_fp8_cache(tile, num_splits):
    """An e4m3 cache widened as it loads: the reference reads the same fp8 values in fp32."""
    seq_lens = [70, 5, 33]
    cache, tables, lens, q_lat, q_rope = decode_case(HEADS, seq_lens, torch.float8_e4m3fn, seed=7 + num_splits)
    qsl = torch.arange(4, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q_lat, float("nan"))
    mla_attention(q_lat, q_rope, cache, tables, lens, qsl, 0.3, max_query_len=1, out=out, num_splits=num_splits,
                  tile=tile)
    ref = absorbed_attention_reference(q_lat, q_rope, cache, tables, [1, 1, 1], seq_lens, 0.3)
    assert relative_error(out, ref) < 1e-5


def test_decode_refuses_a_cache_in_another_wide_dtype():
    cache, tables, lens, q_lat, q_rope = decode_case(HEADS, [4], torch.float32, seed=3)
    qsl = torch.arange(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cache dtype torch.bfloat16"):
        mla_attention(q_lat, q_rope, cache.bfloat16(), tables, lens, qsl, 0.3, max_query_len=1)


@pytest.mark.parametrize("tile", [None, MLATile(True, 16, 16, 4, 1, block_t=2)], ids=["default", "token-major"])
def test_extend_over_a_cached_prefix_matches_reference(tile):
    gen = torch.Generator().manual_seed(2)
    query_lens, seq_lens = [3, 1, 7, 5], [3, 20, 40, 5]  # a prefill, a decode row, two chunks on a prefix
    cache, tables, lens = latent_setup(seq_lens, 4, gen)
    tokens = sum(query_lens)
    q_full = torch.randn(tokens, HEADS, 40, generator=gen).to(DEVICE)
    q_lat, q_rope = q_full[..., :RANK], q_full[..., 30 : 30 + ROPE]  # strided views
    qsl = torch.tensor([0, 3, 4, 11, 16], dtype=torch.int32, device=DEVICE)
    out = torch.full((tokens, HEADS, RANK), float("nan"), device=DEVICE)
    mla_attention(q_lat, q_rope, cache, tables, lens, qsl, 0.2, max_query_len=7, out=out, tile=tile)
    ref = absorbed_attention_reference(q_lat, q_rope, cache, tables, query_lens, seq_lens, 0.2)
    assert relative_error(out, ref) < 1e-5


def test_deepseek_v3_on_the_triton_mla_backend_matches_transformers(tmp_path):
    from model_utils import PagedHarness, hf_logits, relative_error
    from test_deepseek import _checkpoint

    from graphserve.config import EngineConfig
    from graphserve.layers.attention import TorchAttentionBackend
    from graphserve.models.loader import load_model

    hf = _checkpoint(tmp_path, "v3-noaux")
    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="float32", max_model_len=128), DEVICE)
    backend = TorchAttentionBackend()
    backend.mla = TritonMLABackend()  # the kernels, under the otherwise plain-PyTorch forward
    harness = PagedHarness(loaded.model, backend=backend, device=DEVICE)
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randint(4, 320, (9,), generator=gen).tolist(), torch.randint(4, 320, (6,), generator=gen).tolist()
    harness.step([("a", a[:5])])
    out = harness.step([("a", a[5:]), ("b", b)])  # a chunk on a cached prefix beside a fresh prefill
    assert relative_error(out[0].cpu(), hf_logits(hf, a)[5:]) < 1e-4
    assert relative_error(out[1].cpu(), hf_logits(hf, b)) < 1e-4
    nxt = [11, 12]
    got = torch.cat(harness.step([("a", [nxt[0]]), ("b", [nxt[1]])])).cpu()
    want = torch.stack([hf_logits(hf, a + [nxt[0]])[-1], hf_logits(hf, b + [nxt[1]])[-1]])
    assert relative_error(got, want) < 1e-4


def test_a_tile_out_of_shared_memory_falls_back_once(monkeypatch, caplog):
    """A tile the card cannot launch (a rule measured elsewhere, a smaller GPU) runs the fallback tile,
    says so once, and is not tried again."""
    from triton.runtime.errors import OutOfResources

    from graphserve.kernels.mla_config import DECODE_FP32

    too_big = MLATile(True, 16, 64, 4, 4)
    launched = []
    real_launch = mla_kernels._launch

    def launch(*args):
        launched.append(args[-1])
        if args[-1] == too_big:
            raise OutOfResources(300000, 232448, "shared memory")
        return real_launch(*args)

    monkeypatch.setattr(mla_kernels, "_launch", launch)
    monkeypatch.setattr(mla_kernels, "_UNFIT", set())
    seq_lens = [40, 9]
    cache, tables, lens, q_lat, q_rope = decode_case(HEADS, seq_lens, torch.float32, seed=11)
    qsl = torch.arange(3, dtype=torch.int32, device=DEVICE)
    ref = absorbed_attention_reference(q_lat, q_rope, cache, tables, [1, 1], seq_lens, 0.3)
    for _ in range(2):
        out = mla_attention(q_lat, q_rope, cache, tables, lens, qsl, 0.3, max_query_len=1, tile=too_big)
        assert relative_error(out, ref) < 1e-5
    assert launched == [too_big, DECODE_FP32, DECODE_FP32]  # the fallback of fp32 queries
    assert sum("does not fit" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_extend_runs_chunks_expanded_and_single_rows_absorbed(cache_dtype):
    """A mixed step on the Triton backend: a prefill, a chunk on a prefix and two single-token rows (the
    decode kernel, gathered), against the expanded fp32 reference; an fp8 cache widens on both paths."""
    from types import SimpleNamespace

    from graphserve.layers.mla import MLAttention
    from graphserve.layers.mla_reference import expanded_attention

    gen = torch.Generator().manual_seed(9)
    rotary = DeepseekRotary(ROPE, 64, {"rope_type": "default", "rope_theta": 10000.0}, 64, False)
    layer = MLAttention(32, HEADS, None, RANK, NOPE, ROPE, 12, False, rotary, 0.25, layer_idx=0).to(DEVICE)
    with torch.no_grad():
        layer.kv_b_proj.weight.copy_(torch.randn(layer.kv_b_proj.weight.shape, generator=gen) * 0.3)
    query_lens, seq_lens = [1, 6, 4, 1], [30, 6, 19, 1]
    cache, tables, lens = latent_setup(seq_lens, 4, gen)
    cache = cache.to(cache_dtype)
    q = torch.randn(sum(query_lens), HEADS, NOPE + ROPE, generator=gen).to(DEVICE)
    qsl = torch.tensor([0, 1, 7, 11, 12], dtype=torch.int32, device=DEVICE)
    batch = SimpleNamespace(query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, query_start_loc=qsl, seq_lens=lens,
                            block_tables=tables)  # fmt: skip
    with torch.no_grad():
        out = TritonMLABackend().extend(layer, q, cache, batch)
        ref = expanded_attention(q, cache.float(), layer.w_kv_b(), tables, query_lens, seq_lens, NOPE, 0.25)
    assert relative_error(out, ref) < 1e-5
