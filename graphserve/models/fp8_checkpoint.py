"""Write an FP8 checkpoint from an unquantized Hugging Face folder, in the layout the shipped FP8
checkpoints use, so that loading them is tested against checkpoints we can make at any size.

Projection weights (``*_proj.weight``, DeepSeek's ``kv_a_proj_with_mqa.weight`` and Mixtral's
``experts.N.w1/w2/w3.weight``) become fp8 e4m3 ``*.weight`` plus fp32 scales:
``*.weight_scale_inv`` [ceil(N/bn), ceil(K/bk)] for ``block=(bn, bk)`` (DeepSeek-V3, Qwen3-FP8), or
``*.weight_scale`` [N] per channel, with ``*.input_scale`` (amax / 448 of calibration activations)
when ``input_scales`` are given (static activations). Embeddings, lm_head, norms, biases and router
gates are copied unchanged; config.json gains the matching ``quantization_config``. DeepSeek's
``kv_b_proj`` is written in fp8 with its scales as DeepSeek-V3's FP8 checkpoints ship it (graphserve
dequantizes it at load), or in the source dtype when named in ``unquantized``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from graphserve.kernels.fp8_quant import FP8_MAX, quantize_weight_blocks, quantize_weight_channels
from graphserve.layers.quant.config import ROUTER_GATES
from graphserve.models.weights import iter_safetensors, safetensors_files

_MIXTRAL_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")  # Mixtral names its experts' projections w1/w2/w3


def is_projection(name: str, unquantized: tuple[str, ...] = ()) -> bool:
    """Whether ``name`` is a projection weight the checkpoint stores in fp8 (``unquantized``: more module-name
    suffixes kept in the source dtype besides the router gates)."""
    module = name.removesuffix(".weight")
    named = name.endswith(("_proj.weight", "_proj_with_mqa.weight")) or _MIXTRAL_EXPERT.search(name) is not None
    return named and not module.endswith(ROUTER_GATES + unquantized)


def quantize_checkpoint(src: Path, dst: Path, block: tuple[int, int] | None = (128, 128),
                        input_amax: Mapping[str, float] | None = None, unquantized: tuple[str, ...] = ()) -> None:
    """``src`` (an unquantized HF folder) -> ``dst`` with FP8 projections; see the module docstring.

    ``input_amax``: per projection module name, the largest |activation| it sees; given, the
    checkpoint is per-channel with static activation scales (``block`` must be None).
    ``unquantized``: module-name suffixes written in the source dtype, e.g. ``(".kv_b_proj",)`` for the
    DeepSeek checkpoints that keep it so.
    """
    if input_amax is not None and block is not None:
        raise ValueError("static activation scales go with per-channel weights: pass block=None")
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iter_safetensors(safetensors_files(src)):
        if not is_projection(name, unquantized):
            tensors[name] = tensor.contiguous()
            continue
        module = name.removesuffix(".weight")
        if block is not None:
            tensors[name], tensors[f"{module}.weight_scale_inv"] = quantize_weight_blocks(tensor, *block)
        else:
            tensors[name], tensors[f"{module}.weight_scale"] = quantize_weight_channels(tensor)
        if input_amax is not None:
            tensors[f"{module}.input_scale"] = torch.tensor(input_amax[module] / FP8_MAX, dtype=torch.float32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3",
             "activation_scheme": "static" if input_amax is not None else "dynamic"}
    if block is not None:
        quant["weight_block_size"] = list(block)
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(extra, dst / extra.name)
