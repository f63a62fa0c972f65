"""DeepSeek-V4 on the GPU: its Triton kernels against kernels/v4_reference.py at the real shapes (a 512-wide latent,
64 heads, window 128, CSA at rate 4 with a 64 x 128 indexer and index_topk 512, HCA at rate 128) in bf16, a captured
decode step replayed with padding rows, the tiny checkpoint and dummy:deepseek-v4-flash-l6 (in fp32, its experts cut
to 16 so they fit) on the kernels against the reference path step for step, graphs against eager through the
engine, and the l6 preset served with graphs on its NVFP4 experts and on MXFP4. No card is named: every bound is a
relative error or an equality. (Logits against transformers are checked on CPU: tests/models/test_deepseek_v4.py.)"""

from __future__ import annotations

import gc
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
        state = 4 * D + 4 * DI
        return [ref.CompressorBranch(0, 2 * D, state, D, True), ref.CompressorBranch(4 * D, 2 * DI, state + D, DI, True)]
    return [ref.CompressorBranch(0, D, 2 * D, D, False)]


def row_width(kind: str) -> int:
    return 4 * D + 4 * DI + D + DI if kind == "csa" else 3 * D


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


def step_rows(query_lens: list[int], seq_lens: list[int], tables: torch.Tensor, padding: int = 0):
    """(row_seq int32, positions int64, slots int64) of a step, padding rows last (position 0, slot 0)."""
    seq, pos = [], []
    for i, (q, n) in enumerate(zip(query_lens, seq_lens)):
        seq += [i] * q
        pos += range(n - q, n)
    row_seq = torch.tensor(seq + [len(seq_lens) - 1] * padding, dtype=torch.int32, device="cuda")
    positions = torch.tensor(pos + [0] * padding, dtype=torch.int64, device="cuda")
    slots = ref.token_slots(tables, row_seq.long(), positions[:, None], PAGE)[:, 0]
    slots[len(pos):] = 0
    return row_seq, positions, slots


def inv_freq() -> torch.Tensor:
    return 1.0 / 160000.0 ** (torch.arange(ROPE_PAIRS, device="cuda") / ROPE_PAIRS)


@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("extend", [False, True])
def test_compression_at_real_shapes(kind, extend, gen):
    rate = RATES[kind]
    seq_lens = [3 * rate, 5 * rate + 1, 2 * rate, 9 * rate]
    query_lens = [2 * rate + 3, 7, rate - 1, 1] if extend else [1] * 4
    num_blocks, tables = paged(seq_lens, gen)
    rows = torch.randn(num_blocks * PAGE, row_width(kind), generator=gen, device="cuda").bfloat16()
    row_seq, positions, slots = step_rows(query_lens, seq_lens, tables, padding=3)
    want = rows.clone()
    for branch in branches(kind):
        bias = torch.randn(rate, branch.width, generator=gen, device="cuda")
        weight = (1 + 0.3 * torch.randn(branch.dim, generator=gen, device="cuda")).bfloat16()
        ref.compress_groups(want, branch, tables, row_seq, positions, slots, rate, bias, weight, 1e-6, inv_freq(), PAGE)
        v4_compress.compress_groups(rows, branch, tables, row_seq, positions, slots, rate, bias, weight, 1e-6,
                                    inv_freq(), PAGE)  # fmt: skip
    closing = slots[(positions + 1) % rate == 0]
    assert closing.numel() >= (3 if extend else 1)
    region = torch.zeros_like(rows, dtype=torch.bool)
    for branch in branches(kind):
        region[closing, branch.entry_at : branch.entry_at + branch.dim] = True
    assert torch.equal(rows[~region], want[~region])
    assert rel_err(rows[region], want[region]) < BF16_TOL


def attention_inputs(kind: str, seq_lens: list[int], query_lens: list[int], gen: torch.Generator, padding: int = 0):
    num_blocks, tables = paged(seq_lens, gen)
    row_seq, positions, slots = step_rows(query_lens, seq_lens, tables, padding)
    latents = torch.randn(num_blocks * PAGE, D, generator=gen, device="cuda").bfloat16()
    rows = torch.randn(num_blocks * PAGE, row_width(kind), generator=gen, device="cuda").bfloat16()
    q = torch.randn(row_seq.shape[0], HEADS, D, generator=gen, device="cuda").bfloat16()
    sinks = torch.randn(HEADS, generator=gen, device="cuda")
    return tables, row_seq, positions, slots, latents, rows, q, sinks


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
    tables, row_seq, positions, _, latents, rows, q, sinks = attention_inputs(kind, seq_lens, query_lens, gen, 1)
    rate = RATES.get(kind, 0)
    idx = selection(positions, rate, gen) if kind == "csa" else None
    args = (q, latents, rows if rate else None, 4 * D + 4 * DI if kind == "csa" else 2 * D, tables, row_seq,
            positions, sinks, D**-0.5, WINDOW, rate, PAGE, idx)  # fmt: skip
    want = ref.v4_attention(*args)
    got = v4_attention.v4_attention(*args)
    assert rel_err(got, want) < BF16_TOL
    # the layer's form: written in bf16 by the kernel (or the merge), the reference's rounding before the rope back
    got16 = v4_attention.v4_attention(*args, out=torch.empty(want.shape, dtype=torch.bfloat16, device="cuda"))
    assert torch.equal(got16, got.bfloat16())


def test_compressed_indexer_and_topk_at_real_shapes(gen):
    seq_lens, query_lens = [9000, 2100, 33000, 600], [1, 1, 1, 1]
    tables, row_seq, positions, _, _, rows, _, _ = attention_inputs("csa", seq_lens, query_lens, gen, 1)
    rate, key_at = RATES["csa"], 4 * D + 4 * DI + D
    n = tables.shape[1] * PAGE // rate
    q = torch.randn(row_seq.shape[0], HI, DI, generator=gen, device="cuda").bfloat16()
    weights = torch.randn(row_seq.shape[0], HI, generator=gen, device="cuda")
    visible = (positions + 1) // rate
    want = ref.indexer_scores(q, weights, rows[ref.entry_slots(tables, row_seq, rate, n, PAGE), key_at:key_at + DI],
                              visible)  # fmt: skip
    got = dsa_indexer.compressed_indexer_scores(q, weights, rows, key_at, rate, PAGE, tables, row_seq,
                                                (visible - 1).int(), n)  # fmt: skip
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and rel_err(got[finite], want[finite]) < BF16_TOL
    picked = dsa.topk_indices(got, (visible - 1).int(), TOPK)
    expected = dsa_ref.topk_indices(got, (visible - 1).int(), TOPK)
    assert torch.equal(picked.sort(-1).values, expected.sort(-1).values)


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_decode_step_replays_from_a_graph_and_padding_rows_write_no_real_row(kind, gen):
    """A step's state write, compression and attention captured for 8 rows with 5 real ones, then replayed a step
    later with new inputs in the static buffers (four rows closing a group): the real rows' outputs match the
    reference, and every cache row outside the dummy block holds what the reference wrote there."""
    rate = RATES[kind]
    seq_lens = [1024, 4096, 131, 512, 2048]
    tables, row_seq, positions, slots, latents, rows, q, sinks = attention_inputs(kind, seq_lens, [1] * 5, gen, 3)
    layout = branches(kind)
    params = [(torch.randn(rate, b.width, generator=gen, device="cuda"),
               (1 + 0.3 * torch.randn(b.dim, generator=gen, device="cuda")).bfloat16()) for b in layout]
    width = sum(2 * b.width for b in layout)
    prev = positions.clone()
    prev[:5] -= 1
    buf = {"q": q.clone(), "positions": prev,
           "slots": torch.where(prev > 0, ref.token_slots(tables, row_seq.long(), prev[:, None], PAGE)[:, 0], 0),
           "state": torch.randn(8, width, generator=gen, device="cuda").bfloat16(),
           "idx": selection(prev, rate, gen) if kind == "csa" else None}

    def step(flat_rows, compress, attend):
        at = 0
        for branch, (bias, weight) in zip(layout, params):
            part = buf["state"][:, at : at + 2 * branch.width]
            branch.write_state(flat_rows, buf["slots"], part[:, : branch.width], part[:, branch.width :])
            at += 2 * branch.width
            compress(flat_rows, branch, tables, row_seq, buf["positions"], buf["slots"], rate, bias, weight, 1e-6,
                     inv_freq(), PAGE)  # fmt: skip
        return attend(buf["q"], latents, flat_rows, layout[0].entry_at, tables, row_seq, buf["positions"], sinks,
                      D**-0.5, WINDOW, rate, PAGE, buf["idx"])  # fmt: skip

    graph, out = capture(lambda: step(rows, v4_compress.compress_groups, v4_attention.v4_attention))
    buf["positions"].copy_(positions)
    buf["slots"].copy_(slots)
    buf["q"].copy_(torch.randn(q.shape, generator=gen, device="cuda").bfloat16())
    buf["state"].copy_(torch.randn(8, width, generator=gen, device="cuda").bfloat16())
    if kind == "csa":
        buf["idx"].copy_(selection(positions, rate, gen))
    want_rows = rows.clone()
    want = step(want_rows, ref.compress_groups, ref.v4_attention)
    graph.replay()
    torch.cuda.synchronize()
    assert int(((positions[:5] + 1) % rate == 0).sum()) == 4
    assert rel_err(out[:5], want[:5]) < BF16_TOL
    real = torch.ones(rows.shape[0], dtype=torch.bool, device="cuda")
    real[:PAGE] = False  # the dummy block, where padding rows write
    entry = torch.zeros(rows.shape[1], dtype=torch.bool, device="cuda")
    for branch in layout:
        entry[branch.entry_at : branch.entry_at + branch.dim] = True
    assert torch.equal(rows[real][:, ~entry], want_rows[real][:, ~entry])
    assert rel_err(rows[real][:, entry], want_rows[real][:, entry]) < BF16_TOL


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
