"""config.json ``architectures[0]`` -> model class."""

from __future__ import annotations

from torch import nn

from graphserve.errors import ModelLoadError
from graphserve.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_model_class(architectures: list[str] | None) -> type[nn.Module]:
    arch = architectures[0] if architectures else None
    if arch not in MODEL_REGISTRY:
        raise ModelLoadError(
            f"architectures[0]={arch!r} is not supported: choose one of {', '.join(supported_architectures())}",
            param="model",
        )
    return MODEL_REGISTRY[arch]
