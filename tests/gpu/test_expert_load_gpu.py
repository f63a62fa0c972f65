"""Per-step expert load on CUDA: graph replays and eager steps both report every MoE layer's routing,
read from the one count tensor the probe shares with the layers (engine/expert_load.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_utils import make_hf_checkpoint  # noqa: E402
from test_moe_models import VARIANTS  # noqa: E402

from graphserve import LLM, SamplingParams  # noqa: E402


def test_step_records_count_every_routed_pair_under_graph_replay(tmp_path):
    make_hf_checkpoint(tmp_path, VARIANTS["olmoe"]())
    # batches of 3 replay the size-4 graph: its padding row must not be counted
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", cuda_graph_bs=(1, 2, 4, 8), block_size=16)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(4, 320, (n,), generator=gen).tolist()} for n in (5, 19, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    llm.generate(prompts, params, use_tqdm=False)
    moe = llm.engine.core.runner.expert_probe.layers
    k = moe[0].top_k
    records = llm.engine.core.telemetry.records()
    assert any(r.graph and r.padded_size > r.batch_size for r in records), [(r.mode, r.batch_size) for r in records]
    for rec in records:
        assert rec.layer_routed_pairs == [rec.num_tokens * k] * len(moe), (rec.mode, rec.batch_size, rec.padded_size)
        assert rec.experts_touched >= len(moe) * k
