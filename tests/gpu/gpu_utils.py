"""What several GPU test files share: the MoE presets' expert shapes, the relative error they
compare by, and the warm-up-then-capture every CUDA-graph replay test starts with."""

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
