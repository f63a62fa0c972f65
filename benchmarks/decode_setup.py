"""What the decode-step benchmarks set up alike: a KV cache holding ``seqs`` sequences of ``ctx`` cached tokens
and the decode step captured as CUDA graphs for their batch sizes (the batch of ``bs`` such sequences is
benchmarks/decode.make_batch).

benchmarks/fp8.py, moe.py, moe_fp8.py, pdl.py and deepseek.py take what they need of these, so a step means the
same thing in each of their tables: every sequence at position ``ctx`` over ``ctx`` cached tokens, the cache
filled with random values (a real cache's bytes, not zeros), graphs with room for 64 tokens past ``ctx``.
"""

from __future__ import annotations

import gc

import torch

# tokens past the context the captured graphs' block tables cover (the benchmarks' max_model_len headroom)
HEADROOM = 64


def context_kv_caches(info, seqs: int, ctx: int, block_size: int, device: torch.device, fill: str = "random"):
    """KV caches with blocks for ``seqs`` sequences of ``ctx + 1`` tokens (the cached ones and the one decoded),
    plus the dummy block the graphs' padding rows write to and one spare."""
    return info.kv.allocate(seqs * (-(-(ctx + 1) // block_size)) + 2, block_size, device, fill=fill)


def captured_graphs(model, backend, kv_caches, sizes: list[int], ctx: int, cfg, device: torch.device):
    """The decode step captured at each of ``sizes`` (engine/graphs.GraphRunner), block tables wide enough for
    ``ctx`` plus ``HEADROOM`` tokens."""
    from graphserve.engine.graphs import GraphRunner

    graphs = GraphRunner(model, backend, kv_caches, sizes, (ctx + HEADROOM) // cfg.block_size + 1,
                         cfg.max_model_len, device)  # fmt: skip
    graphs.capture()
    return graphs


def release_gpu_memory() -> None:
    """Return what the dropped model and caches held, before the next model loads."""
    gc.collect()
    torch.cuda.empty_cache()
