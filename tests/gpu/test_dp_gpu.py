"""`graphserve serve --dp 2` on a 2-GPU machine: replica r runs on GPU r (each GPU's free memory drops when the
server starts), both replicas take requests, and greedy tokens equal one engine's on GPU 0 (a tiny fp32
checkpoint, CUDA graphs on). Needs 2 GPUs."""

from __future__ import annotations

import gc
import random
import sys
from pathlib import Path

import httpx
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from model_utils import make_hf_checkpoint  # noqa: E402
from server_utils import ServerProcess, metrics  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from graphserve import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason=f"needs 2 GPUs for two replicas, {torch.cuda.device_count()} visible")

ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--cuda-graph-max-bs", "8", "--mem-fraction-static", "0.5"]
# a replica's CUDA context alone takes more than this (the KV pool is capped by server_utils' --num-kv-tokens)
MIN_TAKEN = 256 << 20


def test_dp2_puts_a_replica_on_each_gpu_and_gives_the_tokens_of_one_engine(tmp_path):
    make_hf_checkpoint(tmp_path, LlamaConfig(vocab_size=321, hidden_size=256, intermediate_size=512,
                                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                             max_position_embeddings=512, rope_theta=10000.0))
    rng = random.Random(56)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=512, cuda_graph_max_bs=8, mem_fraction_static=0.5,
              device="cuda:0")
    try:
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        reference = [llm.generate(p, greedy, use_tqdm=False)[0].token_ids for p in prompts]  # one at a time
    finally:
        llm.engine.core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    free_before = [torch.cuda.mem_get_info(i)[0] for i in (0, 1)]
    srv = ServerProcess(tmp_path, "--dp", "2", *ENGINE, model=str(tmp_path)).start(timeout=600)
    try:
        taken = [free_before[i] - torch.cuda.mem_get_info(i)[0] for i in (0, 1)]
        assert min(taken) > MIN_TAKEN, f"each GPU must hold a replica: bytes taken {taken}"
        got = []
        for p in prompts:  # one at a time: each runs alone on its replica, as the reference did
            body = {"input_ids": p, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
            resp = httpx.post(srv.base_url + "/generate", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            got.append(resp.json()["output_ids"])
        assert got == reference
        m = metrics(srv.base_url)
        for r in ("0", "1"):
            assert m[f"graphserve:replica_requests_total{{replica={r},route=load}}"] >= 1
            assert m[f"graphserve:decode_steps_total{{graph=true,replica={r}}}"] > 0
    finally:
        srv.stop()
