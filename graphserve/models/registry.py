"""config.json ``architectures[0]`` -> model class."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from graphserve.errors import ModelLoadError
from graphserve.layers.quant.config import Fp8Config, IgnoreList
from graphserve.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from graphserve.models.deepseek_dsa import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from graphserve.models.deepseek_v4 import DeepseekV4ForCausalLM
from graphserve.models.description import ModelDescription
from graphserve.models.gpt_oss import GptOssForCausalLM
from graphserve.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from graphserve.models.moe import MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
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


def hf_config_object(hf: Mapping[str, Any] | Any) -> Any:
    """A transformers config object from a config.json dict (objects pass through)."""
    if not isinstance(hf, Mapping):
        return hf
    from transformers import AutoConfig

    fields = {k: v for k, v in hf.items() if not k.startswith("_")}
    try:
        return AutoConfig.for_model(**fields)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"config.json model_type={hf.get('model_type')!r} cannot be read: {e}",
                             param="model") from e


def ignore_list(hf: Mapping[str, Any] | Any, quant: Fp8Config | None) -> IgnoreList | None:
    """``quant``'s ignore list in the family's own module names, what the loader quantizes by; None when it lists
    nothing. The family maps checkpoint names with its model's ``map_weight_name``: the model is assembled on the
    meta device, which holds no memory."""
    if quant is None or not quant.ignored:
        return None
    config = hf_config_object(hf)
    model_cls = resolve_model_class(getattr(config, "architectures", None))
    with torch.device("meta"):
        model = model_cls(config, config.max_position_embeddings)
    if getattr(quant, "fmt", None) is not None:  # FP4's globs: layers/quant/fp4_config.py
        from graphserve.layers.quant.fp4_config import fp4_ignore_list

        return fp4_ignore_list(quant, model)
    return IgnoreList(quant, model.map_weight_name, model.stacked_params)


def describe_model(hf: Mapping[str, Any] | Any, dtype: torch.dtype, tp: int = 1, ep: int = 1) -> ModelDescription:
    """The family's own description of a config (KV layout, weight and activation footprint), per rank."""
    config = hf_config_object(hf)
    model_cls = resolve_model_class(getattr(config, "architectures", None))
    try:
        return model_cls.describe(config, dtype, tp=tp, ep=ep)
    except ValueError as e:
        raise ModelLoadError(str(e), param="tp") from e
