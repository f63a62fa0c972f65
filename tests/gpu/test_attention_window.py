"""Sliding windows and attention sinks in the Triton attention kernels on the GPU, in bf16 at model shapes, against
their PyTorch references.

Shapes: Mistral-7B v0.1 (32 query heads, 8 kv heads, head_dim 128, window 4096) and gpt-oss (64 query heads, 8 kv
heads, head_dim 64, window 128, sinks). Every cache position wholly before a query's window holds NaN and the
blocks wholly before it point at the dummy block 0 (NaN too), as the engine leaves a windowed sequence whose
blocks went back to the pool: a kernel that read one would put NaN in its output. The decode kernel is captured in
a CUDA graph with padding rows and replayed on new lengths, tables and queries, and must match an eager call bit for
bit. Tiny sliding-window checkpoints (tests/models/test_models_window.py) run through the Triton backend against
transformers, and through the engine with CUDA graphs on a pool they fit only by giving back blocks outside their
windows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gpu_utils import capture, greedy_with_and_without_graphs, rel_err
from test_kernels import PAGE, lengths, paged

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_utils import (  # noqa: E402
    check_paged_parity,
    hf_greedy,
    make_hf_checkpoint,
    random_prompts,
)
from test_models_window import CONFIGS  # noqa: E402

from graphserve.config import EngineConfig  # noqa: E402
from graphserve.kernels.decode_attention import (  # noqa: E402
    NewToken,
    decode_attention,
    decode_attention_qkv,
    decode_attention_reference,
)
from graphserve.kernels.extend_attention import extend_attention, extend_attention_reference  # noqa: E402
from graphserve.kernels.qk_rope_kv import qk_norm_rope_kv_write  # noqa: E402
from graphserve.kernels.rotary import rotary_cos_sin  # noqa: E402
from graphserve.layers.attention import TorchAttentionBackend  # noqa: E402
from graphserve.layers.attention_triton import TritonAttentionBackend  # noqa: E402
from graphserve.layers.forward_batch import ForwardBatch  # noqa: E402
from graphserve.models.loader import load_model  # noqa: E402

DT = torch.bfloat16
TOL = 2e-2
# (query heads, kv heads, head_dim, window, sinks)
SHAPES = {"mistral-7b-v0.1": (32, 8, 128, 4096, False), "gpt-oss": (64, 8, 64, 128, True)}


def released(cache, tables, first_seen):
    """(cache, tables) as the engine leaves them once sequence i's keys before ``first_seen[i]`` are out of every
    window: those positions NaN, the blocks wholly before them at the dummy block 0 (NaN)."""
    cache, tables = cache.clone(), tables.clone()
    cache[:, 0] = float("nan")
    for i, lo in enumerate(first_seen):
        whole, part = divmod(lo, PAGE)
        if part:
            cache[:, int(tables[i, whole]), :part] = float("nan")
        tables[i, :whole] = 0
    return cache, tables


def sinks_for(heads: int, with_sinks: bool, gen: torch.Generator) -> torch.Tensor | None:
    return torch.randn(heads, device="cuda", generator=gen) * 2 if with_sinks else None


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize(("batch", "max_ctx"), [(1, 9000), (8, 6000), (64, 2048), (256, 700)])
def test_decode_attention_reads_only_the_window(model, batch, max_ctx, gen):
    hq, hkv, d, window, with_sinks = SHAPES[model]
    seq_lens = lengths(batch, max_ctx, gen)
    cache, tables, lens = paged(seq_lens, hkv, d, DT, gen)
    q = torch.randn(batch, hq, d, device="cuda", generator=gen).to(DT)
    sinks = sinks_for(hq, with_sinks, gen)
    ref = decode_attention_reference(q, cache, tables, lens, d**-0.5, window, sinks)
    cache, tables = released(cache, tables, [max(0, n - window) for n in seq_lens])
    out = torch.full_like(q, float("nan"))
    decode_attention(q, cache, tables, lens, d**-0.5, out=out, window=window, sinks=sinks)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL
    for num_splits in (1, 5):  # every split count, merged in the kernel and by the separate launch
        for fused in (True, False):
            again = decode_attention(q, cache, tables, lens, d**-0.5, num_splits=num_splits, fused_merge=fused,
                                     window=window, sinks=sinks)  # fmt: skip
            assert rel_err(again, ref) < TOL


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [([2048], [2048]), ([5000, 300, 4200], [600, 300, 1]), ([3000, 129], [3000, 129])],
)
def test_extend_attention_reads_only_the_windows(model, seq_lens, query_lens, gen):
    hq, hkv, d, window, with_sinks = SHAPES[model]
    cache, tables, lens = paged(seq_lens, hkv, d, DT, gen)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(int(starts[-1]), hq, d, device="cuda", generator=gen).to(DT)
    sinks = sinks_for(hq, with_sinks, gen)
    ref = extend_attention_reference(q, cache, tables, lens, starts, d**-0.5, window, sinks)
    cache, tables = released(cache, tables, [max(0, n - ql - window + 1) for n, ql in zip(seq_lens, query_lens)])
    out = torch.full_like(q, float("nan"))
    extend_attention(q, cache, tables, lens, starts, max(query_lens), d**-0.5, out=out, window=window, sinks=sinks)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize(("batch", "padding"), [(1, 0), (8, 3), (64, 13)])
def test_decode_cuda_graph_replay_with_padding_rows_matches_eager(model, batch, padding, gen):
    """A captured decode step (window and sinks) replayed on new lengths, tables and queries equals the eager call
    bit for bit; padding rows (length 0, tables at the dummy block) come out zero and disturb no real row."""
    hq, hkv, d, window, with_sinks = SHAPES[model]
    real = batch - padding
    ctx = window * 3
    backend = TritonAttentionBackend()
    ws, counters = backend.reserve(hq, hkv, d, torch.device("cuda"), DT)
    sinks = sinks_for(hq, with_sinks, gen)

    def inputs():
        cache, tables, lens = paged(lengths(real, ctx, gen) + [0] * padding, hkv, d, DT, gen)
        tables[real:] = 0
        return cache, tables, lens, torch.randn(batch, hq, d, device="cuda", generator=gen).to(DT)

    cache, tables, lens, q = inputs()
    out = torch.empty_like(q)

    def step():
        return decode_attention(q, cache, tables, lens, d**-0.5, out=out, workspace=ws, counters=counters,
                                window=window, sinks=sinks)  # fmt: skip

    graph, _ = capture(step)
    new_cache, new_tables, new_lens, new_q = inputs()
    n = min(cache.shape[1], new_cache.shape[1])
    cache[:, :n].copy_(new_cache[:, :n])
    tables.copy_(new_tables.clamp(max=n - 1))
    lens.copy_(torch.minimum(new_lens, torch.full_like(new_lens, (tables.shape[1] - 2) * PAGE)))
    q.copy_(new_q)
    graph.replay()
    torch.cuda.synchronize()
    eager = decode_attention(q, cache, tables, lens, d**-0.5, workspace=ws, counters=counters, window=window,
                             sinks=sinks)  # fmt: skip
    assert torch.equal(out, eager)
    assert not counters.any()
    ref = decode_attention_reference(q[:real], cache, tables[:real], lens[:real], d**-0.5, window, sinks)
    assert rel_err(out[:real], ref) < TOL
    assert not out[real:].any()


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 32])
def test_prologue_in_decode_with_window_and_sinks(model, batch, gen):
    """The fused-prologue decode against the prologue's own launch then the reference; eager and replayed alike."""
    hq, hkv, d, window, with_sinks = SHAPES[model]
    seq_lens = lengths(batch, window * 2 + 37, gen)
    cache, tables, lens = paged(seq_lens, hkv, d, DT, gen)
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, device="cuda", generator=gen).to(DT)
    positions = (lens - 1).long()
    slots = tables.gather(1, (positions // PAGE)[:, None]).squeeze(1).long() * PAGE + positions % PAGE
    cos, sin = rotary_cos_sin(max(seq_lens) + 1, d, base=150000.0, device="cuda")
    new = NewToken(qkv, hq, positions, cos, sin, slots)
    sinks = sinks_for(hq, with_sinks, gen)
    ref_cache = cache.clone()
    q = qk_norm_rope_kv_write(qkv, positions, cos, sin, ref_cache, slots, hq, hkv, d, None, None, 0.0)
    ref = decode_attention_reference(q, ref_cache, tables, lens, d**-0.5, window, sinks)
    cache, tables = released(cache, tables, [max(0, n - window) for n in seq_lens])
    backend = TritonAttentionBackend()
    ws, counters = backend.reserve(hq, hkv, d, torch.device("cuda"), DT)
    eager = decode_attention_qkv(new, cache, tables, lens, d**-0.5, workspace=ws, counters=counters, window=window,
                                 sinks=sinks)  # fmt: skip
    assert not eager.isnan().any()
    assert rel_err(eager, ref) < TOL
    out = torch.empty_like(eager)
    graph, _ = capture(lambda: decode_attention_qkv(new, cache, tables, lens, d**-0.5, out=out, workspace=ws,
                                                    counters=counters, window=window, sinks=sinks))  # fmt: skip
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def _batch(mode, q_lens, seq_lens, tables, cache, slots) -> ForwardBatch:
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = int(starts[-1])
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(total, dtype=torch.int64, device="cuda"),
        positions=torch.zeros(total, dtype=torch.int64, device="cuda"),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"), query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), block_tables=tables,
        logits_indices=starts[1:].long() - 1, max_query_len=max(q_lens), max_seq_len=max(seq_lens), kv_caches=[cache],
        query_lens_cpu=list(q_lens), seq_lens_cpu=list(seq_lens),
    )  # fmt: skip


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("mode", ["mixed", "decode"])
def test_triton_backend_matches_torch_backend(model, mode, gen):
    hq, hkv, d, window, with_sinks = SHAPES[model]
    seq_lens = [window + 300, 2 * window + 5, 40]
    q_lens = [1, 1, 1] if mode == "decode" else [window + 300, 77, 40]
    cache, tables, _ = paged(seq_lens, hkv, d, DT, gen)
    slots = []
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        slots += [int(tables[i, p // PAGE]) * PAGE + p % PAGE for p in range(n - ql, n)]
    q, k, v = (torch.randn(sum(q_lens), h, d, device="cuda", generator=gen).to(DT) for h in (hq, hkv, hkv))
    sinks = sinks_for(hq, with_sinks, gen)
    caches = [cache.clone(), cache.clone()]
    outs = [backend.forward(q, k, v, 0, _batch(mode, q_lens, seq_lens, tables, c, slots), d**-0.5, window=window,
                            sinks=sinks)
            for backend, c in zip((TritonAttentionBackend(), TorchAttentionBackend()), caches)]  # fmt: skip
    assert torch.equal(caches[0], caches[1])
    assert rel_err(outs[0], outs[1]) < TOL


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_windowed_checkpoints_in_bf16_match_transformers_past_the_window(name, tmp_path):
    hf = make_hf_checkpoint(tmp_path, CONFIGS[name]())
    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cuda"), torch.device("cuda"))
    check_paged_parity(loaded.model, hf, name, TOL, lengths=(21, 37, 26), prefix=13, seed=7, check_prefix=False,
                       block_size=16, num_blocks=32, dtype=DT, device="cuda", backend=TritonAttentionBackend())


@pytest.mark.usefixtures("release_engines")
def test_engine_with_graphs_gives_back_blocks_and_matches_eager_and_transformers(tmp_path):
    """fp32 Mistral (window 8) on a 10-block pool of 16 tokens: three requests of 44-64 tokens would need 12 blocks
    without giving back those outside their windows. CUDA graphs with padding (3 rows in a graph of 4) and eager
    steps give the same greedy tokens, and those of transformers' generate."""
    hf = make_hf_checkpoint(tmp_path, CONFIGS["mistral"]())
    prompts = random_prompts((20, 29, 40))
    new_tokens = 24
    expected = [hf_greedy(hf, ids, new_tokens) for ids in prompts]

    def gave_back_blocks(core) -> None:
        assert core.block_manager.window == 8 and core.block_manager.num_released > 0

    runs = greedy_with_and_without_graphs(tmp_path, prompts, new_tokens, gave_back_blocks, num_kv_tokens=160)
    assert runs[True] == runs[False] == expected
