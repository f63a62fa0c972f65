"""--tp 2 over two "nodes" on one 2-GPU machine (NCCL, CUDA graphs with the collectives captured): this process
is node 0 on GPU 0, a `graphserve serve --node-rank 1` process is node 1 seeing GPU 1 only. Greedy tokens equal
--tp 1's on a tiny fp32 checkpoint, and node 1 ends with node 0's shutdown. Needs 2 GPUs."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from model_utils import make_hf_checkpoint  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from graphserve import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason=f"needs 2 GPUs for two nodes, {torch.cuda.device_count()} visible")

PROMPTS = ["Hello world", "two nodes, one machine", "a"] * 2
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=512, cuda_graph_max_bs=8, mem_fraction_static=0.5)


def _generate(folder: Path, **kw) -> list[list[int]]:
    llm = LLM(str(folder), **ENGINE, **kw)
    try:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert any(r.graph for r in llm.engine.core.telemetry.records())
    finally:
        llm.engine.core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return tokens


def test_tp2_over_two_nodes_on_one_machine_matches_tp1(tmp_path):
    make_hf_checkpoint(tmp_path, LlamaConfig(vocab_size=321, hidden_size=256, intermediate_size=512,
                                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                             max_position_embeddings=512, rope_theta=10000.0))
    reference = _generate(tmp_path, device="cuda:0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    log = tmp_path / "node1.log"
    node1 = subprocess.Popen(
        [sys.executable, "-m", "graphserve.cli", "serve", str(tmp_path), "--tp", "2", "--nnodes", "2", "--node-rank",
         "1", "--dist-init-addr", addr, "--dist-timeout", "300", "--dtype", "float32", "--max-model-len", "512",
         "--cuda-graph-max-bs", "8", "--mem-fraction-static", "0.5"],
        cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": "1", "PYTHONPATH": str(ROOT)},
        stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    try:
        tokens = _generate(tmp_path, device="cuda:0", tp=2, nnodes=2, node_rank=0, dist_init_addr=addr,
                           dist_timeout=300)
        assert node1.wait(60) == 0, log.read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
    assert tokens == reference
