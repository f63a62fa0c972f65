"""The GPU path end to end: bf16 numerics, CUDA graphs vs eager, split batches, padding, memory plan."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_utils import PagedHarness, hf_logits, make_hf_checkpoint, relative_error  # noqa: E402
from test_models import VARIANTS  # noqa: E402

from graphserve import LLM, SamplingParams  # noqa: E402
from graphserve.config import EngineConfig  # noqa: E402
from graphserve.layers.attention_triton import TritonAttentionBackend  # noqa: E402
from graphserve.models.loader import load_model  # noqa: E402

BF16_TOL = 2e-2
PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a land far away there lived",
    "def fibonacci(n):",
    "Paged attention stores keys and values in fixed-size blocks so that",
    "1, 2, 3, 4,",
    "Hello",
    "A long time ago",
    "Serving engines batch requests",
]


pytestmark = pytest.mark.usefixtures("release_engines")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bf16_logits_match_fp32_reference(name, tmp_path):
    hf = make_hf_checkpoint(tmp_path, VARIANTS[name]())
    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cuda", max_model_len=128),
                        torch.device("cuda"))
    harness = PagedHarness(loaded.model, block_size=16, num_blocks=32, dtype=torch.bfloat16, device="cuda",
                           backend=TritonAttentionBackend())
    gen = torch.Generator().manual_seed(7)
    seqs = {s: torch.randint(4, 320, (n,), generator=gen).tolist() for s, n in (("a", 9), ("b", 37), ("c", 20))}
    with torch.inference_mode():
        harness.step([("b", seqs["b"][:17])])
        out = harness.step([("a", seqs["a"]), ("b", seqs["b"][17:]), ("c", seqs["c"])])
        for (seq, start), got in zip((("a", 0), ("b", 17), ("c", 0)), out):
            err = relative_error(got.float().cpu(), hf_logits(hf, seqs[seq])[start:])
            assert err < BF16_TOL, f"{name} prefill {seq}: relative error {err:.2e}"
        for step in range(4):
            for s in seqs:
                seqs[s].append(int(torch.randint(4, 320, (1,), generator=gen)))
            got = torch.cat(harness.step([(s, [seqs[s][-1]]) for s in seqs])).float().cpu()
            want = torch.stack([hf_logits(hf, seqs[s])[-1] for s in seqs])
            err = relative_error(got, want)
            assert err < BF16_TOL, f"{name} decode step {step}: relative error {err:.2e}"


def _greedy(llm: LLM, prompts: list[str], max_tokens: int = 24) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def eager_tokens():
    llm = LLM("builtin:tiny-llama", device="cuda", dtype="float32", disable_cuda_graph=True)
    tokens = {"all": _greedy(llm, PROMPTS), "alone": _greedy(llm, PROMPTS[:1])}
    del llm
    torch.cuda.empty_cache()
    return tokens


def test_graph_and_eager_greedy_tokens_identical(eager_tokens):
    llm = LLM("builtin:tiny-llama", device="cuda", dtype="float32", cuda_graph_max_bs=16)
    assert _greedy(llm, PROMPTS) == eager_tokens["all"]
    records = llm.engine.core.telemetry.records()
    decode = [r for r in records if r.kind == "decode"]
    assert decode and all(r.graph and r.mode == "graph" for r in decode)
    # padding: 3 real rows run padded to 4; the first request's tokens equal its solo run
    assert _greedy(llm, PROMPTS[:3])[0] == eager_tokens["alone"][0]
    padded = [r for r in llm.engine.core.telemetry.records()[len(records):] if r.kind == "decode"]
    assert any(r.batch_size == 3 and r.padded_size == 4 for r in padded)


def test_split_batch_matches_captured_sizes(eager_tokens):
    llm = LLM("builtin:tiny-llama", device="cuda", dtype="float32", cuda_graph_max_bs=4, max_running_requests=8)
    runner = llm.engine.core.runner
    runner.oversize_mode = "split-graph"  # whatever the calibration chose, exercise the split path
    assert _greedy(llm, PROMPTS) == eager_tokens["all"]
    modes = {r.mode for r in llm.engine.core.telemetry.records() if r.kind == "decode"}
    assert "split-graph" in modes


def test_overlap_schedule_matches_synchronous_steps(eager_tokens):
    """Step N+1 launched before N's ids are read (stand-in tokens resolved on the device) must give
    the same tokens and finish reasons as running each step to the end, graphs on."""
    stop_id = eager_tokens["all"][0][5]  # prompt 0 meets it by its 6th token
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.9, seed=4, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    ]
    prompts = PROMPTS[:4]
    runs = {}
    for mode in ("off", "on"):
        llm = LLM("builtin:tiny-llama", device="cuda", dtype="float32", cuda_graph_max_bs=8, overlap_schedule=mode)
        assert llm.engine.core.overlap == (mode == "on")
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[mode] = [(o.token_ids, o.outputs[0].finish_reason) for o in outs]
        del llm
        torch.cuda.empty_cache()
    assert runs["on"] == runs["off"]
    assert runs["on"][0][1] == "stop" and runs["on"][3][0] and len(runs["on"][3][0]) == 1


def test_max_running_defaults_to_largest_captured_size():
    llm = LLM("builtin:tiny-llama", device="cuda", dtype="float32", cuda_graph_max_bs=8)
    assert llm.engine.core.scheduler.max_running == 8
    _greedy(llm, PROMPTS * 3, max_tokens=8)
    assert max(r.batch_size for r in llm.engine.core.telemetry.records() if r.kind == "decode") <= 8


def test_peak_memory_stays_within_plan():
    max_bs, max_len = 32, 4096
    llm = LLM("dummy:qwen3-0.6b", device="cuda", mem_fraction_static=0.9, cuda_graph_max_bs=max_bs,
              max_model_len=max_len, chunked_prefill_size=4096)
    core = llm.engine.core
    plan = core.memory_plan
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 30000, (max_len - 16,), generator=gen).tolist()}
               for _ in range(2 * max_bs)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 16 for o in outs)
    peak = torch.cuda.max_memory_allocated()
    pool = core.runner.graphs.pool_bytes
    print(f"peak allocated {peak / 2**30:.2f} GiB + graph pool {pool / 2**30:.2f} GiB; "
          f"plan static budget {plan.static_bytes / 2**30:.2f} GiB; reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")
    assert peak + pool <= plan.static_bytes
    assert max(r.batch_size for r in core.telemetry.records()) <= max_bs
