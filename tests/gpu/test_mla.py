"""MLA on the GPU: the kernels at DeepSeek-V2-Lite and V3 shapes in bf16 against the fp32 references
(decode with the default tiles, both layouts, several head blocks, every tile the sweep may choose and
an fp8 cache; the engine's expanded prefill/extend), CUDA-graph replay of decode, tiny checkpoints in bf16 against transformers, graphs against eager
through the engine, and dummy:deepseek-v2-lite served with graphs on; with --kv-cache-dtype fp8_e4m3 the
prologue's saturating writes, the kernels against the PyTorch path on an e4m3 cache, graphs against eager,
and teacher-forced logits beside a bf16 cache's."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_utils import capture, rel_err  # noqa: E402
from model_utils import PagedHarness, hf_logits, make_hf_checkpoint, relative_error  # noqa: E402
from test_deepseek import _TINY, _checkpoint  # noqa: E402
from test_mla_fp8_kv import LOGITS_TOL  # noqa: E402
from transformers import DeepseekV2Config, DeepseekV3Config  # noqa: E402

import graphserve.kernels.mla_attention as mla_kernels  # noqa: E402
from benchmarks.mla import CANDIDATES  # noqa: E402
from graphserve import LLM, SamplingParams  # noqa: E402
from graphserve.config import EngineConfig  # noqa: E402
from graphserve.kernels.mla_attention import mla_attention  # noqa: E402
from graphserve.kernels.mla_config import MLATile, decode_tile  # noqa: E402
from graphserve.kernels.mla_prologue import mla_prologue, mla_prologue_reference  # noqa: E402
from graphserve.layers.attention import TorchAttentionBackend  # noqa: E402
from graphserve.layers.attention_triton import TritonAttentionBackend  # noqa: E402
from graphserve.layers.mla_reference import absorbed_attention_reference  # noqa: E402
from graphserve.layers.mla_rope import DeepseekRotary  # noqa: E402
from graphserve.models.loader import load_model  # noqa: E402

DT = torch.bfloat16
FP8 = torch.float8_e4m3fn
RANK, ROPE, NOPE, PAGE = 512, 64, 128, 16
BF16_TOL = 2e-2
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


pytestmark = pytest.mark.usefixtures("release_engines")


def latent_cache(seq_lens: list[int], gen: torch.Generator):
    per_seq = [(n + PAGE - 1) // PAGE for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    cache = torch.randn(num_blocks, PAGE, 1, RANK + ROPE, device="cuda", generator=gen).mul_(0.5).to(DT)
    order = torch.randperm(num_blocks - 1, device="cuda", generator=gen).int() + 1
    tables = torch.zeros(len(seq_lens), max(per_seq) + 1, dtype=torch.int32, device="cuda")
    used = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = order[used : used + nb]
        used += nb
    return cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("interleaved", [True, False])
def test_prologue_real_shapes(heads, interleaved, gen):
    tokens = 37
    rotary = DeepseekRotary(ROPE, 8192, _YARN, 163840, interleaved)
    rotary.rebuild(torch.device("cuda"))
    q = torch.randn(tokens, heads, NOPE + ROPE, device="cuda", generator=gen).to(DT)
    fused = torch.randn(tokens, 1536 + RANK + ROPE, device="cuda", generator=gen).to(DT)
    kv_a = fused[:, 1536:]
    positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=gen)
    weight = (1 + 0.2 * torch.randn(RANK, device="cuda", generator=gen)).to(DT)
    slots = torch.randperm(64 * PAGE, device="cuda", generator=gen)[:tokens]
    cache = torch.zeros(64, PAGE, 1, RANK + ROPE, device="cuda", dtype=DT)
    q_ref, cache_ref = q.clone(), cache.clone()
    mla_prologue(q, kv_a, positions, rotary.cos_sin_cache, weight, 1e-6, cache, slots, NOPE, interleaved)
    mla_prologue_reference(q_ref, kv_a, positions, rotary.cos_sin_cache, weight, 1e-6, cache_ref, slots, NOPE,
                           interleaved)
    assert rel_err(q, q_ref) < 1e-2
    assert rel_err(cache, cache_ref) < 1e-2


def same_fp8_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two e4m3 tensors written by the same roundings in the same order: equal but where the two sides'
    fp32 arithmetic (the kernel's sqrt and division against torch's rsqrt, fused multiply-adds) straddles
    a bf16 or e4m3 midpoint, there one e4m3 step apart (2^-3 relative, 2^-9 among subnormals)."""
    got, want = got.float(), want.float()
    assert not got.isnan().any() and not want.isnan().any()
    assert ((got - want).abs() <= want.abs() * 2**-3 + 2**-9).all()
    assert (got == want).float().mean().item() > 0.98


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("interleaved", [True, False])
def test_prologue_writes_an_fp8_cache_at_real_shapes(heads, interleaved, gen):
    """bf16 model, e4m3 cache: the norm and the rotated key rounded to bf16 as the PyTorch path rounds
    them, then cast; a latent past +-448 (norm weight 600) and a rope key of 1000 store as +-448."""
    tokens = 37
    rotary = DeepseekRotary(ROPE, 8192, _YARN, 163840, interleaved)
    rotary.rebuild(torch.device("cuda"))
    q = torch.randn(tokens, heads, NOPE + ROPE, device="cuda", generator=gen).to(DT)
    fused = torch.randn(tokens, 1536 + RANK + ROPE, device="cuda", generator=gen).to(DT)
    fused[:, 1536 + 3] = 3.0  # normed to about 3, times 600 below
    fused[0, 1536 + RANK] = 1000.0  # the rope key's first element, at position 0: cos 1, sin 0
    kv_a = fused[:, 1536:]
    positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=gen)
    positions[0] = 0
    weight = (1 + 0.2 * torch.randn(RANK, device="cuda", generator=gen)).to(DT)
    weight[3] = 600.0
    slots = torch.randperm(64 * PAGE, device="cuda", generator=gen)[:tokens]
    cache = torch.full((64, PAGE, 1, RANK + ROPE), float("nan"), device="cuda").to(FP8)
    q_ref, cache_ref = q.clone(), cache.clone()
    mla_prologue(q, kv_a, positions, rotary.cos_sin_cache, weight, 1e-6, cache, slots, NOPE, interleaved)
    mla_prologue_reference(q_ref, kv_a, positions, rotary.cos_sin_cache, weight, 1e-6, cache_ref, slots, NOPE,
                           interleaved)
    assert rel_err(q, q_ref) < 1e-2
    got, want = cache.view(-1, RANK + ROPE)[slots], cache_ref.view(-1, RANK + ROPE)[slots]
    same_fp8_rounding(got, want)
    assert (got[:, 3].float() == 448.0).all() and got[0, RANK].float().item() == 448.0
    assert cache.view(-1, RANK + ROPE).float().isnan().any(-1).sum().item() == 64 * PAGE - tokens  # others untouched


def decode_inputs(heads: int, lens: list[int], gen: torch.Generator, cache_dtype: torch.dtype = DT):
    cache, tables, seq_lens = latent_cache(lens, gen)
    batch = len(lens)
    q_lat = torch.randn(batch, heads, RANK, device="cuda", generator=gen).mul_(0.1).to(DT)
    q_rope = torch.randn(batch, heads, ROPE, device="cuda", generator=gen).mul_(0.1).to(DT)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return cache.to(cache_dtype), tables, seq_lens, q_lat, q_rope, qsl


def random_lens(batch: int, ctx: int) -> list[int]:
    lens = torch.randint(1, ctx + 1, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    lens[0] = ctx
    return lens


# the code defaults (None), both layouts, and V3's heads in 8, 2 and 1 head blocks
TILES = {16: [None, "hm-h16n16w4s2o2", "tm-h16n32w4s3o2", "tm-h16n64w4s2o1"],
         128: [None, "hm-h16n16w4s2o2", "hm-h32n32w8s3o1", "tm-h64n32w8s3o1"]}


@pytest.mark.parametrize(("heads", "batch", "ctx"), [(16, 1, 4096), (16, 64, 1024), (16, 256, 300),
                                                     (128, 4, 2048), (128, 64, 512)])
@pytest.mark.parametrize("tile_index", range(4))
def test_decode_real_shapes(heads, batch, ctx, tile_index, gen):
    name = TILES[heads][tile_index]
    tile = MLATile.parse(name) if name else None
    lens = random_lens(batch, ctx)
    cache, tables, seq_lens, q_lat, q_rope, qsl = decode_inputs(heads, lens, gen)
    out = mla_attention(q_lat, q_rope, cache, tables, seq_lens, qsl, 0.1147, max_query_len=1, tile=tile)
    ref = absorbed_attention_reference(q_lat, q_rope, cache, tables, [1] * batch, lens, 0.1147)
    assert rel_err(out, ref) < BF16_TOL
    chosen = tile or decode_tile(heads, batch, tables.shape[1] * PAGE, DT, cache.device)
    assert chosen not in mla_kernels._UNFIT  # it ran itself, not the fallback tile


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [1, 7])
def test_every_sweep_candidate_matches_reference(heads, num_splits, gen):
    """What benchmarks/mla.py --sweep may write into the rule: each candidate, written directly and merged."""
    lens = random_lens(8, 1000)
    cache, tables, seq_lens, q_lat, q_rope, qsl = decode_inputs(heads, lens, gen)
    ref = absorbed_attention_reference(q_lat, q_rope, cache, tables, [1] * 8, lens, 0.1147)
    for name in CANDIDATES[heads]:
        tile = MLATile.parse(f"{name}o1")
        out = mla_attention(q_lat, q_rope, cache, tables, seq_lens, qsl, 0.1147, max_query_len=1, tile=tile,
                            num_splits=num_splits)
        if tile in mla_kernels._UNFIT:  # needs more shared memory than this card has: the sweep skips it too
            continue
        assert rel_err(out, ref) < BF16_TOL, name


@pytest.mark.parametrize("heads", [16, 128])
def test_decode_reads_an_fp8_cache(heads, gen):
    lens = random_lens(32, 3000)
    cache, tables, seq_lens, q_lat, q_rope, qsl = decode_inputs(heads, lens, gen, torch.float8_e4m3fn)
    out = mla_attention(q_lat, q_rope, cache, tables, seq_lens, qsl, 0.1147, max_query_len=1)
    ref = absorbed_attention_reference(q_lat, q_rope, cache.float(), tables, [1] * 32, lens, 0.1147)  # same values
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize("heads", [16, 128])
def test_extend_real_shapes(heads, gen):
    query_lens, seq_lens = [64, 1, 200, 33], [64, 3000, 1200, 33]
    cache, tables, lens = latent_cache(seq_lens, gen)
    tokens = sum(query_lens)
    q_lat = torch.randn(tokens, heads, RANK, device="cuda", generator=gen).mul_(0.1).to(DT)
    q_rope = torch.randn(tokens, heads, ROPE, device="cuda", generator=gen).mul_(0.1).to(DT)
    qsl = torch.tensor([0, 64, 65, 265, 298], dtype=torch.int32, device="cuda")
    out = mla_attention(q_lat, q_rope, cache, tables, lens, qsl, 0.1147, max_query_len=200)
    ref = absorbed_attention_reference(q_lat, q_rope, cache, tables, query_lens, seq_lens, 0.1147)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize("heads", [16, 128])
def test_engine_extend_expanded_at_real_shapes(heads, gen):
    """The engine's prefill/extend (layers/mla_expanded.py): a decode row, a prefill, a chunk on a long
    prefix (V3's 128 heads at 3000 tokens take two passes of the K/V workspace) and another decode row."""
    from types import SimpleNamespace

    from graphserve.layers.mla import MLAttention
    from graphserve.layers.mla_reference import expanded_attention
    from graphserve.layers.mla_triton import TritonMLABackend

    rotary = DeepseekRotary(ROPE, 8192, _YARN, 163840, False)
    layer = MLAttention(2048, heads, None, RANK, NOPE, ROPE, 128, False, rotary, 0.1147, layer_idx=0)
    layer = layer.to(device="cuda", dtype=DT)
    with torch.no_grad():
        layer.kv_b_proj.weight.copy_(torch.randn(layer.kv_b_proj.weight.shape, device="cuda", generator=gen) * 0.05)
    query_lens, seq_lens = [1, 300, 64, 1], [3000, 300, 3000, 17]
    cache, tables, lens = latent_cache(seq_lens, gen)
    q = torch.randn(sum(query_lens), heads, NOPE + ROPE, device="cuda", generator=gen).to(DT)
    qsl = torch.tensor([0, 1, 301, 365, 366], dtype=torch.int32, device="cuda")
    batch = SimpleNamespace(query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, query_start_loc=qsl, seq_lens=lens,
                            block_tables=tables)  # fmt: skip
    with torch.no_grad():
        out = TritonMLABackend().extend(layer, q, cache, batch)
        ref = expanded_attention(q, cache, layer.w_kv_b(), tables, query_lens, seq_lens, NOPE, 0.1147)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize(("heads", "tile_name", "cache_dtype"), [(16, None, DT), (16, "tm-h16n32w4s3o2", DT),
                                                                (16, None, torch.float8_e4m3fn), (128, None, DT)])
def test_decode_replays_from_a_cuda_graph(heads, tile_name, cache_dtype, gen):
    """Captured once with static buffers; replayed after new lengths, tables and queries are copied in,
    including padding rows (length 0) past the real batch."""
    batch, max_ctx = 8, 2048
    tile = MLATile.parse(tile_name) if tile_name else None
    cache, tables, seq_lens = latent_cache([max_ctx] * batch, gen)
    cache = cache.to(cache_dtype)
    q_lat = torch.zeros(batch, heads, RANK, device="cuda", dtype=DT)
    q_rope = torch.zeros(batch, heads, ROPE, device="cuda", dtype=DT)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_lat)

    def step():
        mla_attention(q_lat, q_rope, cache, tables, seq_lens, qsl, 0.1, max_query_len=1, out=out, tile=tile)

    graph, _ = capture(step)
    for trial in range(3):
        lens = torch.randint(1, max_ctx + 1, (batch,), generator=torch.Generator().manual_seed(trial)).tolist()
        lens[-2:] = [0, 0]  # padding rows
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        tables.copy_(tables[torch.randperm(batch, device="cuda", generator=gen)])
        q_lat.copy_(torch.randn(q_lat.shape, device="cuda", generator=gen).mul_(0.1))
        q_rope.copy_(torch.randn(q_rope.shape, device="cuda", generator=gen).mul_(0.1))
        graph.replay()
        torch.cuda.synchronize()
        ref = absorbed_attention_reference(q_lat[:-2], q_rope[:-2], cache.float(), tables, [1] * (batch - 2),
                                           lens[:-2], 0.1)  # fp8 widens exactly
        assert rel_err(out[:-2], ref) < BF16_TOL
        assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))


# every layer dense: in bf16 a near-tie in the router may pick another expert than fp32 transformers
# does, which says nothing about attention (the MoE kernels have their own tests in test_moe.py)
DENSE = {
    "v2-no-q-lora": lambda: DeepseekV2Config(**{**_TINY, "first_k_dense_replace": 3}, q_lora_rank=None,
                                             rope_scaling={**_YARN, "factor": 4.0, "original_max_position_embeddings": 64}),
    "v3-q-lora": lambda: DeepseekV3Config(**{**_TINY, "first_k_dense_replace": 3}, q_lora_rank=24, n_group=4,
                                          topk_group=2, rope_theta=10000.0),
}


@pytest.mark.parametrize("name", sorted(DENSE))
def test_bf16_model_on_kernels_matches_fp32_transformers(name, tmp_path):
    hf = make_hf_checkpoint(tmp_path, DENSE[name]())
    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cuda", max_model_len=128),
                        torch.device("cuda"))
    harness = PagedHarness(loaded.model, block_size=16, num_blocks=32, dtype=DT, device="cuda",
                           backend=TritonAttentionBackend())
    g = torch.Generator().manual_seed(7)
    seqs = {s: torch.randint(4, 320, (n,), generator=g).tolist() for s, n in (("a", 9), ("b", 37))}
    with torch.inference_mode():
        harness.step([("b", seqs["b"][:17])])
        out = harness.step([("a", seqs["a"]), ("b", seqs["b"][17:])])
        for (seq, start), got in zip((("a", 0), ("b", 17)), out):
            assert relative_error(got.float().cpu(), hf_logits(hf, seqs[seq])[start:]) < BF16_TOL, seq
        for _ in range(3):
            for s in seqs:
                seqs[s].append(int(torch.randint(4, 320, (1,), generator=g)))
            got = torch.cat(harness.step([(s, [seqs[s][-1]]) for s in seqs])).float().cpu()
            want = torch.stack([hf_logits(hf, seqs[s])[-1] for s in seqs])
            assert relative_error(got, want) < BF16_TOL


@pytest.mark.parametrize("name", sorted(DENSE))
def test_fp8_latent_cache_on_kernels_matches_the_torch_path(name, tmp_path):
    """bf16 model, --kv-cache-dtype fp8_e4m3: the prologue, the expanded prefill/extend and the decode kernel
    against the PyTorch MLA path (fp32 attention math) on its own e4m3 cache, step by step. Both write the
    same e4m3 bytes (up to same_fp8_rounding's rare step), so what is left between the logits is the
    kernels' bf16 attention."""
    make_hf_checkpoint(tmp_path, DENSE[name]())
    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cuda", max_model_len=128,
                                     kv_cache_dtype="fp8_e4m3"), torch.device("cuda"))  # fmt: skip
    assert loaded.info.kv.dtype == FP8 and loaded.info.kv_bytes_per_token == 3 * (32 + 8)  # 1 byte an element
    harnesses = []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        harness = PagedHarness(loaded.model, block_size=16, num_blocks=32, dtype=DT, device="cuda", backend=backend)
        harness.kv_caches = loaded.info.kv.allocate(32, 16, torch.device("cuda"))  # the engine's pool: e4m3
        harnesses.append(harness)
    kernels, torch_path = harnesses
    g = torch.Generator().manual_seed(7)
    seqs = {s: torch.randint(4, 320, (n,), generator=g).tolist() for s, n in (("a", 9), ("b", 37))}
    steps = [[("b", seqs["b"][:17])], [("a", seqs["a"]), ("b", seqs["b"][17:])]]
    for _ in range(3):
        steps.append([(s, [int(torch.randint(4, 320, (1,), generator=g))]) for s in seqs])
    with torch.inference_mode():
        for i, chunks in enumerate(steps):
            got, want = torch.cat(kernels.step(chunks)), torch.cat(torch_path.step(chunks))
            assert rel_err(got, want) < BF16_TOL, i
    assert kernels.kv_caches[0].view(torch.uint8).any()
    same_fp8_rounding(kernels.kv_caches[0], torch_path.kv_caches[0])


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_engine_graphs_match_eager(kv_cache_dtype, tmp_path):
    """The V3 checkpoint (MoE layers included) in fp32: decode replayed from graphs gives the eager tokens,
    on a cache in the model dtype and on an e4m3 one.
    (Greedy tokens against transformers' generate are checked on CPU, tests/models/test_deepseek.py.)"""
    _checkpoint(tmp_path, "v3-noaux")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 320, (n,), generator=g).tolist() for n in (3, 11, 26, 40, 7)]
    eager = LLM(str(tmp_path), device="cuda", dtype="float32", disable_cuda_graph=True, kv_cache_dtype=kv_cache_dtype)
    expected = _greedy(eager, prompts)
    del eager
    gc.collect()
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", cuda_graph_max_bs=8, kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.core.runner.kv_caches[0].dtype == (FP8 if kv_cache_dtype == "fp8_e4m3" else torch.float32)
    assert _greedy(llm, prompts) == expected
    decode = [r for r in llm.engine.core.telemetry.records() if r.kind == "decode"]
    assert decode and all(r.graph for r in decode)


def test_fp8_cache_logits_track_a_bf16_cache_teacher_forced(tmp_path):
    """The bf16 model on an e4m3 latent cache beside a bf16 one, through the Triton backend (the prologue's
    writes, the expanded prefill, the decode kernel): two prefills, then decode steps that feed both caches the
    bf16 run's greedy tokens, so a near tie that e4m3's rounding flips cannot fork the sequences. The top-1
    agreement is printed; every step's logits must differ (the fp8 cache is really read) by less than the bound
    the CPU test justifies for the same 3 dense layers (tests/models/test_mla_fp8_kv.py, LOGITS_TOL: each cached element
    rounds by at most 2^-4 relative; a misplaced row or a byte read as a value moves the logits by their size)."""
    make_hf_checkpoint(tmp_path, DENSE["v3-q-lora"]())
    harnesses = {}
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        loaded = load_model(EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cuda", max_model_len=256,
                                         kv_cache_dtype=kv_cache_dtype), torch.device("cuda"))  # fmt: skip
        harness = PagedHarness(loaded.model, block_size=16, num_blocks=64, dtype=DT, device="cuda",
                               backend=TritonAttentionBackend())
        harness.kv_caches = loaded.info.kv.allocate(64, 16, torch.device("cuda"))  # the engine's pool
        harnesses[kv_cache_dtype] = harness
    ref, test = harnesses["auto"], harnesses["fp8_e4m3"]
    assert test.kv_caches[0].dtype == FP8 and ref.kv_caches[0].dtype == DT
    g = torch.Generator().manual_seed(5)
    chunk = [(s, torch.randint(4, 320, (n,), generator=g).tolist()) for s, n in (("a", 23), ("b", 70), ("c", 5))]
    errors, agree = [], []
    with torch.inference_mode():
        for _ in range(12):
            a = torch.stack([x[-1] for x in ref.step(chunk)]).float()
            b = torch.stack([x[-1] for x in test.step(chunk)]).float()
            errors.append(rel_err(b, a))
            agree.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
            chunk = [(s, [int(t)]) for (s, _), t in zip(chunk, a.argmax(-1))]  # both follow the bf16 tokens
    print(f"fp8 against bf16 latent cache, teacher-forced: logits relative error max {max(errors):.3e}, "
          f"top-1 agreement {sum(agree) / len(agree):.3f}")
    assert all(1e-3 < e < LOGITS_TOL for e in errors), errors


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_dummy_v2_lite_serves_with_graphs(kv_cache_dtype):
    llm = LLM("dummy:deepseek-v2-lite", device="cuda", max_model_len=4096, cuda_graph_max_bs=16,
              kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    info = llm.engine.core.runner.info
    assert info.kv.kind == "latent" and info.kv_bytes_per_token == 27 * 576 * info.kv.dtype.itemsize
    assert info.kv.dtype == (FP8 if kv_cache_dtype == "fp8_e4m3" else DT)
    outs = _greedy(llm, [[100000 + 2 + i] + list(range(1000, 1000 + 50 * i)) for i in range(6)], n=24)
    assert all(len(t) == 24 for t in outs)
    decode = [r for r in llm.engine.core.telemetry.records() if r.kind == "decode"]
    assert decode and all(r.graph for r in decode)
    llm.engine.core.block_manager.check_no_leak()


@pytest.mark.parametrize("scale", [1.0, 16.0])
def test_greedy_v2_router_kernel_matches_reference(scale, gen):
    from graphserve.layers.moe_router_deepseek import SoftmaxGroupTopK, softmax_group_topk_reference

    logits = torch.randn(300, 64, device="cuda", generator=gen)
    weights, ids = SoftmaxGroupTopK(64, 6, 1, 1, scale)(logits)
    ref_w, ref_ids = softmax_group_topk_reference(logits, 6, 1, 1, scale)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    assert torch.allclose(weights.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-5, atol=1e-6)
