"""DeepSeek sparse attention kernels (kernels/dsa.py) on the GPU at GLM-5 and DeepSeek-V3.2 shapes (tp 1), bf16,
against the fp32 references (kernels/dsa_reference.py): the index cache write (bf16 and FP8, the compiled
e4m3 cast), indexer scores for decode and extend rows over both cache forms, top-k at k = 2048 from rows
shorter than k to 128k (both methods, tie-heavy scores), sparse MLA (both models, bf16 and fp8 latent
caches, decode and extend rows), and a whole DSA step (rows, cache writes, indexer, top-k, sparse MLA)
captured in a CUDA graph: replays on new inputs equal eager calls, padding rows included, outputs poisoned
before every run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_utils import capture, rel_err  # noqa: E402

from graphserve.kernels import dsa  # noqa: E402
from graphserve.kernels import dsa_reference as ref  # noqa: E402
from graphserve.kernels.dsa_topk import topk_indices_triton  # noqa: E402

# name: (heads, indexer heads); both: kv_lora 512, rope 64, index head dim 128, top-k 2048
MODELS = {"glm-5": (64, 32), "deepseek-v3.2": (128, 64)}
RANK, ROPE, DI, TOPK, PAGE = 512, 64, 128, 2048, 16  # PAGE: EngineConfig.block_size's default
BF16_TOL = 2e-2  # probabilities meet the latents in bf16, as in the dense MLA kernel (tests/gpu/test_mla.py)
SCORE_TOL = 1e-4  # bf16 products are exact in fp32: only the summation order differs


def paged(seq_lens: list[int], gen: torch.Generator, extra_blocks: int = 3):
    """(blocks, tables over shuffled blocks never using the dummy block 0, each sequence's slots), on the GPU."""
    per_seq = [-(-n // PAGE) for n in seq_lens]
    num_blocks = sum(per_seq) + extra_blocks
    order = torch.randperm(num_blocks - 1, generator=gen, device="cuda").int() + 1
    tables = torch.zeros(len(seq_lens), max(per_seq) + 1, dtype=torch.int32, device="cuda")
    used = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = order[used : used + nb]
        used += nb
    ar = [torch.arange(n, device="cuda") for n in seq_lens]
    slots = [tables[i, a // PAGE].long() * PAGE + a % PAGE for i, a in enumerate(ar)]
    return num_blocks, tables, slots


def rows(query_lens: list[int], seq_lens: list[int], padding: int):
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return dsa.token_rows(qsl, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), sum(query_lens) + padding)


def same_sets(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.sort(-1).values, want.sort(-1).values)


def index_cache(seq_lens, gen, fp8: bool):
    num_blocks, tables, slots = paged(seq_lens, gen)
    shape, dtype = ref.index_cache_shape(num_blocks, PAGE, DI, fp8)
    cache = torch.zeros(shape, dtype=dtype or torch.bfloat16, device="cuda")
    for n, s in zip(seq_lens, slots):
        dsa.write_index_cache(torch.randn(n, DI, generator=gen, device="cuda").bfloat16(), cache, s)
    return cache, tables


@pytest.mark.parametrize("fp8", [False, True])
def test_write_index_cache(gen, fp8):
    k = torch.randn(300, DI, generator=gen, device="cuda").bfloat16() * 3
    k[7] = 0
    slots = torch.randperm(40 * PAGE, generator=gen, device="cuda")[:300]
    shape, dtype = ref.index_cache_shape(40, PAGE, DI, fp8)
    cache = torch.randint(0, 255, shape, generator=gen, device="cuda", dtype=torch.uint8) if fp8 else \
        torch.randn(shape, generator=gen, device="cuda").bfloat16()  # fmt: skip
    want = cache.clone()
    dsa.write_index_cache(k, cache, slots)
    ref.write_index_cache(k, want, slots)
    if not fp8:
        assert torch.equal(cache, want)
        return
    flat, flat_ref = cache.view(-1, DI + 4), want.view(-1, DI + 4)
    assert torch.equal(flat[:, DI:], flat_ref[:, DI:])  # the scales, bit for bit
    # the kernel's division may land on the other side of an e4m3 rounding boundary, rarely and by one step
    differ = flat[:, :DI] != flat_ref[:, :DI]
    assert differ.float().mean() < 1e-3
    back, back_ref = ref.read_index_keys(cache, slots), ref.read_index_keys(want, slots)
    assert ((back - back_ref).abs() <= back_ref.abs() / 8).all()


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_scores(gen, model, fp8):
    _, hi = MODELS[model]
    seq_lens, query_lens = [5000, 3100, 17, 777], [1, 33, 1, 1]  # decode rows and an extend chunk
    cache, tables = index_cache(seq_lens, gen, fp8)
    seq, pos = rows(query_lens, seq_lens, padding=3)
    t = seq.shape[0]
    q = torch.randn(t, hi, DI, generator=gen, device="cuda").bfloat16()
    weights = torch.randn(t, hi, generator=gen, device="cuda") * hi**-0.5 * DI**-0.5
    max_len = 5120
    got = torch.full((t, max_len), float("nan"), device="cuda")
    dsa.indexer_scores(q, weights, cache, tables, seq, pos, max_len, out=got)
    want = ref.indexer_scores(q, weights, cache, tables, seq, pos, max_len)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not got.isnan().any()
    finite = torch.isfinite(want)
    assert rel_err(got[finite], want[finite]) < SCORE_TOL


@pytest.mark.parametrize("method", ["triton", "torch"])
def test_topk_real_k(gen, method):
    length = 131072
    pos = torch.tensor([131071, 2046, 2047, 2048, 0, 40000, 99999, 131071], dtype=torch.int32, device="cuda")
    scores = torch.randn(8, length, generator=gen, device="cuda")
    scores[1::2] = torch.randint(-4, 5, (4, length), generator=gen, device="cuda").float()  # ties everywhere
    scores = scores.masked_fill(torch.arange(length, device="cuda")[None, :] > pos[:, None].long(), float("-inf"))
    out = torch.full((8, TOPK), -7, dtype=torch.int32, device="cuda")
    got = dsa.topk_indices(scores, pos, TOPK, method=method) if method == "torch" else \
        topk_indices_triton(scores, pos, TOPK, out=out)  # fmt: skip
    assert same_sets(got, ref.topk_indices(scores, pos, TOPK))


def latent_cache(seq_lens, gen, fp8: bool):
    num_blocks, tables, _ = paged(seq_lens, gen)
    cache = torch.randn(num_blocks, PAGE, 1, RANK + ROPE, generator=gen, device="cuda").bfloat16()
    return (cache.to(torch.float8_e4m3fn) if fp8 else cache), tables


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_mla(gen, model, fp8):
    heads, _ = MODELS[model]
    seq_lens, query_lens = [6000, 2500, 1500, 9000], [1, 1, 1, 20]  # the third row selects fewer than k
    cache, tables = latent_cache(seq_lens, gen, fp8)
    seq, pos = rows(query_lens, seq_lens, padding=2)
    t = seq.shape[0]
    scores = torch.rand(t, max(seq_lens), generator=gen, device="cuda")
    idx = ref.topk_indices(scores, pos, TOPK)
    q_lat = torch.randn(t, heads, RANK, generator=gen, device="cuda").bfloat16()
    q_rope = torch.randn(t, heads, ROPE, generator=gen, device="cuda").bfloat16()
    scale = (128 + ROPE) ** -0.5
    out = torch.full_like(q_lat, float("nan"))
    dsa.sparse_mla(q_lat, q_rope, cache, tables, seq, idx, scale, out=out)
    want = ref.sparse_mla(q_lat, q_rope, cache, tables, seq, idx, scale)
    assert rel_err(out, want) < BF16_TOL


@pytest.mark.parametrize("model", list(MODELS))
def test_dsa_step_graph_replay_equals_eager(gen, model):
    """token_rows, both cache writes' index part, indexer + top-k and sparse MLA as one captured step, on static
    buffers: new inputs (and new context lengths) copied in, the graph replayed, against eager calls."""
    heads, hi = MODELS[model]
    real, padded, max_len = 3, 5, 8192
    seq_lens = [3000, 7000, 2049]
    n_idx, tables, slots = paged(seq_lens, gen, extra_blocks=64)
    idx_cache = torch.randn(n_idx, PAGE, DI, generator=gen, device="cuda").bfloat16()
    lat_cache = torch.randn(n_idx, PAGE, 1, RANK + ROPE, generator=gen, device="cuda").bfloat16()
    table = torch.zeros(padded, max_len // PAGE, dtype=torch.int32, device="cuda")  # padding rows: dummy block
    table[:real, : tables.shape[1]] = tables
    static = {
        "qsl": torch.arange(padded + 1, dtype=torch.int32, device="cuda"),
        "seq_lens": torch.ones(padded, dtype=torch.int32, device="cuda"),
        "slots": torch.zeros(padded, dtype=torch.int64, device="cuda"),
        "k": torch.zeros(padded, DI, dtype=torch.bfloat16, device="cuda"),
        "q": torch.zeros(padded, hi, DI, dtype=torch.bfloat16, device="cuda"),
        "w": torch.zeros(padded, hi, device="cuda"),
        "q_lat": torch.zeros(padded, heads, RANK, dtype=torch.bfloat16, device="cuda"),
        "q_rope": torch.zeros(padded, heads, ROPE, dtype=torch.bfloat16, device="cuda"),
    }

    def step():
        seq, pos = dsa.token_rows(static["qsl"], static["seq_lens"], padded)
        dsa.write_index_cache(static["k"], idx_cache, static["slots"])
        idx = dsa.indexer_topk(static["q"], static["w"], idx_cache, table, seq, pos, max_len, TOPK)
        return idx, dsa.sparse_mla(static["q_lat"], static["q_rope"], lat_cache, table, seq, idx, 0.1)

    def fill(lens: list[int]) -> None:
        static["seq_lens"][:real] = torch.tensor(lens, dtype=torch.int32, device="cuda")
        static["seq_lens"][real:] = 1
        static["slots"][:real] = torch.stack([s[n - 1] for s, n in zip(slots, lens)])
        static["slots"][real:] = 0  # padding rows write the dummy block
        for name in ("k", "q", "q_lat", "q_rope"):
            static[name].copy_(torch.randn(static[name].shape, generator=gen, device="cuda"))
        static["w"].copy_(torch.rand(static["w"].shape, generator=gen, device="cuda"))

    fill([n - 2 for n in seq_lens])
    graph, (g_idx, g_out) = capture(step)
    for lens in ([n - 1 for n in seq_lens], seq_lens):
        fill(lens)
        saved = idx_cache.clone()
        g_idx.fill_(-7)
        g_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replay_idx, replay_out, replay_cache = g_idx.clone(), g_out.clone(), idx_cache.clone()
        idx_cache.copy_(saved)
        e_idx, e_out = step()
        # block 0 left out: both padding rows write the dummy slot, and which lands last is up to the GPU
        assert torch.equal(replay_cache[1:], idx_cache[1:])
        assert torch.equal(replay_idx, e_idx) and torch.equal(replay_out, e_out)
        assert not replay_out.isnan().any() and (replay_idx[:real] >= 0).all()
        # the reference's selection from the kernel's own scores (test_indexer_scores compares the scores): fp32
        # summation order may swap two near-equal scores at the k-th place, never the rule
        seq, pos = dsa.token_rows(static["qsl"], static["seq_lens"], padded)
        scores = dsa.indexer_scores(static["q"], static["w"], idx_cache, table, seq, pos, max_len)
        assert same_sets(replay_idx, ref.topk_indices(scores, pos, TOPK))
        want = ref.sparse_mla(static["q_lat"], static["q_rope"], lat_cache, table, seq, replay_idx, 0.1)
        assert rel_err(replay_out, want) < BF16_TOL
