"""What several GPU test files share: the MoE presets' expert shapes, the relative error they
compare by, the warm-up-then-capture every CUDA-graph replay test starts with, and a dummy model with a KV
pool and the engine's graph runner for decode steps over a fixed context."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

# name: (experts, hidden, intermediate per expert, top_k, renormalise)
MOE_MODELS = {
    "qwen3-30b-a3b": (128, 2048, 768, 8, True),
    "mixtral-8x7b": (8, 4096, 14336, 2, True),
    "olmoe-1b-7b": (64, 2048, 1024, 8, False),
    "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4, False),
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def capture(step: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """(graph, what the captured call returned) of ``step`` run once on a side stream first, so
    Triton compiles and autotunes outside the capture, then captured there."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = step()
    return graph, out


def decode_model(name: str, ctx: int, rows: int, **engine_args):
    """(config, loaded model, KV caches) of the dummy model ``name`` on the GPU, with a random KV pool that holds
    ``rows`` sequences of ``ctx + 1`` tokens; ``engine_args`` go to EngineConfig (max_model_len ctx + 64 unless
    given)."""
    from graphserve.config import EngineConfig
    from graphserve.models.loader import load_model

    device = torch.device("cuda")
    cfg = EngineConfig(model=name, device="cuda", **{"max_model_len": ctx + 64, **engine_args})
    loaded = load_model(cfg, device)
    bsz = cfg.block_size
    return cfg, loaded, loaded.info.kv.allocate(rows * (-(-(ctx + 1) // bsz)) + 2, bsz, device, fill="random")


def graph_runner(cfg, model, backend, kv_caches, sizes: list[int], ctx: int):
    """The engine's CUDA-graph runner for decode batches of ``sizes`` over contexts up to ``ctx + 64``, not yet
    captured."""
    from graphserve.engine.graphs import GraphRunner

    return GraphRunner(model, backend, kv_caches, sizes, (ctx + 64) // cfg.block_size + 1, cfg.max_model_len,
                       torch.device("cuda"))
