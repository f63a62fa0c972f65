"""What a model's weights are quantized to: read from a checkpoint's ``quantization_config`` or from
``--quantization``, validated once, and refused by name when graphserve cannot run it exactly.

Accepted, ``quant_method: "fp8"`` (e4m3) only:
- ``weight_block_size: [bn, bk]`` with ``activation_scheme: "dynamic"``: the DeepSeek-V3 / Qwen3-FP8
  layout, ``*.weight`` fp8 and ``*.weight_scale_inv`` fp32 ``[ceil(N/bn), ceil(K/bk)]``, activations
  quantized per token in groups of ``bk``;
- no block size: per-tensor or per-channel ``*.weight_scale`` (shape ``[]``/``[1]`` or ``[N]``/``[N, 1]``),
  activations quantized per token ("dynamic") or by the checkpoint's ``*.input_scale`` ("static").

Anything else — another quant_method, an unknown key, another fp8 format — is a ModelLoadError
naming the field: a model is never run in bf16 while its config says it is quantized.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphserve.config import QUANTIZATIONS
from graphserve.errors import ConfigError, ModelLoadError

DEFAULT_BLOCK = (128, 128)  # what DeepSeek-V3 and Qwen3-FP8 ship, and what --quantization fp8 writes
_KNOWN_KEYS = {"quant_method", "weight_block_size", "activation_scheme", "fmt", "ignored_layers",
               "modules_to_not_convert"}
# Router gates choose experts: their logits are small and fp8 rounding flips choices; the shipped
# FP8 checkpoints keep them in bf16, and so does --quantization.
ROUTER_GATES = (".gate", ".shared_expert_gate")
# Multi-head latent attention reads kv_b_proj's weight directly (absorbed into its q and output products),
# never through the layer's matmul, so it runs in the model dtype. The shipped DeepSeek-V3 FP8 checkpoints
# store it in fp8 with its scales all the same: it is dequantized as it loads (layers/quant/dequant_at_load.py).
DEQUANTIZED_AT_LOAD = (".kv_b_proj",)
MODEL_DTYPE_LAYERS = ROUTER_GATES + DEQUANTIZED_AT_LOAD  # never fp8 at run time, whatever the checkpoint stores


@dataclass(frozen=True)
class Fp8Config:
    block: tuple[int, int] | None  # (block_n, block_k) weight scale tiles; None: one scale per channel
    activation_scheme: str = "dynamic"  # "dynamic" (per token (group), each forward) or "static" (input_scale)
    serialized: bool = True  # the checkpoint stores fp8 weights (else: model-dtype weights quantized at load)
    ignored: tuple[str, ...] = ()  # module names kept in the model dtype
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

    def quantizes(self, module_name: str) -> bool:
        if module_name.endswith(MODEL_DTYPE_LAYERS):
            return False
        return not any(module_name == i or module_name.startswith(i + ".") or module_name.endswith("." + i)
                       for i in self.ignored)

    def weight_bytes_per_param(self, in_features: int) -> float:
        """One fp8 byte per weight plus its share of the fp32 scales (block: 4 / (bn·bk); channel: 4 / K)."""
        if self.block:
            return 1.0 + 4.0 / (self.block[0] * self.block[1])
        return 1.0 + 4.0 / in_features

    def expert_bytes_per_param(self, hidden: int, intermediate: int) -> float:
        """A routed expert's gate, up [I, H] and down [H, I] in fp8 with their fp32 scales
        (layers/quant/fp8_moe.py: gate and up blocked apart), per parameter."""
        if self.experts:
            bn, bk = self.experts
            scales = 2 * -(-intermediate // bn) * -(-hidden // bk) + -(-hidden // bn) * -(-intermediate // bk)
        else:
            scales = 2 * intermediate + hidden
        return 1.0 + 4.0 * scales / (3 * hidden * intermediate)


def parse_quantization_config(raw: Mapping[str, Any] | None) -> Fp8Config | None:
    """A checkpoint's ``quantization_config`` (config.json) as an Fp8Config, None when absent."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ModelLoadError(f"quantization_config={raw!r} is not an object", param="model")
    method = raw.get("quant_method")
    if method != "fp8":
        raise ModelLoadError(f"quantization_config.quant_method={method!r} is not supported: graphserve loads "
                             "quant_method 'fp8' checkpoints only", param="model")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise ModelLoadError(f"quantization_config.{unknown[0]}={raw[unknown[0]]!r} is not supported: an fp8 config "
                             f"may name {', '.join(sorted(_KNOWN_KEYS))}", param="model")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"quantization_config.fmt={fmt!r} is not supported: only e4m3", param="model")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(f"quantization_config.activation_scheme={scheme!r} is invalid: choose dynamic or static",
                             param="model")
    block = raw.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 and not b & (b - 1) for b in block)):
            raise ModelLoadError(f"quantization_config.weight_block_size={block!r} is invalid: two powers of two, "
                                 "e.g. [128, 128]", param="model")
        if scheme != "dynamic":
            raise ModelLoadError(f"quantization_config.activation_scheme={scheme!r} with weight_block_size is not "
                                 "supported: block-wise checkpoints quantize activations dynamically", param="model")
        block = (int(block[0]), int(block[1]))
    ignored = tuple(raw.get("ignored_layers") or raw.get("modules_to_not_convert") or ())
    return Fp8Config(block=block, activation_scheme=scheme, serialized=True, ignored=ignored)


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
    raise ConfigError(f"--quantization={quantization!r} is invalid: choose one of {', '.join(QUANTIZATIONS)}",
                      param="quantization")


def resolve_quantization(checkpoint: Fp8Config | None, quantization: str) -> Fp8Config | None:
    """The checkpoint's own quantization wins; ``--quantization`` only applies to unquantized checkpoints."""
    if checkpoint is not None:
        if quantization not in ("none", "fp8"):
            raise ConfigError(f"--quantization={quantization} conflicts with the checkpoint's {checkpoint.name}: "
                              "drop the flag", param="quantization")
        return checkpoint
    return online_config(quantization)


def quantized_description(desc: Any, quant: Fp8Config | None, model_dtype: torch.dtype,
                          experts_quantized: bool = True) -> Any:
    """``desc`` (a ModelDescription) with FP8 bytes for its projections and (unless a model keeps them in
    ``model_dtype``) its routed experts, their scales counted exactly; embedding and lm_head stay in
    the model dtype, as do the dense parameters a family counts as ``model_dtype_params`` (norms, biases, router
    gates, MLA's kv_b_proj)."""
    if quant is None:
        return desc
    # per-channel scales: 4 bytes per output row, 4 / K per parameter; K taken no smaller than any projection's
    # (the activation width bounds the MLP's), so the scales are never over-counted
    per_param = quant.weight_bytes_per_param(max(desc.hidden_size, desc.act_width))
    expert, group_k = float(model_dtype.itemsize), 0
    if experts_quantized and desc.expert_params:
        expert = quant.expert_bytes_per_param(desc.hidden_size, desc.expert_params // (3 * desc.hidden_size))
        group_k = quant.experts[1] if quant.experts else desc.hidden_size
    return dataclasses.replace(
        desc, weight_bytes_per_param=per_param, embed_bytes_per_param=model_dtype.itemsize,
        expert_bytes_per_param=expert, expert_fp8_group_k=group_k,
    )
