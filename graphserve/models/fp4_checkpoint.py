"""Write an NVFP4 checkpoint from an unquantized Hugging Face folder in the layout ModelOpt exports, so that loading
them is tested against checkpoints we can make at any size.

Projection weights (``*_proj.weight``, Mixtral's ``experts.N.w1/w2/w3.weight``; router gates and the modules the
``exclude`` globs name apart) become ``weight`` uint8 [N, K/2], ``weight_scale`` float8_e4m3fn [N, K/16],
``weight_scale_2`` float32 [] (kernels/fp4_reference.nvfp4_quantize) and ``input_scale`` float32 [] (amax / (448 *
6) of the activations: ``input_amax``, one value for every projection). The quantization goes to config.json's
``quantization_config`` or, as ModelOpt also writes it, to ``hf_quant_config.json``.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from graphserve.kernels.fp4_reference import E2M1_MAX, E4M3_MAX, nvfp4_quantize
from graphserve.models.fp8_checkpoint import is_projection
from graphserve.models.weights import iter_safetensors, safetensors_files


def excluded(module: str, exclude: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(module, g) or fnmatch.fnmatchcase(module, g + ".*") for g in exclude)


def quantize_checkpoint_nvfp4(src: Path, dst: Path, exclude: tuple[str, ...] = ("lm_head",),
                              in_file: bool = False, input_amax: float = 4.0) -> None:
    """``src`` (an unquantized HF folder) -> ``dst`` with NVFP4 projections; see the module docstring."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iter_safetensors(safetensors_files(src)):
        module = name.removesuffix(".weight")
        if not is_projection(name) or excluded(module, exclude):
            tensors[name] = tensor.contiguous()
            continue
        packed, scale, global_scale = nvfp4_quantize(tensor)
        tensors[name], tensors[f"{module}.weight_scale"] = packed, scale
        tensors[f"{module}.weight_scale_2"] = global_scale
        tensors[f"{module}.input_scale"] = torch.tensor(input_amax / (E4M3_MAX * E2M1_MAX), dtype=torch.float32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    producer = {"name": "modelopt", "version": "0.29.0"}
    if in_file:
        quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": list(exclude)}
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": quant}, indent=2))
    else:
        config["quantization_config"] = {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "producer": producer, "ignore": list(exclude),
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16},
                                          "input_activations": {"num_bits": 4, "type": "float", "group_size": 16},
                                          "targets": ["Linear"]}},
        }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(extra, dst / extra.name)
