"""Ranks across nodes on CPU (gloo over loopback): two "nodes" (this process as node 0, a `graphserve serve
--node-rank 1` process as node 1) give the tokens of one rank; a lost node ends node 0 with a non-zero exit;
differing flags and an unreachable --dist-init-addr are refused at start-up, naming the flag and both values."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from model_utils import make_hf_checkpoint
from server_utils import ServerProcess, free_port, stream_until_first_event
from transformers import LlamaConfig, Qwen2MoeConfig

from graphserve import LLM, SamplingParams
from graphserve.config import EngineConfig
from graphserve.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello world", "two nodes agree on every token", "a"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", num_kv_tokens=1024, chunked_prefill_size=64)
_TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-6, intermediate_size=96)


def _node1(model: str, addr: str, *flags: str, log: Path) -> subprocess.Popen:
    """`graphserve serve MODEL --nnodes 2 --node-rank 1`: ranks only, no HTTP."""
    args = [sys.executable, "-m", "graphserve.cli", "serve", model, "--device", "cpu", "--dtype", "float32",
            "--num-kv-tokens", "1024", "--chunked-prefill-size", "64", "--nnodes", "2", "--node-rank", "1",
            "--dist-init-addr", addr, "--dist-timeout", "120", *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115


def _tokens(model: str, **kw) -> list[list[int]]:
    llm = LLM(model, **ENGINE, **kw)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.core.shutdown()


def _two_nodes(model: str, tmp_path: Path, **kw) -> list[list[int]]:
    addr = f"127.0.0.1:{free_port()}"
    flags = [f"--{k}={v}" for k, v in kw.items()]
    node1 = _node1(model, addr, *flags, log=tmp_path / "node1.log")
    try:
        tokens = _tokens(model, nnodes=2, node_rank=0, dist_init_addr=addr, dist_timeout=120, **kw)
        assert node1.wait(30) == 0, (tmp_path / "node1.log").read_text()  # node 1 ends with node 0's shutdown
    finally:
        if node1.poll() is None:
            node1.kill()
    return tokens


def test_two_nodes_tp2_give_the_tokens_of_tp1_and_log_the_gloo_table(tmp_path, caplog):
    make_hf_checkpoint(tmp_path, LlamaConfig(**_TINY, rope_theta=10000.0))
    with caplog.at_level(logging.INFO, logger="graphserve"):
        assert _two_nodes(str(tmp_path), tmp_path, tp=2) == _tokens(str(tmp_path))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("all-reduce")]
    assert lines[0].startswith("all-reduce topology: cpu") and "--nnodes=2" in lines[0]
    assert "gloo only" in lines[1]
    table = [ln for ln in lines[2:] if "->" in ln]
    assert len(table) == 8 and all(ln.endswith("-> gloo") and " us" in ln for ln in table)


def test_two_nodes_ep2_give_the_tokens_of_one_rank_on_a_moe_model(tmp_path):
    # 4 experts, 2 per node at --ep 2; the shared expert is added once, before the experts' all-reduce
    make_hf_checkpoint(tmp_path, Qwen2MoeConfig(
        **_TINY, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, rope_theta=1000000.0))
    assert _two_nodes(str(tmp_path), tmp_path, ep=2) == _tokens(str(tmp_path))


def test_killing_node1_ends_node0_within_10s_and_fails_its_request(tmp_path):
    make_hf_checkpoint(tmp_path, LlamaConfig(**_TINY, rope_theta=10000.0))
    addr = f"127.0.0.1:{free_port()}"
    node1 = _node1(str(tmp_path), addr, "--tp", "2", log=tmp_path / "node1.log")
    node0 = ServerProcess(tmp_path, "--device", "cpu", "--dtype", "float32", "--tp", "2", "--nnodes", "2",
                          "--node-rank", "0", "--dist-init-addr", addr, model=str(tmp_path))
    try:
        node0.start(timeout=180)
        long = {"prompt": "long", "max_tokens": 400, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started: concurrent.futures.Future = concurrent.futures.Future()
            streamed = pool.submit(stream_until_first_event, node0.base_url, long, started)
            started.result(timeout=60)
            killed_at = time.monotonic()
            node1.send_signal(signal.SIGKILL)
            events = streamed.result(timeout=30)
            code = node0.wait(15)
        assert time.monotonic() - killed_at < 10, node0.log()
        assert code != 0
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    finally:
        node0.stop()
        if node1.poll() is None:
            node1.kill()


def test_node0_declares_a_node_lost_when_its_heartbeat_stops(monkeypatch):
    """An idle node 0 runs no collective that could fail: the heartbeat is what notices a dead node."""
    import threading

    from graphserve.distributed import nodes

    monkeypatch.setattr(nodes, "NODE_LOST_S", 1.0)
    config = EngineConfig(device="cpu", tp=2, nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}")
    store = nodes.connect_store(config, 2, master=True)
    lost: list[str] = []
    done = threading.Event()
    watch = nodes.NodeWatch(config, lambda reason: (lost.append(reason), done.set()))
    node1 = nodes.NodeWatch(config.replace(node_rank=1), lambda reason: None)
    try:
        time.sleep(2.0)
        assert not lost, "node 1 beats: it is alive"
        node1.stop()  # its heartbeat stops, as when its process is killed
        stopped = time.monotonic()
        assert done.wait(5.0)
        assert time.monotonic() - stopped < 1.0 + 1.5
        assert lost[0].startswith("node 1 stopped answering")
    finally:
        watch.stop()
        node1.stop()
    del store


def test_node1_declares_node0_lost_when_its_process_dies(tmp_path):
    """Node 0's process (its store and its watcher) killed: node 1's watcher sees the connection close at once."""
    import threading

    from graphserve.distributed import nodes

    addr = f"127.0.0.1:{free_port()}"
    script = ("import sys, time\n"
              "from graphserve.config import EngineConfig\n"
              "from graphserve.distributed import nodes\n"
              f"config = EngineConfig(device='cpu', tp=2, nnodes=2, dist_init_addr='{addr}')\n"
              "store = nodes.connect_store(config, 2, master=True)\n"
              "watch = nodes.NodeWatch(config, lambda reason: None)\n"
              "print('ready', flush=True)\n"
              "time.sleep(120)\n")
    node0 = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.PIPE)
    try:
        assert node0.stdout is not None and node0.stdout.readline().strip() == b"ready"
        lost: list[str] = []
        done = threading.Event()
        config = EngineConfig(device="cpu", tp=2, nnodes=2, node_rank=1, dist_init_addr=addr)
        watch = nodes.NodeWatch(config, lambda reason: (lost.append(reason), done.set()))
        time.sleep(0.5)
        assert not lost
        node0.kill()
        killed = time.monotonic()
        assert done.wait(5.0)
        assert time.monotonic() - killed < 2.0
        assert lost[0] == "node 0's connection closed (its process ended)"
        watch.stop()
    finally:
        if node0.poll() is None:
            node0.kill()
        node0.wait()


def test_mismatched_flags_are_refused_on_both_nodes_naming_the_flag_and_both_values(tmp_path):
    make_hf_checkpoint(tmp_path, LlamaConfig(**_TINY, rope_theta=10000.0))
    addr = f"127.0.0.1:{free_port()}"
    node1 = _node1(str(tmp_path), addr, "--tp", "2", "--block-size", "32", log=tmp_path / "node1.log")
    threads = torch.get_num_threads()
    try:
        with pytest.raises(ConfigError) as e:
            LLM(str(tmp_path), **ENGINE, tp=2, nnodes=2, node_rank=0, dist_init_addr=addr, dist_timeout=120)
        assert e.value.param == "block_size"
        assert "--block-size=16 on node 0 but --block-size=32 on node 1" in e.value.message
        assert node1.wait(30) == 2
        log = (tmp_path / "node1.log").read_text()
        assert "--block-size=32 on node 1 but --block-size=16 on node 0" in log
    finally:
        torch.set_num_threads(threads)
        if node1.poll() is None:
            node1.kill()


def test_an_unreachable_dist_init_addr_is_refused_within_dist_timeout():
    from graphserve.engine.node import run_node

    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    # the store's client retries once after a randomized delay of up to ~2.5 s past the timeout: the bound is that
    # the refusal comes in seconds, not the default 10 minutes, with room for a loaded 2-core machine
    bound = 1.5 + 5.0
    config = EngineConfig(device="cpu", tp=2, nnodes=2, node_rank=1, dist_init_addr=addr, dist_timeout=1.5)
    threads = torch.get_num_threads()
    start = time.monotonic()
    try:
        with pytest.raises(ConfigError) as e:
            run_node(config)
    finally:
        torch.set_num_threads(threads)
    assert time.monotonic() - start < bound
    assert e.value.param == "dist_init_addr"
    assert f"--dist-init-addr={addr}" in e.value.message and "--dist-timeout=1.5 s" in e.value.message
    # node 0 waits as long for the others to join, and names the missing ones
    start = time.monotonic()
    try:
        with pytest.raises(ConfigError) as e:
            LLM("builtin:tiny-llama", **ENGINE, tp=2, nnodes=2, dist_init_addr=addr, dist_timeout=1.5)
    finally:
        torch.set_num_threads(threads)
    assert time.monotonic() - start < bound
    assert e.value.param == "dist_timeout"
    assert e.value.message == (f"node(s) [1] did not join --dist-init-addr={addr} within --dist-timeout=1.5 s "
                               "(--nnodes=2)")


@pytest.mark.parametrize(("kw", "param", "words"), [
    (dict(tp=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank", "--node-rank=2"),
    (dict(tp=2, nnodes=2), "dist_init_addr", "HOST:PORT"),
    (dict(tp=2, nnodes=2, dist_init_addr="node0:99999"), "dist_init_addr", "node0:99999"),
    (dict(tp=2, nnodes=4, dist_init_addr="node0:5000"), "nnodes", "--tp=2 --ep=1 runs 2 rank(s)"),
    (dict(tp=6, nnodes=4, dist_init_addr="node0:5000"), "nnodes", "multiple of 4"),
    (dict(dist_timeout=0), "dist_timeout", "--dist-timeout=0"),
])
def test_node_flags_are_checked_at_construction(kw, param, words):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kw)
    assert e.value.param == param and words in e.value.message


def test_flag_mismatches_name_each_flag_and_both_values():
    from graphserve.distributed.nodes import flag_mismatches, shared_flags

    a = shared_flags(EngineConfig(model="m1", tp=2, nnodes=2, dist_init_addr="h:1"))
    b = shared_flags(EngineConfig(model="m2", tp=2, dtype="bfloat16", nnodes=2, node_rank=1, dist_init_addr="h:1"))
    assert flag_mismatches(a, 0, a, 1) == []
    assert flag_mismatches(a, 0, b, 1) == ["--model=m1 on node 0 but --model=m2 on node 1",
                                           "--dtype=auto on node 0 but --dtype=bfloat16 on node 1"]
