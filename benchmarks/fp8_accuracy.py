"""Where an FP8 model's logits part from the bf16 model's: the rounding of the weights, or the FP8 kernels.

For each dummy model, three sets of logits over the same 4 x 256 tokens (benchmarks/fp8.reference_logits):
``bf16`` (the model in its dtype), ``fp8`` (``--quantization fp8``: the same seed's weights quantized at load,
run by the FP8 kernels) and ``rounded`` (the fp8 model's weights dequantized in place into the model dtype, so
the bf16 kernels run exactly the weights the FP8 kernels read). Three comparisons, each top-1 agreement and mean
KL over every position: bf16 vs rounded (the weights' rounding alone), rounded vs fp8 (the FP8 kernels alone:
activation quantization where a path takes it, and accumulation order) and bf16 vs fp8 (both, the figure
benchmarks/fp8.py reports). A dummy model's weights are random, so its logits need not be as robust to
rounding as a trained model's: the split says which part of a low agreement the kernels own.

Run: python3 -m benchmarks.fp8_accuracy [--models dummy:llama3-8b dummy:qwen3-30b-a3b dummy:mixtral-8x7b]
(writes benchmarks/results/fp8_accuracy.json)
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from benchmarks.common import print_table, write_result
from benchmarks.decode_setup import release_gpu_memory
from benchmarks.fp8 import agreement, reference_logits
from graphserve.config import EngineConfig
from graphserve.layers.linear import Linear
from graphserve.layers.moe import FusedMoE
from graphserve.models.loader import load_model

COLS = ["model", "comparison", "top1_agreement", "mean_kl", "rows"]


@torch.no_grad()
def dequantize_in_place(model: nn.Module, dtype: torch.dtype) -> int:
    """Every FP8 projection and expert stack of ``model`` replaced by its dequantized weight in ``dtype``, one
    module at a time (the fp8 copy freed as its replacement lands), and run from then on by the unquantized
    path. Returns how many modules changed."""
    changed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if isinstance(module, Linear):
            weight = method.dequantized_weight(module, dtype)
            delattr(module, method.scale_name)
            module.weight = nn.Parameter(weight, requires_grad=False)
        elif isinstance(module, FusedMoE):
            w13, w2 = method.dequantized(module, dtype)
            for name in ("w13_weight", "w2_weight"):
                delattr(module, method.scale_name(name))
            module.w13_weight = nn.Parameter(w13, requires_grad=False)
            module.w2_weight = nn.Parameter(w2, requires_grad=False)
        else:
            raise TypeError(f"{type(module).__name__} carries a quant_method this function cannot undo")
        module.quant_method = None
        changed += 1
    return changed


def model_logits(name: str, quantization: str, rounded: bool = False) -> torch.Tensor:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = EngineConfig(model=name, device=device.type, quantization=quantization, max_model_len=2048)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    if rounded and dequantize_in_place(model, info.dtype) == 0:
        raise RuntimeError(f"{name} --quantization {quantization} has no quantized module to dequantize")
    kv_caches = info.kv.allocate(4 * 256 // cfg.block_size + 8, cfg.block_size, device, fill="random")
    with torch.inference_mode():
        logits = reference_logits(model, kv_caches)
    del model, loaded, kv_caches
    release_gpu_memory()
    return logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["dummy:llama3-8b", "dummy:qwen3-30b-a3b", "dummy:mixtral-8x7b"])
    args = p.parse_args()
    rows = []
    for name in args.models:
        bf16 = model_logits(name, "none")
        fp8 = model_logits(name, "fp8")
        rounded = model_logits(name, "fp8", rounded=True)
        for comparison, ref, test in (("bf16 vs rounded (weights' rounding)", bf16, rounded),
                                      ("rounded vs fp8 (FP8 kernels)", rounded, fp8),
                                      ("bf16 vs fp8 (both)", bf16, fp8)):  # fmt: skip
            rows.append({"model": name, "comparison": comparison, **agreement(ref, test)})
        print_table(rows[-3:], COLS)
    print_table(rows, COLS)
    write_result("fp8_accuracy", {"tokens": "4 x 256", "rows": rows})


if __name__ == "__main__":
    main()
