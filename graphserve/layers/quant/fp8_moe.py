"""FP8 routed experts: the quantization method a ``FusedMoE`` (layers/moe.py) delegates its stored
expert weights, their loading and their scales to.

Stored per layer: ``w13_weight`` fp8 e4m3 [E, 2I, H] (gate rows, then up rows), ``w2_weight`` fp8
[E, H, I], and fp32 scales (``x ~= q * scale``):
- block (bn, bk), as Qwen3-30B-A3B-FP8 and DeepSeek-V3 ship ``experts.N.gate_proj.weight_scale_inv``:
  ``w13_weight_scale_inv`` [E, 2 * ceil(I / bn), ceil(H / bk)] (gate's row blocks, then up's: the
  checkpoint blocks the two projections apart) and ``w2_weight_scale_inv`` [E, ceil(H / bn), ceil(I / bk)];
- per channel (``experts.N.gate_proj.weight_scale``, one per row; a per-tensor scale is broadcast to
  its rows, which is exact): ``w13_weight_scale`` [E, 2I, 1], ``w2_weight_scale`` [E, H, 1].

From an FP8 checkpoint the scales are Parameters the checkpoint must fill (a missing one is refused
by the loader by name); quantized at load (``--quantization``) they are buffers the weights' load
fills. The kernels run W8A16 (the small-batch path) or W8A8 (the grouped GEMM; kernels/moe_fused.py), which
quantizes activations per token group, or, with ``activation_scheme: static`` (per-channel or per-tensor
weights, as Mixtral-8x7B-FP8 ships them), with the checkpoint's ``experts.N.*.input_scale``: held per expert
and part (``w13_input_scale`` [E, 2], gate's then up's; ``w2_input_scale`` [E, 1]), and applied as the largest of
the layer's (``*_input_scale_max``, kept as the scales load), so no expert's activations clip. Static scales
with block-scaled weights are refused. The CPU path dequantizes the weights and leaves the activations
unquantized (kernels/moe_fp8_reference.py), as the dense layers' CPU path does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_SCALE
from graphserve.kernels.moe_fp8_reference import dequantize_experts
from graphserve.layers.quant.attach import attach_to_experts, local_expert
from graphserve.layers.quant.config import Fp8Config, IgnoreList
from graphserve.layers.quant.fp8 import add_input_scales, check_scales, record_input_scale

if TYPE_CHECKING:
    from graphserve.layers.moe import FusedMoE
    from graphserve.models.base import CausalLM

WEIGHTS = ("w13_weight", "w2_weight")


def quantize_stack(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [E, N, K] -> (fp8 [E, N, K], fp32 scales [E, ceil(N/bn), ceil(K/bk)] or [E, N, 1] per channel),
    every expert as fp8_quant.quantize_weight_blocks / quantize_weight_channels would, in one pass."""
    e, n, k = w.shape
    if block is None:
        scale = (w.float().abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    tiles = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).view(e, nb, bn, kb, bk)
    scale = (tiles.abs().amax(dim=(2, 4)) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (tiles / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(e, nb * bn, kb * bk)
    return q[:, :n, :k].to(FP8_DTYPE), scale


INPUT_SCALES = ("w13_input_scale", "w2_input_scale")  # static activation scales, per expert and part


class Fp8MoEMethod:
    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        self.block = config.experts
        self.static = config.activation_scheme == "static"
        if self.static and self.block:
            raise ValueError(f"activation_scheme='static' with weight_block_size={list(self.block)} is not supported "
                             "for routed experts: block-scaled experts quantize activations per token group "
                             "(activation_scheme 'dynamic'); static scales go with per-channel or per-tensor weights")
        self.act_dtype: torch.dtype | None = None  # the model dtype, read from the first layer built

    def scale_name(self, weight: str) -> str:
        return f"{weight}_scale_inv" if self.block else f"{weight}_scale"

    def _scale_rows(self, rows: int) -> int:
        return -(-rows // self.block[0]) if self.block else rows

    def _scale_cols(self, k: int) -> int:
        return -(-k // self.block[1]) if self.block else 1

    # ---- construction -------------------------------------------------------------------------
    def create_weights(self, layer: FusedMoE) -> None:
        """Replace the layer's model-dtype expert stacks by fp8 storage and their scales (same device)."""
        e, h, i = layer.num_local_experts, layer.hidden_size, layer.intermediate_local
        device = layer.w13_weight.device
        self.act_dtype = layer.w13_weight.dtype  # the activations keep the model dtype
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h, dtype=FP8_DTYPE, device=device), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, i, dtype=FP8_DTYPE, device=device), requires_grad=False)
        shapes = ((e, 2 * self._scale_rows(i), self._scale_cols(h)), (e, self._scale_rows(h), self._scale_cols(i)))
        for weight, shape in zip(WEIGHTS, shapes):
            scale = torch.empty(shape, dtype=torch.float32, device=device)
            if self.config.serialized:
                layer.register_parameter(self.scale_name(weight), nn.Parameter(scale, requires_grad=False))
            else:
                layer.register_buffer(self.scale_name(weight), scale)
        if self.static:  # only a checkpoint has static scales (--quantization quantizes activations per token)
            add_input_scales(layer, {"w13_input_scale": (e, 2), "w2_input_scale": (e, 1)}, device)
        layer.quant_method = self

    def scales(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(layer, self.scale_name("w13_weight")), getattr(layer, self.scale_name("w2_weight"))

    # ---- loading --------------------------------------------------------------------------------
    def _part(self, layer: FusedMoE, part: str) -> tuple[str, slice, slice, int]:
        """(stacked weight, its rows, its scale rows, K) that checkpoint part w1/w3/w2 fills."""
        h, i = layer.hidden_size, layer.intermediate_local
        if part == "w2":
            return "w2_weight", slice(0, h), slice(0, self._scale_rows(h)), i
        first = part == "w3"
        rows, scale_rows = slice(i * first, i * (first + 1)), self._scale_rows(i)
        return "w13_weight", rows, slice(scale_rows * first, scale_rows * (first + 1)), h

    def load_weight(self, layer: FusedMoE, param_name: str, tensor: torch.Tensor, shard: tuple[int, str]) -> bool:
        """One expert's checkpoint weight or scale into its slice; False when another rank holds the expert."""
        expert, part = shard
        local = local_expert(layer, param_name, shard)  # w13_* or w2_*: weight, scale, input scale
        if local is None:
            return False
        weight, rows, scale_rows, k = self._part(layer, part)
        if self.static and param_name in INPUT_SCALES:
            if tensor.numel() != 1:
                raise ValueError(f"input_scale has shape {tuple(tensor.shape)}, expected one value (per tensor)")
            check_scales(tensor)
            record_input_scale(layer, param_name, (local, 1 if part == "w3" else 0), tensor)
            return True
        n = rows.stop - rows.start
        piece = layer.rank_slice(part)  # this rank's rows of w1/w3 or columns of w2 (None: whole)
        block = self.block[piece.dim] if self.block and piece is not None else None  # scale tile along the cut
        if param_name == weight:
            full = (n, k) if piece is None else (n * layer.tp_size, k) if piece.dim == 0 else (n, k * layer.tp_size)
            if tuple(tensor.shape) != full:
                raise ValueError(f"shape {tuple(tensor.shape)}, expected {full} (expert {expert} {part})")
            target = getattr(layer, weight).data[local, rows]
            if self.config.serialized:
                tensor = piece.take_fp8(tensor, block) if piece is not None else tensor
                if tensor.dtype != FP8_DTYPE:
                    raise ValueError(f"dtype {tensor.dtype}, expected {FP8_DTYPE} (the config's quant_method is fp8)")
                target.copy_(tensor)
                return True

            def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                q, s = quantize_stack(w.to(target.device)[None], self.block)
                return q[0], s[0]

            q, s = piece.quantized(tensor, quantize, bool(self.block)) if piece is not None else quantize(tensor)
            target.copy_(q)
            getattr(layer, self.scale_name(weight)).data[local, scale_rows].copy_(s)
            return True
        if param_name != self.scale_name(weight):
            raise ValueError(f"an fp8 expert layer has no tensor {param_name!r} (its scales are "
                             f"{self.scale_name(weight)!r})")
        check_scales(tensor)
        if piece is not None:
            tensor = piece.take_scales(tensor, block)
        self._load_scale(getattr(layer, param_name).data[local, scale_rows], tensor, n, k)
        return True

    def _load_scale(self, target: torch.Tensor, loaded: torch.Tensor, n: int, k: int) -> None:
        if self.block:
            if tuple(loaded.shape) != tuple(target.shape):
                raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(target.shape)} (one scale per "
                                 f"{self.block[0]}x{self.block[1]} block of a [{n}, {k}] weight)")
            target.copy_(loaded)
        elif loaded.numel() == 1:  # per tensor: every row shares it
            target.fill_(loaded.reshape(()).item())
        elif loaded.numel() == n and loaded.dim() <= 2 and loaded.shape[0] == n:
            target.copy_(loaded.reshape(n, 1))
        else:
            raise ValueError(f"shape {tuple(loaded.shape)}, expected one scale (per tensor) or {n} (per channel)")

    @torch.no_grad()
    def init_random(self, layer: FusedMoE, weight: str, dtype: torch.dtype, generator: torch.Generator) -> None:
        """dummy: models: normal(0, 0.02) in ``dtype`` from the generator's position (the unquantized
        model's draw), quantized as a checkpoint's experts would be."""
        param = getattr(layer, weight)
        w = torch.empty(param.shape, dtype=dtype, device=param.device).normal_(0.0, 0.02, generator=generator)
        scale = getattr(layer, self.scale_name(weight))
        if weight == "w2_weight":
            q, s = quantize_stack(w, self.block)
            param.copy_(q)
            scale.copy_(s)
            return
        i, half = layer.intermediate_local, scale.shape[1] // 2
        for rows, scale_rows in ((slice(0, i), slice(0, half)), (slice(i, 2 * i), slice(half, 2 * half))):
            q, s = quantize_stack(w[:, rows], self.block)
            param[:, rows].copy_(q)
            scale[:, scale_rows].copy_(s)

    # ---- forward --------------------------------------------------------------------------------
    def kernel_args(self, layer: FusedMoE) -> dict:
        """What kernels/moe_fused.fused_experts takes beside the fp8 weights."""
        w13_scale, w2_scale = self.scales(layer)
        args = {"w13_scale": w13_scale, "w2_scale": w2_scale, "weight_block": self.block}
        if self.static:
            args["input_scales"] = (layer.w13_input_scale_max, layer.w2_input_scale_max)
        return args

    def dequantized(self, layer: FusedMoE, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in ``dtype``: the CPU path's weights."""
        w13_scale, w2_scale = self.scales(layer)
        return (dequantize_experts(layer.w13_weight, w13_scale, self.block, parts=2).to(dtype),
                dequantize_experts(layer.w2_weight, w2_scale, self.block).to(dtype))  # fmt: skip


def quantize_experts(model: CausalLM, config: Fp8Config) -> int:
    """Attach an Fp8MoEMethod to every ``FusedMoE`` the config does not keep in the model dtype (``IgnoreList``: the
    layer's experts whole, or every part of each); the number attached."""
    ignore = IgnoreList(config, model.map_weight_name, model.stacked_params)
    return attach_to_experts(model, ignore, lambda: Fp8MoEMethod(config))
