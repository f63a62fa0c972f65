"""NVFP4 checkpoint weights of layers that run in the model dtype, dequantized as they load: the FP4 counterpart of
layers/quant/dequant_at_load.py (multi-head latent attention reads ``kv_b_proj``'s weight directly, never through
a matmul of the layer: config.DEQUANTIZED_AT_LOAD).

A module's ``weight`` (uint8), ``weight_scale`` (e4m3) and ``weight_scale_2`` (its global) arrive in any order, in
any file: each is held until the three are in, and only these modules' tensors are held. The fp32 product goes to
the layer whole, as an unquantized weight would. Its ``input_scale`` is dropped (its input is never quantized). A
weight stored in a float dtype (a module the checkpoint excludes) passes unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from graphserve.errors import ModelLoadError
from graphserve.kernels.fp4_reference import nvfp4_dequantize
from graphserve.layers.quant.fp4 import check_block_scales, check_global_scale

_PARTS = ("weight", "weight_scale", "weight_scale_2")


def dequantize_fp4_at_load(weights: Iterable[tuple[str, torch.Tensor]],
                           modules: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every NVFP4 ``<m>.weight`` of a module ``m`` ending with one of ``modules`` (and its scales)
    replaced by one fp32 ``<m>.weight``; refused naming the tensor: a missing part, a scale of the wrong dtype or
    shape, a global that is not finite and > 0."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if not module.endswith(modules) or leaf not in (*_PARTS, "input_scale"):
            yield name, tensor
            continue
        if leaf == "input_scale":
            continue
        if leaf == "weight" and tensor.dtype != torch.uint8:
            yield name, tensor
            continue
        try:
            if leaf == "weight_scale":
                check_block_scales(tensor, "nvfp4")
            elif leaf == "weight_scale_2":
                if tensor.numel() != 1:
                    raise ValueError(f"shape {tuple(tensor.shape)}, expected one value")
                check_global_scale(tensor)
        except ValueError as e:
            raise ModelLoadError(f"checkpoint tensor '{name}': {e}", param="model") from e
        parts = held.setdefault(module, {})
        parts[leaf] = tensor
        if len(parts) == len(_PARTS):
            del held[module]
            try:
                w = nvfp4_dequantize(parts["weight"], parts["weight_scale"], parts["weight_scale_2"].reshape(()))
            except ValueError as e:
                raise ModelLoadError(f"checkpoint tensors '{module}.weight' / '{module}.weight_scale': {e}",
                                     param="model") from e
            yield f"{module}.weight", w
    for module, parts in held.items():
        missing = [f"'{module}.{p}'" for p in _PARTS if p not in parts]
        raise ModelLoadError(f"checkpoint has {', '.join(repr(f'{module}.{p}') for p in parts)} but not "
                             f"{' and '.join(missing)}: an NVFP4 weight comes with its weight_scale and weight_scale_2",
                             param="model")
