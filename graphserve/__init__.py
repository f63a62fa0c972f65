"""graphserve: an LLM serving engine with a CUDA-graph-first decode path."""

from __future__ import annotations

from graphserve.config import EngineConfig
from graphserve.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from graphserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'graphserve' has no attribute {name!r}")
