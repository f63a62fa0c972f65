"""FP8 checkpoint weights of layers that run in the model dtype, dequantized as they load.

DeepSeek-V3 / R1's FP8 checkpoints store ``self_attn.kv_b_proj.weight`` in fp8 e4m3 with its
``weight_scale_inv`` block scales, like every other projection; multi-head latent attention reads that
weight through per-head views in batched matmuls (layers/mla.py), never through an FP8 matmul, so the
layer holds it in the model dtype (config.DEQUANTIZED_AT_LOAD). The weight and its scale are separate
tensors that arrive in either order (a sharded checkpoint may put them in different files): the first is
held until the second comes, and only these modules' tensors are ever held. Their product, in fp32, then
goes to the layer whole, as an unquantized weight would, and the layer's copy rounds it once to the
model dtype. A column-parallel layer narrows its rank's rows of the dequantized tensor: a rank's rows
need not start on a scale block (V3's kv_b_proj at tp 16: 2,048 rows a rank, 16 blocks; a tiny model's
heads can split inside a block), so the scales are never sliced.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from graphserve.errors import ModelLoadError
from graphserve.kernels.fp8_quant import FP8_DTYPE, dequantize_blocks
from graphserve.layers.quant.config import Fp8Config
from graphserve.layers.quant.fp8 import check_scales

_SCALES = ("weight_scale_inv", "weight_scale")


def _refuse(message: str) -> ModelLoadError:
    return ModelLoadError(message, param="model")


def _dequantize(module: str, q: torch.Tensor, scale: torch.Tensor, scale_name: str,
                block: tuple[int, int] | None) -> torch.Tensor:
    """``q`` [N, K] fp8 times its scales -> fp32 [N, K]; a scale of the wrong shape is refused naming it."""
    if q.dim() != 2:
        raise _refuse(f"checkpoint tensor '{module}.weight' has shape {tuple(q.shape)}, expected a matrix [N, K]")
    n, k = q.shape
    if block is not None:
        want = (-(-n // block[0]), -(-k // block[1]))
        if tuple(scale.shape) != want:
            raise _refuse(f"checkpoint tensor '{module}.{scale_name}' has shape {tuple(scale.shape)}, expected {want} "
                          f"(one scale per {block[0]}x{block[1]} block of the [{n}, {k}] fp8 weight)")
        return dequantize_blocks(q, scale.float(), *block)
    if scale.numel() == 1:  # per tensor
        return q.float() * scale.float().reshape(())
    if scale.numel() == n and scale.dim() <= 2 and scale.shape[0] == n:  # per channel: [N] or [N, 1]
        return q.float() * scale.float().reshape(n, 1)
    raise _refuse(f"checkpoint tensor '{module}.{scale_name}' has shape {tuple(scale.shape)}, expected one scale "
                  f"(per tensor) or {n} (per channel) for the [{n}, {k}] fp8 weight")


def dequantize_at_load(weights: Iterable[tuple[str, torch.Tensor]], modules: tuple[str, ...],
                       quant: Fp8Config | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every fp8 ``<m>.weight`` of a module ``m`` whose name ends with one of ``modules`` and
    that weight's scale replaced by one fp32 ``<m>.weight``; every other tensor passes through as it comes.

    ``quant``: the checkpoint's quantization_config (None: it has none). Its ``weight_block_size`` picks the
    scale: ``weight_scale_inv`` blocks, else ``weight_scale`` per channel or one per tensor. Such a module's
    ``input_scale`` (static activations) is dropped: its input is never quantized. A weight already in a float
    dtype passes unchanged. Refused, naming the tensor: an fp8 weight without its scale anywhere in the
    checkpoint (or without any quantization_config), a scale without an fp8 weight, a scale of the wrong
    name, dtype or shape, or one that is not finite and positive.
    """
    scale_name = "weight_scale_inv" if quant is not None and quant.block else "weight_scale"
    block = quant.block if quant is not None else None
    held: dict[str, dict[str, torch.Tensor]] = {}  # module -> whichever of weight and scale came first
    plain: dict[str, torch.dtype] = {}  # modules whose weight came unquantized, and its dtype
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if not module.endswith(modules) or leaf not in ("weight", "input_scale", *_SCALES):
            yield name, tensor
            continue
        if leaf == "input_scale":
            continue
        if leaf == "weight" and tensor.dtype != FP8_DTYPE:
            if module in held:
                raise _refuse(f"checkpoint tensor '{module}.{scale_name}' scales '{name}', which is stored in "
                              f"{tensor.dtype}: a scale goes with an {FP8_DTYPE} weight")
            plain[module] = tensor.dtype
            yield name, tensor
            continue
        if leaf == "weight" and quant is None:
            raise _refuse(f"checkpoint tensor '{name}' is {FP8_DTYPE} {tuple(tensor.shape)}, but config.json has no "
                          "quantization_config to say how it is scaled: expected one with quant_method 'fp8'")
        if leaf != "weight":
            if leaf != scale_name:
                layout = "no quantization_config" if quant is None else \
                    f"quantization_config.weight_block_size={list(block) if block else None}"
                raise _refuse(f"checkpoint tensor '{name}' is not this checkpoint's scale: with {layout}, "
                              f"expected '{module}.{scale_name}'")
            try:
                check_scales(tensor)
            except ValueError as e:
                raise _refuse(f"checkpoint tensor '{name}': {e}") from e
            if module in plain:
                raise _refuse(f"checkpoint tensor '{name}' scales '{module}.weight', which is stored in "
                              f"{plain[module]}: a scale goes with an {FP8_DTYPE} weight")
        pair = held.setdefault(module, {})
        pair[leaf] = tensor
        if len(pair) == 2:
            del held[module]
            yield f"{module}.weight", _dequantize(module, pair["weight"], pair[scale_name], scale_name, block)
    for module, pair in held.items():
        if "weight" in pair:
            q = pair["weight"]
            raise _refuse(f"checkpoint tensor '{module}.weight' is {FP8_DTYPE} {tuple(q.shape)} but the checkpoint "
                          f"has no '{module}.{scale_name}': expected its scale beside it")
        raise _refuse(f"checkpoint tensor '{module}.{scale_name}' has no fp8 '{module}.weight' in the checkpoint to "
                      "scale: expected the weight beside it")
