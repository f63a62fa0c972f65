"""DeepSeek-V4 on the GPU: its Triton kernels against kernels/v4_reference.py at the real shapes (a 512-wide latent,
64 heads, window 128, CSA at rate 4 with a 64 x 128 indexer and index_topk 512, HCA at rate 128) in bf16, a captured
decode step replayed with padding rows, the tiny checkpoint and dummy:deepseek-v4-flash-l6 (in fp32, its experts cut
to 16 so they fit) on the kernels against the reference path step for step, graphs against eager through the
engine, and the l6 preset served with graphs on its NVFP4 experts and on MXFP4. No card is named: every bound is a
relative error or an equality. (Logits against transformers are checked on CPU: tests/models/test_deepseek_v4.py.)"""

from __future__ import annotations

import gc
import itertools
import sys
from pathlib import Path

import pytest
import torch
from gpu_utils import capture, greedy_with_and_without_graphs, rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_utils import PagedHarness  # noqa: E402
from test_deepseek_v4 import _checkpoint, _config  # noqa: E402

from graphserve import LLM, SamplingParams  # noqa: E402
from graphserve.config import EngineConfig  # noqa: E402
from graphserve.kernels import dsa, dsa_indexer, v4_attention, v4_compress  # noqa: E402
from graphserve.kernels import dsa_reference as dsa_ref  # noqa: E402
from graphserve.kernels import v4_reference as ref  # noqa: E402
from graphserve.layers.attention import TorchAttentionBackend  # noqa: E402
from graphserve.layers.attention_triton import TritonAttentionBackend  # noqa: E402
from graphserve.layers.kv_layout import CompactCache  # noqa: E402
from graphserve.models import presets  # noqa: E402
from graphserve.models.loader import load_model  # noqa: E402

D, DI, HEADS, HI, WINDOW, TOPK, PAGE, ROPE_PAIRS = 512, 128, 64, 64, 128, 512, 64, 32
RATES = {"csa": 4, "hca": 128}
BF16_TOL = 1e-2  # bf16 inputs against the fp32 reference on the same bf16 values: the output's rounding and the dots'
FP32_TOL = 1e-4

pytestmark = pytest.mark.usefixtures("release_engines")


def branches(kind: str) -> list[ref.CompressorBranch]:
    """models/deepseek_v4_attention.py's layout at the real shapes."""
    if kind == "csa":
        return [ref.CompressorBranch(2 * D, D, True, 0, 0), ref.CompressorBranch(2 * DI, DI, True, D, 4 * D)]
    return [ref.CompressorBranch(D, D, False, 0, 0)]


def layout(kind: str) -> tuple[int, int]:
    """(checkpoint floats, entry width) of a compact page (models/deepseek_v4_shape.V4Shape)."""
    return (4 * (D + DI), D + DI) if kind == "csa" else (2 * D, D)


def paged(seq_lens: list[int], gen: torch.Generator) -> tuple[int, torch.Tensor]:
    """(blocks, block tables over shuffled blocks, never the dummy block 0, with a spare column)."""
    per_seq = [-(-n // PAGE) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen, device="cuda") + 1).int()
    tables = torch.zeros(len(seq_lens), max(per_seq) + 1, dtype=torch.int32, device="cuda")
    used = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = order[used : used + nb]
        used += nb
    return num_blocks, tables


def step_rows(query_lens: list[int], seq_lens: list[int], padding: int = 0):
    """(row_seq int32, positions int64, query_start_loc int32) of a step, padding rows last (position 0)."""
    seq, pos = [], []
    for i, (q, n) in enumerate(zip(query_lens, seq_lens)):
        seq += [i] * q
        pos += range(n - q, n)
    row_seq = torch.tensor(seq + [len(seq_lens) - 1] * padding, dtype=torch.int32, device="cuda")
    positions = torch.tensor(pos + [0] * padding, dtype=torch.int64, device="cuda")
    qsl = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32, device="cuda")
    return row_seq, positions, qsl


def random_pages(kind: str, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 pages of fresh random entries behind fresh random fp32 checkpoints (log-sum-exp, weighted mean)."""
    sf, ew = layout(kind)
    rate = RATES.get(kind, RATES["csa"])
    width = CompactCache(rate, ew, 4 * sf).page_width(PAGE, 2)
    pages = torch.randn(num_blocks, width, generator=gen, device="cuda").bfloat16()
    ref.checkpoints(pages, sf).copy_(torch.randn(num_blocks, sf, generator=gen, device="cuda"))
    return pages


def projections(kind: str, rows: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """Per branch (kv, gate) bf16 ``[rows, width]`` and (position bias fp32, norm weight bf16)."""
    rate = RATES[kind]
    return [(torch.randn(rows, b.width, generator=gen, device="cuda").bfloat16(),
             torch.randn(rows, b.width, generator=gen, device="cuda").bfloat16(),
             torch.randn(rate, b.width, generator=gen, device="cuda"),
             (1 + 0.3 * torch.randn(b.dim, generator=gen, device="cuda")).bfloat16()) for b in branches(kind)]


def compress(impl, kind: str, pages, proj, tables, row_seq, positions, qsl) -> None:
    sf, ew = layout(kind)
    init = ref.start_checkpoints(ref.checkpoints(pages, sf), tables, positions, qsl, PAGE)
    for b, (kv, gate, bias, weight) in zip(branches(kind), proj):
        impl.compress_groups(pages, b, kv, gate, init, tables, row_seq, positions, qsl, RATES[kind], bias, weight,
                             1e-6, inv_freq(), PAGE, sf, ew)  # fmt: skip


def same_pages(kind: str, got: torch.Tensor, want: torch.Tensor, before: torch.Tensor, blocks: torch.Tensor) -> None:
    """Over ``blocks``: untouched blocks bitwise, checkpoints within fp32 rounding, entries within bf16's."""
    sf, ew = layout(kind)
    touched = (want != before).any(dim=1) & blocks
    assert int(touched.sum()) > 0 and torch.equal(got[blocks & ~touched], before[blocks & ~touched])
    cg, cw = ref.checkpoints(got, sf)[blocks], ref.checkpoints(want, sf)[blocks]
    assert torch.equal(torch.isinf(cg), torch.isinf(cw))
    finite = torch.isfinite(cw)
    assert rel_err(cg[finite], cw[finite]) < FP32_TOL
    assert rel_err(ref.entry_rows(got, sf, ew)[blocks], ref.entry_rows(want, sf, ew)[blocks]) < BF16_TOL


def inv_freq() -> torch.Tensor:
    return 1.0 / 160000.0 ** (torch.arange(ROPE_PAIRS, device="cuda") / ROPE_PAIRS)


@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("extend", [False, True])
def test_compression_at_real_shapes(kind, extend, gen):
    rate = RATES[kind]
    seq_lens = [3 * rate, 5 * rate + 1, 2 * rate, 9 * rate]
    query_lens = [2 * rate + 3, 7, rate - 1, 1] if extend else [1] * 4
    num_blocks, tables = paged(seq_lens, gen)
    pages = random_pages(kind, num_blocks, gen)
    row_seq, positions, qsl = step_rows(query_lens, seq_lens, padding=3)
    proj = projections(kind, row_seq.shape[0], gen)
    want, got = pages.clone(), pages.clone()
    compress(ref, kind, want, proj, tables, row_seq, positions, qsl)
    compress(v4_compress, kind, got, proj, tables, row_seq, positions, qsl)
    assert int(((positions[: int(qsl[-1])] + 1) % rate == 0).sum()) >= (3 if extend else 1)
    same_pages(kind, got, want, pages, torch.ones(num_blocks, dtype=torch.bool, device="cuda"))


def attention_inputs(kind: str, seq_lens: list[int], query_lens: list[int], gen: torch.Generator, padding: int = 0):
    num_blocks, tables = paged(seq_lens, gen)
    row_seq, positions, qsl = step_rows(query_lens, seq_lens, padding)
    latents = torch.randn(num_blocks * PAGE, D, generator=gen, device="cuda").bfloat16()
    pages = random_pages(kind if kind != "sliding" else "hca", num_blocks, gen)
    q = torch.randn(row_seq.shape[0], HEADS, D, generator=gen, device="cuda").bfloat16()
    sinks = torch.randn(HEADS, generator=gen, device="cuda")
    return tables, row_seq, positions, qsl, latents, pages, q, sinks


def selection(positions: torch.Tensor, rate: int, gen: torch.Generator) -> torch.Tensor:
    """TOPK distinct visible entries a row (all of them where fewer are visible; -1 fills)."""
    visible = ((positions + 1) // rate).tolist()
    idx = torch.full((len(visible), TOPK), -1, dtype=torch.int32, device="cuda")
    for i, n in enumerate(visible):
        pick = torch.randperm(n, generator=gen, device="cuda")[:TOPK]
        idx[i, : pick.numel()] = pick.int()
    return idx


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
@pytest.mark.parametrize("seq_lens,query_lens", [([65536], [1]), ([9000, 3000, 200, 70000] * 4, [1] * 16),
                                                 ([3000, 5000], [40, 300])])
def test_attention_at_real_shapes(kind, seq_lens, query_lens, gen):
    """bs 1 at 64k (the key list split over the SMs), bs 16 of mixed lengths, an extend of two chunks."""
    tables, row_seq, positions, _, latents, pages, q, sinks = attention_inputs(kind, seq_lens, query_lens, gen, 1)
    rate = RATES.get(kind, 0)
    sf, ew = layout(kind) if rate else (0, 0)
    idx = selection(positions, rate, gen) if kind == "csa" else None
    args = (q, latents, pages if rate else None, 0, tables, row_seq, positions, sinks, D**-0.5, WINDOW, rate, PAGE,
            idx, sf, ew)  # fmt: skip
    want = ref.v4_attention(*args)
    got = v4_attention.v4_attention(*args)
    assert rel_err(got, want) < BF16_TOL
    # the layer's form: written in bf16 by the kernel (or the merge), the reference's rounding before the rope back
    got16 = v4_attention.v4_attention(*args, out=torch.empty(want.shape, dtype=torch.bfloat16, device="cuda"))
    assert torch.equal(got16, got.bfloat16())


def test_compressed_indexer_and_topk_at_real_shapes(gen):
    seq_lens, query_lens = [9000, 2100, 33000, 600], [1, 1, 1, 1]
    tables, row_seq, positions, _, _, pages, _, _ = attention_inputs("csa", seq_lens, query_lens, gen, 1)
    rate, (sf, ew) = RATES["csa"], layout("csa")
    n = tables.shape[1] * PAGE // rate
    q = torch.randn(row_seq.shape[0], HI, DI, generator=gen, device="cuda").bfloat16()
    weights = torch.randn(row_seq.shape[0], HI, generator=gen, device="cuda")
    visible = (positions + 1) // rate
    every = torch.arange(n, device="cuda").expand(row_seq.shape[0], -1)
    keys = ref.entries(pages, tables, row_seq, every, rate, PAGE, sf, ew, D, DI)
    want = ref.indexer_scores(q, weights, keys, visible)
    got = dsa_indexer.compressed_indexer_scores(q, weights, pages, D, rate, PAGE, tables, row_seq,
                                                (visible - 1).int(), n, state_floats=sf, entry_width=ew)  # fmt: skip
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and rel_err(got[finite], want[finite]) < BF16_TOL
    picked = dsa.topk_indices(got, (visible - 1).int(), TOPK)
    expected = dsa_ref.topk_indices(got, (visible - 1).int(), TOPK)
    assert torch.equal(picked.sort(-1).values, expected.sort(-1).values)


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_decode_step_replays_from_a_graph_and_padding_rows_write_no_real_block(kind, gen):
    """A step's compression (checkpoint gather, fold, entries, checkpoints) and attention captured for 8 rows with 5
    real ones, then replayed a step later with new inputs in the static buffers (four rows closing a group): the
    real rows' outputs match the reference, and every page outside the dummy block holds what the reference wrote."""
    rate = RATES[kind]
    seq_lens = [1024, 4096, 131, 512, 2048]
    tables, row_seq, positions, qsl, latents, pages, q, sinks = attention_inputs(kind, seq_lens, [1] * 5, gen, 3)
    sf, ew = layout(kind)
    prev = positions.clone()
    prev[:5] -= 1
    buf = {"q": q.clone(), "positions": prev, "proj": projections(kind, 8, gen),
           "idx": selection(prev, rate, gen) if kind == "csa" else None}

    def step(pages_, impl, attend):
        compress(impl, kind, pages_, buf["proj"], tables, row_seq, buf["positions"], qsl)
        return attend(buf["q"], latents, pages_, 0, tables, row_seq, buf["positions"], sinks, D**-0.5, WINDOW, rate,
                      PAGE, buf["idx"], sf, ew)  # fmt: skip

    graph, out = capture(lambda: step(pages, v4_compress, v4_attention.v4_attention))
    buf["positions"].copy_(positions)
    buf["q"].copy_(torch.randn(q.shape, generator=gen, device="cuda").bfloat16())
    for kv, gate, _, _ in buf["proj"]:
        kv.copy_(torch.randn(kv.shape, generator=gen, device="cuda").bfloat16())
        gate.copy_(torch.randn(gate.shape, generator=gen, device="cuda").bfloat16())
    if kind == "csa":
        buf["idx"].copy_(selection(positions, rate, gen))
    before = pages.clone()
    want_pages = pages.clone()
    want = step(want_pages, ref, ref.v4_attention)
    graph.replay()
    torch.cuda.synchronize()
    assert int(((positions[:5] + 1) % rate == 0).sum()) == 4
    assert rel_err(out[:5], want[:5]) < BF16_TOL
    real = torch.ones(pages.shape[0], dtype=torch.bool, device="cuda")
    real[0] = False  # the dummy block
    same_pages(kind, pages, want_pages, before, real)


def test_tiny_model_on_the_kernels_matches_the_reference(tmp_path):
    _checkpoint(tmp_path, _config())
    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="float32", device="cuda", max_model_len=128),
                        torch.device("cuda"))  # fmt: skip
    harnesses = [PagedHarness(loaded.model, block_size=16, num_blocks=16, dtype=torch.float32, device="cuda",
                              backend=backend) for backend in (TorchAttentionBackend(), TritonAttentionBackend())]
    g = torch.Generator().manual_seed(7)
    seqs = {s: torch.randint(4, 320, (n,), generator=g).tolist() for s, n in (("a", 9), ("b", 45))}
    steps = [[("b", seqs["b"][:17])], [("a", seqs["a"]), ("b", seqs["b"][17:])]]
    steps += [[(s, torch.randint(4, 320, (1,), generator=g).tolist()) for s in seqs] for _ in range(4)]
    with torch.inference_mode():
        for i, chunks in enumerate(steps):
            want, got = (torch.cat(h.step(chunks)).float() for h in harnesses)
            assert rel_err(got, want) < FP32_TOL, f"step {i}"


def test_tiny_model_graphs_match_eager(tmp_path):
    """Through the engine: 3 prompts decoded on a graph of 4 (a padding row), 16-token chunks, as eager."""
    _checkpoint(tmp_path, _config())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 320, (n,), generator=g).tolist() for n in (3, 40, 21)]
    runs = greedy_with_and_without_graphs(tmp_path, prompts, 12, max_model_len=128)
    assert runs[True] == runs[False]


def test_tiny_model_on_few_latent_pages_gives_the_tokens_of_many(tmp_path, monkeypatch):
    """Through the engine on 6 usable latent pages (a running sequence's window of 8 and chunk of 16 hold up to 3):
    pages let go of and handed to other blocks as windows slide, the device map written between steps that graphs
    replay, the same tokens with and without graphs as on the planned (ample) pages, and no page leaked."""
    from graphserve.engine import startup

    _checkpoint(tmp_path, _config())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 320, (n,), generator=g).tolist() for n in (3, 40, 21)]
    ample = greedy_with_and_without_graphs(tmp_path, prompts, 12, max_model_len=128)
    monkeypatch.setattr(startup, "latent_page_count", lambda *sizes: 7)

    def slid(core) -> None:  # noqa: ANN001
        pages = core.block_manager.pages
        assert pages.num_usable_pages == 6 and pages.num_released > 0

    few = greedy_with_and_without_graphs(tmp_path, prompts, 12, check=slid, max_model_len=128)
    assert few[True] == few[False] == ample[True]


def test_tiny_model_kv_cache_gb_gives_the_plans_split(tmp_path):
    """--kv-cache-gb caps the planned pool at the blocks and latent pages the same bytes give in the plan's split
    (engine/memory.split_kv_bytes): the windows' pages first, the blocks the rest at the bytes a token keeps for its
    whole context; the tokens with and without graphs alike."""
    from graphserve.engine.memory import split_layout_bytes

    _checkpoint(tmp_path, _config())
    gb, running = 0.004, 4
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 320, (n,), generator=g).tolist() for n in (3, 40, 21)]

    def split(core) -> None:  # noqa: ANN001
        kv, bm = core.info.kv, core.block_manager
        want = split_layout_bytes(int(gb * (1 << 30)), kv, 16, running, 16)
        assert want.latent_pages == kv.latent_pages_wanted(16, running, 16)  # split, not one page a block
        assert (bm.num_usable_blocks, bm.pages.num_pages) == (want.num_blocks, want.latent_pages)
        assert want.num_blocks > int(gb * (1 << 30)) // (kv.bytes_per_token * 16)

    runs = greedy_with_and_without_graphs(tmp_path, prompts, 8, check=split, max_model_len=128, kv_cache_gb=gb,
                                          max_running_requests=running)  # fmt: skip
    assert runs[True] == runs[False]


@pytest.fixture
def l6_fp32(monkeypatch):
    """dummy:deepseek-v4-flash-l6 at its attention shapes, 16 bf16-kind experts instead of 256 NVFP4 ones: fp32 fits."""
    cfg = dict(presets.PRESETS["deepseek-v4-flash-l6"])
    cfg["config"] = {k: v for k, v in cfg["config"].items() if k != "quantization_config"}
    cfg["config"]["n_routed_experts"] = 16
    monkeypatch.setitem(presets.PRESETS, "deepseek-v4-flash-l6-test", cfg)
    return "dummy:deepseek-v4-flash-l6-test"


def test_l6_greedy_on_the_kernels_matches_the_reference_path_in_fp32(l6_fp32):
    """A 2100-token prompt (past the window, 16 HCA groups, 525 CSA entries > index_topk 512) in 700-token chunks
    beside a 300-token one, then 4 greedy decode steps: the kernels' logits and tokens against the reference's."""
    loaded = load_model(EngineConfig(model=l6_fp32, dtype="float32", device="cuda", max_model_len=4096),
                        torch.device("cuda"))  # fmt: skip
    harnesses = [PagedHarness(loaded.model, block_size=16, num_blocks=200, dtype=torch.float32, device="cuda",
                              backend=backend) for backend in (TorchAttentionBackend(), TritonAttentionBackend())]
    g = torch.Generator().manual_seed(11)
    b = torch.randint(10, 120000, (2100,), generator=g).tolist()
    a = torch.randint(10, 120000, (300,), generator=g).tolist()
    steps = [[("b", b[:700])], [("a", a), ("b", b[700:1400])], [("b", b[1400:])]]
    with torch.inference_mode():
        for i, chunks in enumerate(steps):
            want, got = (torch.cat([lg[-1:] for lg in h.step(chunks)]).float() for h in harnesses)
            assert rel_err(got, want) < FP32_TOL, f"prefill step {i}"
        nxt = {"a": a[-1], "b": b[-1]}
        for i in range(4):
            chunks = [(s, [nxt[s]]) for s in ("a", "b")]
            want, got = (torch.cat(h.step(chunks)).float() for h in harnesses)
            assert rel_err(got, want) < FP32_TOL, f"decode step {i}"
            assert torch.equal(got.argmax(-1), want.argmax(-1)), f"decode step {i}"
            nxt = dict(zip(("a", "b"), want.argmax(-1).tolist()))


@pytest.mark.parametrize("quantization", ["none", "mxfp4"])
def test_l6_serves_with_graphs(quantization, monkeypatch):
    """dummy:deepseek-v4-flash-l6 at its real sizes in bf16 (64 heads, 256 FP4 experts of 2048 top-6): as the preset
    ships it (NVFP4 experts), and unquantized then quantized to MXFP4 at load; prompts of 2100 and 300 tokens, every
    decode step replayed from a graph."""
    name = "deepseek-v4-flash-l6"
    if quantization != "none":  # the shipped NVFP4 refuses another --quantization: start from the unquantized shape
        cfg = dict(presets.PRESETS[name])
        cfg["config"] = {k: v for k, v in cfg["config"].items() if k != "quantization_config"}
        monkeypatch.setitem(presets.PRESETS, name + "-bf16-test", cfg)
        name += "-bf16-test"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 120000, (n,), generator=g).tolist() for n in (2100, 300)]
    llm = LLM(f"dummy:{name}", device="cuda", max_model_len=4096, cuda_graph_max_bs=4, quantization=quantization)
    res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert [len(o.token_ids) for o in res] == [8, 8]
    decode = [r for r in llm.engine.core.telemetry.records() if r.kind == "decode"]
    assert decode and all(r.graph for r in decode)
    del llm
    gc.collect()
