"""Beyond one box, on a multi-GPU host: the all-reduce path table, and --tp 2 across two "nodes" against --tp 2
on one node.

Two parts, each in fresh processes (NCCL's environment is read when its communicators form):

- ``allreduce``: the table the engine measures at start-up (graphserve/distributed/allreduce_choice.py:
  NCCL, one-shot and two-shot peer all-reduce per message size, 4 KiB .. 8 MiB bf16, slowest rank's mean), on
  ``--gpus`` ranks, with the topology it found; once as the host offers it (NVLink where present) and once with
  ``NCCL_P2P_DISABLE=1``, the stand-in for a box whose GPUs have no peer-to-peer. ``best/nccl`` is the chosen
  path's time over NCCL's at that size (below 1: the peer-memory path wins).
- ``nodes``: ``dummy:qwen3-0.6b`` decoding ``--batch`` requests for ``--tokens`` tokens each, greedy, through
  the engine (CUDA graphs, the overlap schedule): ``--tp 2`` on one node (GPUs 0 and 1, one process group on
  one host) against ``--tp 2`` over ``--nnodes 2`` on the same machine (node 0 sees GPU 0 only, node 1 GPU 1
  only, meeting at a loopback --dist-init-addr). The step is the median decode step_ms of the engine's
  telemetry; ``vs_one_node`` is the two-node step over the one-node step (target <= 1.05). Across nodes the
  peer-memory paths are off by design, and two processes that each see one GPU cannot map each other's
  memory: NCCL takes whatever transport it finds (its INFO lines, with NCCL_DEBUG=INFO, say which).

Run on >= 2 GPUs: python3 -m benchmarks.scale_out [--parts allreduce nodes] [--gpus 2] [--quick]
(writes benchmarks/results/scale_out.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import print_table, write_result

ROOT = Path(__file__).resolve().parents[1]
MODEL = "dummy:qwen3-0.6b"
AR_COLS = ["variant", "size", "nccl_us", "oneshot_us", "twoshot_us", "chosen", "best/nccl"]
NODE_COLS = ["variant", "nnodes", "batch", "decode_steps", "step_ms", "vs_one_node"]


# ---- all-reduce table: one process per rank ----------------------------------------------------------------

def _allreduce_rank(rank: int, world: int, init_method: str, p2p: bool, out_path: str) -> None:
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    if not p2p:
        os.environ["NCCL_P2P_DISABLE"] = "1"
    from graphserve.config import EngineConfig
    from graphserve.distributed.allreduce_choice import choose_all_reduce, detect_topology
    from graphserve.distributed.state import destroy_parallel, init_parallel
    from graphserve.models.parallel_check import model_dtype

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    config = EngineConfig(model=MODEL, dtype="bfloat16", tp=world, device=f"cuda:{rank}")
    parallel = init_parallel(rank, world, 1, init_method, device)
    table = choose_all_reduce(parallel, config, device, model_dtype(config))
    topology = detect_topology(list(range(world)))
    torch.cuda.synchronize()
    destroy_parallel()
    if rank == 0 and table is not None:
        Path(out_path).write_text(json.dumps({"topology": topology.line(), "note": table.note, "sizes": table.sizes,
                                              "times_us": table.times_us, "chosen": table.chosen}))


def allreduce_rows(world: int, p2p: bool) -> tuple[list[dict], str]:
    import torch.multiprocessing as mp

    from graphserve.engine.ranks import free_tcp_address

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "table.json")
        mp.start_processes(_allreduce_rank, args=(world, free_tcp_address(), p2p, out), nprocs=world, join=True,
                           start_method="spawn")
        t = json.loads(Path(out).read_text())
    variant = "host links" if p2p else "NCCL_P2P_DISABLE=1"
    rows = []
    for i, size in enumerate(t["sizes"]):
        row = {"variant": variant, "size": f"{size >> 10} KiB", "chosen": t["chosen"][i]}
        for path, times in t["times_us"].items():
            row[f"{path}_us"] = times[i]
        row["best/nccl"] = row[f"{t['chosen'][i]}_us"] / row["nccl_us"]
        rows.append(row)
    return rows, t["topology"] + (f" [{t['note'].lstrip(': ')}]" if t["note"] else "")


# ---- --tp 2 on one node against two "nodes" ------------------------------------------------------------------

def engine_main(args: argparse.Namespace) -> None:
    """One engine (node 0): decode a fixed batch and print the median decode step in ms as JSON."""
    from graphserve import LLM, SamplingParams

    kw = dict(tp=2, dtype="bfloat16", max_model_len=1024, cuda_graph_max_bs=max(args.batch, 1))
    if args.nnodes > 1:
        kw.update(nnodes=args.nnodes, node_rank=0, dist_init_addr=args.addr, dist_timeout=300)
    llm = LLM(args.model, **kw)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompts = [[1 + (i * 7 + j) % 1000 for j in range(32)] for i in range(args.batch)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # warm: graphs, allocator
    before = len(llm.engine.core.telemetry.records())
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    decode = [r for r in llm.engine.core.telemetry.records()[before:] if r.kind == "decode"
              and r.batch_size == args.batch]
    llm.engine.core.shutdown()
    print("RESULT " + json.dumps({"step_ms": statistics.median(r.step_ms for r in decode), "steps": len(decode)}),
          flush=True)


def _engine(model: str, nnodes: int, batch: int, tokens: int, env: dict[str, str], addr: str = "") -> dict:
    cmd = [sys.executable, "-m", "benchmarks.scale_out", "_engine", "--model", model, "--nnodes", str(nnodes),
           "--batch", str(batch), "--tokens", str(tokens), "--addr", addr]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=1200)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"engine (nnodes={nnodes}) failed with {out.returncode}:\n{out.stderr[-4000:]}")
    return json.loads(line.removeprefix("RESULT "))


def node_rows(batches: list[int], tokens: int, model: str = MODEL) -> list[dict]:
    from graphserve.engine.ranks import free_tcp_address

    rows = []
    for batch in batches:
        one = _engine(model, 1, batch, tokens, {"CUDA_VISIBLE_DEVICES": "0,1"})
        addr = free_tcp_address().removeprefix("tcp://")
        node1 = subprocess.Popen([sys.executable, "-m", "graphserve.cli", "serve", model, "--tp", "2", "--dtype",
                                  "bfloat16", "--max-model-len", "1024", "--cuda-graph-max-bs", str(max(batch, 1)),
                                  "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr, "--dist-timeout", "300"],
                                 cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"})
        try:
            two = _engine(model, 2, batch, tokens, {"CUDA_VISIBLE_DEVICES": "0"}, addr)
            node1.wait(60)
        finally:
            if node1.poll() is None:
                node1.kill()
        rows.append({"variant": "tp2 one node", "nnodes": 1, "batch": batch, "decode_steps": one["steps"],
                     "step_ms": one["step_ms"], "vs_one_node": 1.0})
        rows.append({"variant": "tp2 two nodes", "nnodes": 2, "batch": batch, "decode_steps": two["steps"],
                     "step_ms": two["step_ms"], "vs_one_node": two["step_ms"] / one["step_ms"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=("allreduce", "nodes"), default=["allreduce", "nodes"])
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the all-reduce table")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=MODEL, help="the nodes part's model")
    args = parser.parse_args()
    if torch.cuda.device_count() < max(2, args.gpus):
        raise SystemExit(f"needs {max(2, args.gpus)} GPUs, {torch.cuda.device_count()} visible")
    t0 = time.perf_counter()
    payload: dict = {}
    if "allreduce" in args.parts:
        rows, topologies = [], []
        for p2p in (True, False):
            r, topo = allreduce_rows(args.gpus, p2p)
            rows += r
            topologies.append(topo)
        print("\n".join(topologies))
        print_table(rows, AR_COLS)
        payload["allreduce"] = rows
        payload["topology"] = topologies
    if "nodes" in args.parts:
        rows = node_rows([1, 32] if args.quick else [1, 8, 32, 64], tokens=64 if args.quick else 128,
                         model=args.model)
        print_table(rows, NODE_COLS)
        payload["nodes"] = rows
        payload["nodes_target"] = "vs_one_node <= 1.05"
    payload["seconds"] = time.perf_counter() - t0
    print(f"wrote {write_result('scale_out', payload)}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_engine":
        p = argparse.ArgumentParser()
        p.add_argument("_engine")
        p.add_argument("--model", default=MODEL)
        p.add_argument("--nnodes", type=int, default=1)
        p.add_argument("--batch", type=int, default=8)
        p.add_argument("--tokens", type=int, default=128)
        p.add_argument("--addr", default="")
        engine_main(p.parse_args())
    else:
        main()
