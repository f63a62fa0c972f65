"""DeepSeek at --tp 2 / --ep 2 on two GPUs: the Triton MLA kernels over each rank's heads and the replicated
latent cache, NCCL (and the one-shot all-reduce) captured in CUDA graphs. Greedy tokens equal --tp 1's on
tiny fp32 checkpoints, and dummy:deepseek-v2-lite serves at --tp 2 with graphs on. Needs 2 GPUs (a two-GPU
machine); on one GPU each test says so and is skipped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gpu_utils import generate_on_graphs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_deepseek_tp import _save, _v2, _v3  # noqa: E402

from graphserve import SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason=f"needs 2 GPUs for NCCL ranks, {torch.cuda.device_count()} visible")

PROMPTS = ["Hello world", "The quick brown fox jumps over", "a", "latent caches agree on every rank"] * 3
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _run(model: str, prompts, params: SamplingParams, **kw) -> tuple[list[list[int]], list]:  # noqa: ANN001
    return generate_on_graphs(model, prompts, params, 16, **kw)


@pytest.mark.parametrize(("name", "make"), [("v2-no-q-lora", _v2), ("v3-q-lora", _v3)])
def test_deepseek_tp2_greedy_tokens_match_tp1_on_gpu(tmp_path, name, make):
    _save(tmp_path, make())
    folder = str(tmp_path)
    tiny = {"dtype": "float32", "max_model_len": make().max_position_embeddings}  # all the checkpoint has
    reference, _ = _run(folder, PROMPTS, GREEDY, **tiny)
    tokens, records = _run(folder, PROMPTS, GREEDY, tp=2, **tiny)
    assert tokens == reference, name
    layers = make().num_hidden_layers
    assert all(r.comm_ops == 2 * layers + 2 for r in records)  # attention + MLP per layer, embedding, logits
    if name == "v3-q-lora":
        assert _run(folder, PROMPTS, GREEDY, ep=2, **tiny)[0] == reference


def test_dummy_v2_lite_serves_at_tp2_with_graphs():
    prompts = [{"prompt_token_ids": [100000 + 2 + i] + list(range(1000, 1000 + 50 * i))} for i in range(6)]
    tokens, records = _run("dummy:deepseek-v2-lite", prompts, GREEDY, max_model_len=4096, tp=2)
    assert all(len(t) == GREEDY.max_tokens for t in tokens)
    assert all(r.comm_ops == 2 * 27 + 2 for r in records)
