"""FP4 weights (kernels/fp4_reference.py has the layout): which checkpoints graphserve reads, ``--quantization nvfp4``
/ ``mxfp4``, which modules stay in the model dtype, and the bytes they hold.

Accepted checkpoints:
- NVFP4 as ModelOpt exports it: config.json ``quantization_config`` with ``quant_method: "modelopt"`` and
  ``quant_algo: "NVFP4"``, or ``hf_quant_config.json`` ``{"quantization": {"quant_algo": "NVFP4", "group_size": 16,
  "exclude_modules": [...]}}``. Per projection ``weight`` uint8 [N, K/2], ``weight_scale`` float8_e4m3fn [N, K/16],
  ``weight_scale_2`` fp32 (the global scale), ``input_scale`` fp32 (held and checked; graphserve's FP4 path keeps
  activations in the model dtype). ``exclude_modules`` / ``ignore`` are ModelOpt's globs (``model.layers.*.mlp.gate``)
  over checkpoint module names, kept in the model dtype.
- MXFP4 routed experts as gpt-oss ships them (``quant_method: "mxfp4"``, ``modules_to_not_convert``): only the
  experts are FP4 (layers/quant/fp4_moe.py loads their ``*_blocks`` / ``*_scales``); every dense projection stays in
  the model dtype.
Anything else (another ``quant_algo``, a group size other than 16 / 32, a KV-cache scheme, an unknown key) is a
ModelLoadError naming the field: a model is never run in bf16 while its config says it is quantized.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphserve.errors import ModelLoadError
from graphserve.kernels.fp4_reference import FP4_GROUPS
from graphserve.layers.quant.ignore_list import IgnoreList

HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's own file beside config.json
# keys ModelOpt writes that change nothing here (who made the checkpoint; config_groups restates algo and group size,
# checked below)
_MODELOPT_KEYS = {"quant_method", "quant_algo", "group_size", "exclude_modules", "ignore", "producer", "config_groups",
                  "kv_cache_quant_algo", "kv_cache_scheme"}
_MXFP4_KEYS = {"quant_method", "modules_to_not_convert"}
# the CUDA kernels widen E2M1 into bf16 registers: sm80 (A100) and later
MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Fp4Config:
    fmt: str  # "nvfp4" (e4m3 scales per 16 and a global scale) or "mxfp4" (E8M0 scales per 32)
    serialized: bool = True  # the checkpoint stores FP4 weights (else: model-dtype weights quantized at load)
    ignored: tuple[str, ...] = ()  # checkpoint module globs kept in the model dtype
    ignored_field: str = "quantization_config.exclude_modules"  # where ``ignored`` came from, for errors
    dense: bool = True  # dense projections in FP4 too (gpt-oss's MXFP4 checkpoints quantize only the experts)
    activation_scheme: str = "dynamic"  # activations stay in the model dtype (read by code shared with FP8)

    @property
    def group(self) -> int:
        return FP4_GROUPS[self.fmt]

    @property
    def global_scale(self) -> bool:
        return self.fmt == "nvfp4"

    @property
    def name(self) -> str:
        where = "dense projections and routed experts" if self.dense else "routed experts"
        return f"{self.fmt} ({where}, groups of {self.group}, activations in the model dtype)"

    def projection_bytes(self, out_features: int, in_features: int, parts: int = 1) -> int:
        """One FP4 projection [N, K] fusing ``parts`` checkpoint modules: packed codes (K/2 bytes a row), one 1-byte
        scale per group, and with NVFP4 a float32 global scale per part (and from a checkpoint its input_scale)."""
        globals_ = (2 if self.serialized else 1) * parts if self.global_scale else 0
        return out_features * (in_features // 2 + in_features // self.group) + 4 * globals_

    def expert_bytes(self, hidden: int, intermediate: int) -> int:
        """One routed expert: gate and up [I, H] (each with its own global scale) and down [H, I]."""
        return 2 * self.projection_bytes(intermediate, hidden) + self.projection_bytes(hidden, intermediate)


def modelopt_file_config(folder: Path) -> dict | None:
    """``hf_quant_config.json`` as a quantization_config (``quant_method: "modelopt"``), None when absent."""
    path = folder / HF_QUANT_CONFIG
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    inner = raw.get("quantization") if isinstance(raw, Mapping) else None
    if not isinstance(inner, Mapping):
        raise ModelLoadError(f"{HF_QUANT_CONFIG} in {folder} has no 'quantization' object", param="model")
    return {"quant_method": "modelopt", "_source": HF_QUANT_CONFIG, **inner}


def parse_fp4_config(raw: Mapping[str, Any]) -> Fp4Config:
    """A ``modelopt`` (NVFP4) or ``mxfp4`` quantization_config; anything graphserve cannot run exactly is refused."""
    source = raw.get("_source")
    where = f"{source} quantization" if source else "quantization_config"
    raw = {k: v for k, v in raw.items() if k != "_source"}
    method = raw.get("quant_method")
    if method == "mxfp4":
        unknown = sorted(set(raw) - _MXFP4_KEYS)
        if unknown:
            raise ModelLoadError(f"{where}.{unknown[0]}={raw[unknown[0]]!r} is not supported: an mxfp4 config may "
                                 f"name {', '.join(sorted(_MXFP4_KEYS))}", param="model")
        ignored = _globs(raw, "modules_to_not_convert", where)
        return Fp4Config("mxfp4", ignored=ignored, ignored_field=f"{where}.modules_to_not_convert", dense=False)
    unknown = sorted(set(raw) - _MODELOPT_KEYS)
    if unknown:
        raise ModelLoadError(f"{where}.{unknown[0]}={raw[unknown[0]]!r} is not supported: a modelopt config may name "
                             f"{', '.join(sorted(_MODELOPT_KEYS))}", param="model")
    algo = raw.get("quant_algo")
    if algo != "NVFP4":
        raise ModelLoadError(f"{where}.quant_algo={algo!r} is not supported: graphserve loads ModelOpt's 'NVFP4' "
                             "(and quant_method 'fp8' checkpoints)", param="model")
    for key in ("kv_cache_quant_algo", "kv_cache_scheme"):
        if raw.get(key) is not None:
            raise ModelLoadError(f"{where}.{key}={raw[key]!r} is not supported: graphserve's fp8 KV cache "
                                 "(--kv-cache-dtype fp8_e4m3) is unscaled; expected null", param="model")
    groups = [(f"{where}.group_size", raw.get("group_size"))]
    for name, group in (raw.get("config_groups") or {}).items():
        for part in ("weights", "input_activations"):
            spec = group.get(part) if isinstance(group, Mapping) else None
            if isinstance(spec, Mapping) and "group_size" in spec:
                groups.append((f"{where}.config_groups.{name}.{part}.group_size", spec["group_size"]))
    for field, group in groups:
        if group is not None and (type(group) is not int or group != 16):
            raise ModelLoadError(f"{field}={group!r} is not supported: NVFP4 scales groups of 16", param="model")
    lists = [key for key in ("exclude_modules", "ignore") if raw.get(key) is not None]
    ignored = tuple(dict.fromkeys(g for key in lists for g in _globs(raw, key, where)))
    field = " / ".join(f"{where}.{key}" for key in lists) or f"{where}.exclude_modules"
    return Fp4Config("nvfp4", ignored=ignored, ignored_field=field)


def _globs(raw: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = raw.get(key) or []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ModelLoadError(f"{where}.{key}={value!r} is invalid: expected a list of module names or globs "
                             '(strings), e.g. ["lm_head", "model.layers.*.mlp.gate"]', param="model")
    return tuple(value)


def online_fp4_config(quantization: str) -> Fp4Config:
    """``--quantization nvfp4`` / ``mxfp4``: dense projections and routed experts quantized at load."""
    return Fp4Config(quantization, serialized=False)


class GlobIgnoreList(IgnoreList):
    """IgnoreList over ModelOpt's globs: an entry (through the family's names, ``*`` kept) names a module when it
    matches the module's name, a module above it, or its last dotted parts."""

    FORMAT = "FP4"

    def _names_whole(self, name: str) -> bool:
        return any(shard is None and _glob_names(module, name) for module, shard, _ in self.entries)

    def _listed_parts(self, name: str) -> dict[Any, str]:
        return {shard: entry for module, shard, entry in self.entries
                if shard is not None and (fnmatch.fnmatchcase(name, module) or fnmatch.fnmatchcase(name, "*." + module))}


def _glob_names(entry: str, name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in (entry, entry + ".*", "*." + entry))


def fp4_ignore_list(config: Fp4Config, model: Any) -> GlobIgnoreList:
    return GlobIgnoreList(config, model.map_weight_name, model.stacked_params)


def fp4_description(desc: Any, quant: Fp4Config, model_dtype: torch.dtype, ignore: IgnoreList | None) -> Any:
    """``desc`` as the loader holds it under ``quant``: each FP4 projection and routed-expert layer at its exact
    bytes (``Fp4Config.projection_bytes``), the kept ones (``ignore``; MXFP4's dense projections) in the model
    dtype, embedding and lm_head in the model dtype."""
    if ignore is None:
        if quant.ignored:
            raise ValueError(f"{quant.ignored_field} names modules kept in the model dtype: pricing them needs the "
                             "family's names (GlobIgnoreList)")
        ignore = GlobIgnoreList(quant, lambda name: None, {})
    projections, kept, dense_bytes = [], 0, 0
    for p in desc.projections:
        fp4 = tuple(name for name in p.names if quant.dense and not ignore.keeps(name, p.shards))
        kept += (p.count - len(fp4)) * p.out_features * p.in_features
        if fp4:
            projections.append(dataclasses.replace(p, names=fp4))
            dense_bytes += len(fp4) * quant.projection_bytes(p.out_features, p.in_features, p.parts)
    fp4_layers = [name for name in desc.expert_layers if not ignore.keeps_experts(name, desc.num_experts)]
    expert_bpp, expert_scales, kept_layers = model_dtype.itemsize, 0, ()
    if fp4_layers and desc.expert_params:
        hidden = desc.hidden_size
        inter = desc.expert_params // (3 * hidden)
        expert_bpp = 0.5
        expert_scales = quant.expert_bytes(hidden, inter) - desc.expert_params // 2
        kept_layers = tuple(name for name in desc.expert_layers if name not in fp4_layers)
    fp4_params = sum(p.params for p in projections)
    return dataclasses.replace(
        desc, weight_bytes_per_param=0.5, dense_scale_bytes=dense_bytes - fp4_params // 2,
        embed_bytes_per_param=model_dtype.itemsize, model_dtype_params=desc.model_dtype_params + kept,
        projections=tuple(projections), expert_bytes_per_param=expert_bpp, expert_scale_bytes=expert_scales,
        expert_fp8_group_k=0, kept_expert_layers=kept_layers,
    )


def cuda_card(device: torch.device) -> tuple[str, tuple[int, int]]:
    return torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)


def check_fp4_device(quant: Fp4Config, device: torch.device) -> None:
    """Refuse at start-up, naming the card, a CUDA device that cannot run FP4 weights: one older than sm80 (the
    kernels widen E2M1 to bf16), or a build without the FP4 kernels. CPU runs the references."""
    if device.type != "cuda":
        return
    name, capability = cuda_card(device)
    if tuple(capability) < MIN_CAPABILITY:
        raise ModelLoadError(f"{quant.name} weights need a CUDA card of compute capability >= "
                             f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}; {name} has {capability[0]}.{capability[1]}: "
                             "run on a newer card, or on CPU (--device cpu)", param="model")
    try:
        import graphserve.kernels.fp4_gemm  # noqa: F401
        import graphserve.kernels.fp4_moe  # noqa: F401
    except ImportError as e:
        raise ModelLoadError(f"{quant.name} weights on {name}: this build has no FP4 kernels "
                             f"(graphserve.kernels.fp4_gemm / fp4_moe: {e}); run on CPU", param="model") from e
