"""`graphserve plan --tp/--ep --nnodes`: what each GPU holds and runs, node by node.

Rank r runs on node ``r // per_node``, local GPU ``r % per_node`` (distributed/nodes.py); its share of the
model is the family's own description at that split (the same ``describe_model`` the loader and the memory
plan read), so the rows agree with what the ranks load.
"""

from __future__ import annotations

from typing import Any

import torch

from graphserve.models.registry import describe_model


def placement(hf: dict[str, Any], tp: int, ep: int, nnodes: int, weights_bytes: int) -> list[dict[str, Any]]:
    world = max(tp, ep)
    per_node = world // nnodes
    # the memory plan's weights are this split's (--ep included), quantized as the loader holds them
    desc = describe_model(hf, torch.bfloat16, tp=tp, ep=ep)
    heads = int(hf.get("num_attention_heads") or 0)
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    rows = []
    for rank in range(world):
        row: dict[str, Any] = {"node": rank // per_node, "gpu": rank % per_node, "rank": rank,
                               "weights_bytes": weights_bytes, "runs": "scheduler, HTTP, rank 0" if rank == 0 else "rank"}
        if tp > 1 and heads:
            row["attention"] = f"heads {heads // tp} of {heads} (KV {max(1, kv_heads // tp)} of {kv_heads})"
        elif heads:
            row["attention"] = f"all {heads} heads (replicated)"
        if desc.num_experts:
            if ep > 1:
                lo = rank % ep * desc.local_experts
                row["experts"] = f"experts {lo}..{lo + desc.local_experts - 1} of {desc.num_experts}, whole"
            elif tp > 1:
                row["experts"] = f"1/{tp} of each of {desc.num_experts} experts"
            else:
                row["experts"] = f"all {desc.num_experts} experts"
        rows.append(row)
    return rows


def format_placement(rows: list[dict[str, Any]], tp: int, ep: int, nnodes: int) -> str:
    per_node = len(rows) // nnodes
    lines = ["", f"placement            {len(rows)} rank(s) over {nnodes} node(s), {per_node} GPU(s) each "
                 f"(tp {tp}, ep {ep})"]
    for r in rows:
        parts = [r.get("attention"), r.get("experts"), f"{r['weights_bytes'] / 2**30:.2f} GiB weights", r["runs"]]
        lines.append(f"  node {r['node']} GPU {r['gpu']}  rank {r['rank']:<3} " + "; ".join(p for p in parts if p))
    if nnodes > 1:
        lines.append(f"  all-reduce: NCCL across nodes (peer memory needs one host); --node-rank 1..{nnodes - 1} "
                     "run ranks only and end with node 0")
    return "\n".join(lines)
