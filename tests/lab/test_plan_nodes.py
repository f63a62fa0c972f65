"""`graphserve plan --nnodes`: each GPU's row names its node, rank, heads and experts; a split that --nnodes
does not divide is refused naming the flags."""

from __future__ import annotations

import json

from graphserve.cli import main


def test_plan_over_two_nodes_says_what_each_gpu_holds(capsys):
    assert main(["plan", "dummy:qwen3-30b-a3b", "--tp", "4", "--ep", "4", "--nnodes", "2", "--gpu-memory-gb", "80",
                 "--concurrency", "1"]) == 0
    out = capsys.readouterr().out
    assert "placement            4 rank(s) over 2 node(s), 2 GPU(s) each (tp 4, ep 4)" in out
    assert "node 0 GPU 0  rank 0   heads 8 of 32 (KV 1 of 4); experts 0..31 of 128, whole;" in out
    assert "scheduler, HTTP, rank 0" in out
    assert "node 1 GPU 1  rank 3   heads 8 of 32 (KV 1 of 4); experts 96..127 of 128, whole;" in out
    assert "NCCL across nodes" in out
    assert main(["plan", "dummy:qwen3-30b-a3b", "--tp", "4", "--nnodes", "2", "--gpu-memory-gb", "80",
                 "--concurrency", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["placement"]
    assert [(r["node"], r["gpu"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["experts"] == "1/4 of each of 128 experts" for r in rows)


def test_plan_refuses_a_split_that_nnodes_does_not_divide(capsys):
    assert main(["plan", "dummy:qwen3-30b-a3b", "--tp", "2", "--nnodes", "4"]) == 2
    err = capsys.readouterr().err
    assert "--tp=2 --ep=1 runs 2 rank(s), which --nnodes=4 cannot split evenly" in err
