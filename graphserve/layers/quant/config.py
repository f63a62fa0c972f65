"""What a model's weights are quantized to: read from a checkpoint's ``quantization_config`` or from
``--quantization``, validated once, and refused by name when graphserve cannot run it exactly.

Accepted, ``quant_method: "fp8"`` (e4m3) only:
- ``weight_block_size: [bn, bk]`` with ``activation_scheme: "dynamic"``: the DeepSeek-V3 / Qwen3-FP8
  layout, ``*.weight`` fp8 and ``*.weight_scale_inv`` fp32 ``[ceil(N/bn), ceil(K/bk)]``, activations
  quantized per token in groups of ``bk``;
- no block size: per-tensor or per-channel ``*.weight_scale`` (shape ``[]``/``[1]`` or ``[N]``/``[N, 1]``),
  activations quantized per token ("dynamic") or by the checkpoint's ``*.input_scale`` ("static");
- ``ignored_layers`` / ``modules_to_not_convert`` (both read): checkpoint module names kept in the model dtype.
  graphserve fuses q/k/v, gate/up and a layer's experts, so a fused layer is kept when every checkpoint module it
  fuses is listed (``IgnoreList``), and refused when some are.

Anything else — another quant_method, an unknown key, another fp8 format — is a ModelLoadError
naming the field: a model is never run in bf16 while its config says it is quantized.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphserve.config import QUANTIZATIONS
from graphserve.errors import ConfigError, ModelLoadError
from graphserve.layers.quant.fp4_config import fp4_description, online_fp4_config, parse_fp4_config

# The layers every format keeps in the model dtype and the ignore lists that keep others live in ignore_list.py,
# below this module and fp4_config.py; importers may keep naming them here.
from graphserve.layers.quant.ignore_list import (  # noqa: F401
    DEQUANTIZED_AT_LOAD,
    DOWN_PARTS,
    EXPERT_PARTS,
    GATE_UP_PARTS,
    MODEL_DTYPE_LAYERS,
    ROUTER_GATES,
    IgnoreList,
)

DEFAULT_BLOCK = (128, 128)  # what DeepSeek-V3 and Qwen3-FP8 ship, and what --quantization fp8 writes
_IGNORE_KEYS = ("ignored_layers", "modules_to_not_convert")  # vLLM's name, transformers'
# what transformers' FineGrainedFP8Config writes beside the keys above, each at the one value that changes nothing
# here: the weights stay fp8 (dequantize), every projection not ignored is fp8 (modules_to_convert), scales are
# plain floats (scale_fmt; DeepSeek-V3.1's "ue8m0" rounds them to powers of two, which graphserve does not model)
_NO_OP_KEYS: dict[str, Any] = {"dequantize": False, "modules_to_convert": None, "scale_fmt": "float"}
_KNOWN_KEYS = {"quant_method", "weight_block_size", "activation_scheme", "fmt", *_IGNORE_KEYS, *_NO_OP_KEYS}
# the CUDA kernels read a scale tile's rows and columns in steps of at least 16 (tl.dot's smallest), by powers of two
MIN_BLOCK = 16
# attention scales some FP8 exporters store beside the K/V projections (vLLM reads them for a scaled fp8 KV cache);
# graphserve's fp8 KV cache (--kv-cache-dtype) is unscaled, so a checkpoint holding them is refused by name
KV_CACHE_SCALES = ("k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale")


@dataclass(frozen=True)
class Fp8Config:
    block: tuple[int, int] | None  # (block_n, block_k) weight scale tiles; None: one scale per channel
    activation_scheme: str = "dynamic"  # "dynamic" (per token (group), each forward) or "static" (input_scale)
    serialized: bool = True  # the checkpoint stores fp8 weights (else: model-dtype weights quantized at load)
    ignored: tuple[str, ...] = ()  # checkpoint module names kept in the model dtype (IgnoreList matches them)
    ignored_field: str = "quantization_config.ignored_layers"  # the key(s) ``ignored`` came from, for errors
    # the routed experts' weight scale tiles where they differ from the dense projections' ("dense": as
    # ``block``); ``--quantization fp8`` quantizes dense projections per channel and experts in 128x128 blocks
    expert_block: tuple[int, int] | None | str = "dense"

    @property
    def experts(self) -> tuple[int, int] | None:
        """The routed experts' (block_n, block_k) scale tiles; None: one scale per channel."""
        return self.block if self.expert_block == "dense" else self.expert_block

    @property
    def name(self) -> str:
        def kind(block: tuple[int, int] | None) -> str:
            return f"block {block[0]}x{block[1]}" if block else "per-channel"

        experts = f", experts {kind(self.experts)}" if self.experts != self.block else ""
        return f"fp8 ({kind(self.block)}{experts}, {self.activation_scheme} activations)"

    def projection_scale_bytes(self, out_features: int, in_features: int, parts: int = 1) -> int:
        """The fp32 scales of one dense projection in fp8 (layers/quant/fp8.py): one per (bn, bk) tile, or one per
        output row; with static activations a serialized layer also holds an ``input_scale`` per fused part."""
        inputs = parts if self.serialized and self.activation_scheme == "static" else 0
        return 4 * (weight_scales(self.block, out_features, in_features) + inputs)

    def expert_scale_bytes(self, hidden: int, intermediate: int) -> int:
        """The fp32 scales of one routed expert's gate, up [I, H] and down [H, I] in fp8 (layers/quant/fp8_moe.py:
        gate and up blocked apart); with static activations a serialized layer also holds one ``input_scale`` per
        part."""
        block = self.experts
        inputs = 3 if self.serialized and self.activation_scheme == "static" else 0
        return 4 * (2 * weight_scales(block, intermediate, hidden) + weight_scales(block, hidden, intermediate)
                    + inputs)


def weight_scales(block: tuple[int, int] | None, out_features: int, in_features: int) -> int:
    """How many fp32 scales an fp8 ``[out_features, in_features]`` weight holds: ``ceil(N/bn)·ceil(K/bk)`` tiles
    with ``block`` (bn, bk), else one per output row."""
    if block:
        return -(-out_features // block[0]) * -(-in_features // block[1])
    return out_features


def parse_quantization_config(raw: Mapping[str, Any] | None) -> Fp8Config | None:
    """A checkpoint's ``quantization_config`` (config.json) as an Fp8Config, None when absent."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ModelLoadError(f"quantization_config={raw!r} is not an object", param="model")
    method = raw.get("quant_method")
    if method in ("modelopt", "mxfp4"):  # FP4: layers/quant/fp4_config.py
        return parse_fp4_config(raw)
    if method != "fp8":
        raise ModelLoadError(f"quantization_config.quant_method={method!r} is not supported: graphserve loads "
                             "quant_method 'fp8', 'modelopt' (NVFP4) and 'mxfp4' checkpoints", param="model")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise ModelLoadError(f"quantization_config.{unknown[0]}={raw[unknown[0]]!r} is not supported: an fp8 config "
                             f"may name {', '.join(sorted(_KNOWN_KEYS))}", param="model")
    for key, no_op in _NO_OP_KEYS.items():
        value = raw.get(key, no_op)
        if value != no_op or type(value) is not type(no_op):
            raise ModelLoadError(f"quantization_config.{key}={value!r} is not supported: graphserve accepts only "
                                 f"{json.dumps(no_op)} (transformers' default)", param="model")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"quantization_config.fmt={fmt!r} is not supported: only e4m3", param="model")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(f"quantization_config.activation_scheme={scheme!r} is invalid: choose dynamic or static",
                             param="model")
    block = raw.get("weight_block_size")
    if block is not None:
        # bool is an int subclass: JSON's true is refused, not read as a block of 1
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(type(b) is int and b >= MIN_BLOCK and not b & (b - 1) for b in block)):
            raise ModelLoadError(f"quantization_config.weight_block_size={block!r} is invalid: two powers of two "
                                 f">= {MIN_BLOCK}, e.g. [128, 128]", param="model")
        if scheme != "dynamic":
            raise ModelLoadError(f"quantization_config.activation_scheme={scheme!r} with weight_block_size is not "
                                 "supported: block-wise checkpoints quantize activations dynamically", param="model")
        block = (int(block[0]), int(block[1]))
    lists = {key: _module_names(raw, key) for key in _IGNORE_KEYS if raw.get(key) is not None}
    ignored = tuple(dict.fromkeys(name for names in lists.values() for name in names))  # both, in order, once
    field = {"ignored_field": " / ".join(f"quantization_config.{key}" for key in lists)} if lists else {}
    return Fp8Config(block=block, activation_scheme=scheme, serialized=True, ignored=ignored, **field)


def _module_names(raw: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = raw[key]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ModelLoadError(f"quantization_config.{key}={value!r} is invalid: expected a list of module names "
                             '(strings), e.g. ["lm_head"], or null', param="model")
    return tuple(value)


def scale_has_no_place(ckpt_name: str, owner: Any) -> str | None:
    """Why checkpoint tensor ``ckpt_name``, a scale, has no parameter to load into (the loader's error), naming the
    scales graphserve loads; None where the tensor is no scale. ``owner``: the module its name maps into, if any."""
    leaf = ckpt_name.rpartition(".")[2]
    loaded = ("graphserve loads an fp8 checkpoint's weight_scale_inv (with weight_block_size), weight_scale (per "
              "channel or tensor) and input_scale (with activation_scheme 'static')")
    if leaf in KV_CACHE_SCALES:
        return (f"checkpoint tensor {ckpt_name!r} is a KV-cache scale, which graphserve does not load (its fp8 KV "
                f"cache, --kv-cache-dtype fp8_e4m3, is unscaled): {loaded}")
    if leaf not in ("weight_scale_inv", "weight_scale", "input_scale"):
        return None
    method = getattr(owner, "quant_method", None)
    if method is None:
        return (f"checkpoint tensor {ckpt_name!r} scales a layer graphserve holds in the model dtype (config.json has "
                "no quantization_config, or its ignored_layers / modules_to_not_convert name the layer): expected no "
                f"{leaf} for it")
    if leaf == "input_scale":
        return (f"checkpoint tensor {ckpt_name!r} is a static activation scale, but quantization_config."
                f"activation_scheme={method.config.activation_scheme!r}: input_scale needs activation_scheme 'static'")
    return f"checkpoint tensor {ckpt_name!r} is no scale of {method.config.name}: {loaded}"


def online_config(quantization: str) -> Fp8Config | None:
    """``--quantization``: model-dtype weights quantized at load, activations per token (group)."""
    if quantization == "none":
        return None
    if quantization == "fp8":
        # dense projections per channel: at decode rows their x is quantized per token and the FP8 dot runs as
        # one chain over K, faster than block scales at 16-64 rows (benchmarks/results/fp8_route_channel.json);
        # routed experts in 128x128 blocks, which the grouped GEMM ran faster (benchmarks/RESULTS.md)
        return Fp8Config(block=None, expert_block=DEFAULT_BLOCK, serialized=False)
    if quantization == "fp8-block":
        return Fp8Config(block=DEFAULT_BLOCK, serialized=False)
    if quantization == "fp8-channel":
        return Fp8Config(block=None, serialized=False)
    if quantization in ("nvfp4", "mxfp4"):
        return online_fp4_config(quantization)
    raise ConfigError(f"--quantization={quantization!r} is invalid: choose one of {', '.join(QUANTIZATIONS)}",
                      param="quantization")


def resolve_quantization(checkpoint: Fp8Config | None, quantization: str) -> Fp8Config | None:
    """The checkpoint's own quantization wins; ``--quantization`` only applies to unquantized checkpoints."""
    if checkpoint is not None:
        fp4 = getattr(checkpoint, "fmt", None)  # an Fp4Config (layers/quant/fp4_config.py)
        if fp4 is not None and quantization not in ("none", fp4):
            raise ConfigError(f"--quantization={quantization} conflicts with the checkpoint's {checkpoint.name}: "
                              "drop the flag", param="quantization")
        if fp4 is None and quantization not in ("none", "fp8"):
            raise ConfigError(f"--quantization={quantization} conflicts with the checkpoint's {checkpoint.name}: "
                              "drop the flag", param="quantization")
        return checkpoint
    return online_config(quantization)


def quantized_description(desc: Any, quant: Fp8Config | None, model_dtype: torch.dtype,
                          ignore: IgnoreList | None = None) -> Any:
    """``desc`` (a ModelDescription) as the loader holds it under ``quant``: each projection and each MoE layer's
    routed experts in fp8 with their scales, counted exactly from each one's shape, unless ``ignore`` (the config's
    ignore list through the family's names: ``IgnoreList``, which the loader decides by too) keeps them in
    ``model_dtype``, unscaled. Embedding and lm_head stay in the model dtype, as do the dense parameters a family
    counts as ``model_dtype_params`` (norms, biases, router gates, MLA's kv_b_proj), which the kept projections
    join. ``ignore`` may be left out only when the config ignores nothing."""
    if quant is None:
        return desc
    if getattr(desc, "kept_unused", None) is not None:  # held apart (an MTP layer), quantized as the loader does it
        desc = dataclasses.replace(desc, kept_unused=quantized_description(desc.kept_unused, quant, model_dtype,
                                                                           ignore))
    if getattr(quant, "fmt", None) is not None:  # FP4: layers/quant/fp4_config.py
        return fp4_description(desc, quant, model_dtype, ignore)
    if ignore is None:
        if quant.ignored:
            raise ValueError(f"{quant.ignored_field} names modules kept in the model dtype: pricing them needs the "
                             "family's names (IgnoreList)")
        ignore = IgnoreList(quant, lambda name: None, {})
    projections, kept = [], 0
    for p in desc.projections:
        fp8 = tuple(name for name in p.names if not ignore.keeps(name, p.shards))
        kept += (p.count - len(fp8)) * p.out_features * p.in_features
        if fp8:
            projections.append(dataclasses.replace(p, names=fp8))
    scales = sum(p.count * quant.projection_scale_bytes(p.out_features, p.in_features, p.parts) for p in projections)
    fp8_layers = [name for name in desc.expert_layers if not ignore.keeps_experts(name, desc.num_experts)]
    expert, expert_scales, group_k, kept_layers = model_dtype.itemsize, 0, 0, ()
    if fp8_layers and desc.expert_params:
        expert = 1
        expert_scales = quant.expert_scale_bytes(desc.hidden_size, desc.expert_params // (3 * desc.hidden_size))
        group_k = quant.experts[1] if quant.experts else desc.hidden_size
        kept_layers = tuple(name for name in desc.expert_layers if name not in fp8_layers)
    return dataclasses.replace(
        desc, weight_bytes_per_param=1, dense_scale_bytes=scales, embed_bytes_per_param=model_dtype.itemsize,
        model_dtype_params=desc.model_dtype_params + kept, projections=tuple(projections),
        expert_bytes_per_param=expert, expert_scale_bytes=expert_scales, expert_fp8_group_k=group_k,
        kept_expert_layers=kept_layers,
    )
