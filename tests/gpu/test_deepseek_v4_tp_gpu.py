"""DeepSeek-V4 at --tp 2 / --ep 2 on two GPUs: the Triton attention kernels over each rank's output groups and the
replicated latent, compressor and indexer rows, NCCL captured in CUDA graphs. Greedy tokens equal --tp 1's on the
tiny fp32 checkpoint, and dummy:deepseek-v4-flash-l6 serves at --tp 2 with graphs on. Needs 2 GPUs; on one GPU each
test says so and is skipped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gpu_utils import generate_on_graphs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_utils import random_prompts  # noqa: E402
from test_deepseek_v4 import _checkpoint, _config  # noqa: E402

from graphserve import SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason=f"needs 2 GPUs for NCCL ranks, {torch.cuda.device_count()} visible")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _run(model: str, prompts, **kw) -> tuple[list[list[int]], list]:  # noqa: ANN001
    return generate_on_graphs(model, prompts, GREEDY, 8, **kw)


def test_v4_tp2_and_ep2_greedy_tokens_match_tp1_on_gpu(tmp_path):
    _checkpoint(tmp_path, _config())
    prompts = [{"prompt_token_ids": p} for p in random_prompts((3, 40, 21, 67))]
    tiny = {"dtype": "float32", "max_model_len": 128, "chunked_prefill_size": 16}
    reference, _ = _run(str(tmp_path), prompts, **tiny)
    tokens, records = _run(str(tmp_path), prompts, tp=2, **tiny)
    assert tokens == reference
    assert all(r.comm_ops == 2 * 4 + 2 for r in records)  # attention + MoE per layer, embedding, logits
    tokens, records = _run(str(tmp_path), prompts, ep=2, **tiny)
    assert tokens == reference
    assert all(r.comm_ops == 4 for r in records)  # one per MoE layer: attention is replicated


def test_dummy_v4_flash_l6_serves_at_tp2_with_graphs():
    prompts = [{"prompt_token_ids": list(range(1000, 1000 + n))} for n in (2100, 300, 40)]
    tokens, records = _run("dummy:deepseek-v4-flash-l6", prompts, max_model_len=4096, tp=2)
    assert all(len(t) == GREEDY.max_tokens for t in tokens)
    assert all(r.comm_ops == 2 * 6 + 2 for r in records)
