"""FP4 routed experts: the quantization method a ``FusedMoE`` (layers/moe.py) delegates its stored expert weights,
their loading and the experts' computation to.

Stored per layer (kernels/fp4_reference.py's layout): ``w13_weight`` uint8 [E, 2I, H/2] (gate rows, then up rows),
``w2_weight`` uint8 [E, H, I/2], group scales ``w13_weight_scale`` [E, 2I, H/G] and ``w2_weight_scale`` [E, H, I/G]
(NVFP4: float8_e4m3fn, G = 16; MXFP4: E8M0 uint8, G = 32) and, NVFP4 only, the global scales
``w13_weight_scale_2`` [E, 2] (gate's, up's) and ``w2_weight_scale_2`` [E, 1], with, from a checkpoint, the
``w13_input_scale`` / ``w2_input_scale`` of the same shapes (held and checked: activations stay in the model dtype).

Two checkpoint layouts load:
- ModelOpt NVFP4, one expert at a time (``experts.N.gate_proj.weight`` and its scales: the loader's (expert, part)
  shards, placed as FP8 experts are);
- gpt-oss MXFP4, whole stacks (``load_gpt_oss``: ``gate_up_proj_blocks`` [E, 2I, H/32, 16], ``gate_up_proj_scales``
  [E, 2I, H/32], ``gate_up_proj_bias`` [E, 2I], ``down_proj_*``), gate/up rows interleaved (2i gate, 2i+1 up) and
  de-interleaved here into [gate; up], which the family calls with each tensor.
Under --tp a rank takes rows of gate/up (any) and columns of down (whole scale groups only: a group two ranks would
share is refused naming the columns); under --ep whole experts. A down bias is held by tp rank 0 only (zeros
elsewhere), so the all-reduced sum adds it once.

The experts: on CUDA kernels/fp4_moe.fp4_fused_experts, elsewhere kernels/fp4_experts_reference.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from graphserve.kernels.fp4_experts_reference import fp4_fused_experts_reference
from graphserve.kernels.moe_reference import expert_counts_reference
from graphserve.layers.quant.attach import attach_to_experts, copy_checked, local_expert
from graphserve.layers.quant.fp4 import (
    SCALE_DTYPES,
    check_block_scales,
    check_global_scale,
    check_rank_groups,
    quantize_fp4,
    take_groups,
)
from graphserve.layers.quant.fp4_config import Fp4Config, GlobIgnoreList

if TYPE_CHECKING:
    from graphserve.layers.moe import FusedMoE
    from graphserve.models.base import CausalLM

INIT_CHUNK_ELEMENTS = 1 << 27  # dummy weights quantized this many elements (a few experts) at a time
WEIGHTS = ("w13_weight", "w2_weight")
GPT_OSS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
           "down_proj_scales", "down_proj_bias")


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with row 2i gate and 2i+1 up -> [E, 2I, ...] with gate rows, then up rows."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


class Fp4MoEMethod:
    def __init__(self, config: Fp4Config) -> None:
        self.config = config
        self.fmt, self.group = config.fmt, config.group
        self.act_dtype: torch.dtype | None = None  # the model dtype, read from the first layer built

    # ---- construction -------------------------------------------------------------------------
    def create_weights(self, layer: FusedMoE) -> None:
        e, h, i = layer.num_local_experts, layer.hidden_size, layer.intermediate_local
        check_rank_groups(layer.rank_slice("w2"), self.group)  # down's K columns on this rank
        for what, k in (("hidden_size", h), ("moe_intermediate_size per rank", i)):
            if k % self.group:
                raise ValueError(f"{what}={k} is not a multiple of the {self.fmt} scale group {self.group}")
        device = layer.w13_weight.device
        self.act_dtype = layer.w13_weight.dtype
        sdt = SCALE_DTYPES[self.fmt]
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h // 2, dtype=torch.uint8, device=device),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, i // 2, dtype=torch.uint8, device=device), requires_grad=False)
        tensors = {"w13_weight_scale": torch.empty(e, 2 * i, h // self.group, dtype=sdt, device=device),
                   "w2_weight_scale": torch.empty(e, h, i // self.group, dtype=sdt, device=device)}
        if self.config.global_scale:
            tensors["w13_weight_scale_2"] = torch.ones(e, 2, dtype=torch.float32, device=device)
            tensors["w2_weight_scale_2"] = torch.ones(e, 1, dtype=torch.float32, device=device)
            if self.config.serialized:
                tensors["w13_input_scale"] = torch.ones(e, 2, dtype=torch.float32, device=device)
                tensors["w2_input_scale"] = torch.ones(e, 1, dtype=torch.float32, device=device)
        for name, t in tensors.items():
            if self.config.serialized:
                layer.register_parameter(name, nn.Parameter(t, requires_grad=False))
            else:
                layer.register_buffer(name, t)
        layer.quant_method = self

    def globals_(self, layer: FusedMoE) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.config.global_scale:
            return None, None
        return layer.w13_weight_scale_2, layer.w2_weight_scale_2

    # ---- loading: one expert's part (ModelOpt) --------------------------------------------------
    def load_weight(self, layer: FusedMoE, param_name: str, tensor: torch.Tensor, shard: tuple[int, str]) -> bool:
        """One expert's checkpoint weight, scale, global or input scale into its place; False when another rank
        holds the expert."""
        expert, part = shard
        local = local_expert(layer, param_name, shard)
        if local is None:
            return False
        stack = "w2_" if part == "w2" else "w13_"
        h, i = layer.hidden_size, layer.intermediate_local
        rows = slice(0, h) if part == "w2" else slice(0, i) if part == "w1" else slice(i, 2 * i)
        piece = layer.rank_slice(part)
        full_n, full_k = (h, i * layer.tp_size) if part == "w2" else (i * layer.tp_size, h)
        leaf = param_name.removeprefix(stack)
        if leaf in ("weight_scale_2", "input_scale") and self.config.global_scale:
            if tensor.numel() != 1:
                raise ValueError(f"shape {tuple(tensor.shape)}, expected one value (expert {expert} {part})")
            check_global_scale(tensor)
            getattr(layer, param_name).data[local, 1 if part == "w3" else 0] = tensor.reshape(()).float()
            return True
        if leaf == "weight" and not self.config.serialized:
            if tuple(tensor.shape) != (full_n, full_k):
                raise ValueError(f"shape {tuple(tensor.shape)}, expected {(full_n, full_k)} (expert {expert} {part})")
            packed, scale, global_ = quantize_fp4(tensor.to(layer.w13_weight.device), self.fmt)
            self._place(layer, stack, local, rows, piece, packed, scale)
            if global_ is not None:
                getattr(layer, f"{stack}weight_scale_2").data[local, 1 if part == "w3" else 0] = global_
            return True
        if leaf == "weight":
            if tensor.dtype != torch.uint8:
                raise ValueError(f"dtype {tensor.dtype}, expected torch.uint8 (two E2M1 codes a byte; {self.fmt})")
            want = (full_n, full_k // 2)
        elif leaf == "weight_scale":
            check_block_scales(tensor, self.fmt)
            want = (full_n, full_k // self.group)
        else:
            raise ValueError(f"an {self.fmt} expert layer has no tensor {param_name!r}")
        if tuple(tensor.shape) != want:
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {want} (expert {expert} {part}: "
                             f"[{full_n}, {full_k}] packed two codes a byte, one scale per {self.group})")
        target = getattr(layer, f"{stack}{leaf}").data[local, rows]
        per_byte = 2 if leaf == "weight" else self.group
        copy_checked(target, take_groups(piece, tensor, per_byte, self.group))
        return True

    def _place(self, layer: FusedMoE, stack: str, local: int, rows: slice, piece, packed, scale) -> None:
        copy_checked(getattr(layer, f"{stack}weight").data[local, rows], take_groups(piece, packed, 2, self.group))
        copy_checked(getattr(layer, f"{stack}weight_scale").data[local, rows],
              take_groups(piece, scale, self.group, self.group))

    # ---- loading: gpt-oss's whole stacks (MXFP4) -----------------------------------------------
    @torch.no_grad()
    def load_gpt_oss(self, layer: FusedMoE, name: str, tensor: torch.Tensor) -> list[str]:
        """One of gpt-oss's expert tensors (``GPT_OSS``: the name's last part, ``mlp.experts.<name>``) for all
        experts at once, into this rank's experts and rows: gate/up de-interleaved, down's columns cut on scale
        groups. Biases go to the layer's ``w13_bias`` [E, 2I] / ``w2_bias`` [E, H], which the family creates.
        Returns the keys it filled, as ``CausalLM.load_weights`` counts them (``<param>#<shard>`` for each of the
        layer's ``weight_shards``), relative to the layer: the family prefixes its name."""
        if self.fmt != "mxfp4":
            raise ValueError(f"gpt-oss's {name} holds MXFP4 experts; this layer's experts are {self.fmt}")
        if name not in GPT_OSS:
            raise ValueError(f"{name!r} is none of gpt-oss's expert tensors {GPT_OSS}")
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        gate_up = name.startswith("gate_up")
        n, k = (2 * i, h) if gate_up else (h, i)
        kind = name.rpartition("_")[2]
        want = {"blocks": (e, n, k // 32, 16), "scales": (e, n, k // 32), "bias": (e, n)}[kind]
        if tuple(tensor.shape) != want:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {want} (num_experts={e}, "
                             f"{'2 * intermediate_size' if gate_up else 'hidden_size'}={n}, K={k} in groups of 32)")
        if kind == "blocks" and tensor.dtype != torch.uint8:
            raise ValueError(f"{name} has dtype {tensor.dtype}, expected torch.uint8 (two E2M1 codes a byte)")
        if kind == "scales":
            check_block_scales(tensor, "mxfp4")
        local = slice(layer.expert_start, layer.expert_start + layer.num_local_experts)
        t = tensor[local]
        if kind == "blocks":
            t = t.reshape(t.shape[0], n, k // 2)
        il = layer.intermediate_local
        if gate_up:
            t = deinterleave_rows(t)
            if layer.tp_size > 1:  # this rank's gate rows, then its up rows
                r = layer.tp_rank * il
                t = torch.cat([t[:, r : r + il], t[:, i + r : i + r + il]], dim=1)
        elif layer.tp_size > 1 and kind != "bias":
            piece = layer.rank_slice("w2")
            per_byte = 2 if kind == "blocks" else 32
            t = torch.stack([take_groups(piece, t[j], per_byte, 32) for j in range(t.shape[0])])
        elif kind == "bias" and layer.tp_rank != 0:
            t = torch.zeros_like(t)
        stack = "w13_" if gate_up else "w2_"
        target = {"blocks": f"{stack}weight", "scales": f"{stack}weight_scale", "bias": f"{stack}bias"}[kind]
        if getattr(layer, target, None) is None:
            raise ValueError(f"{name}: the layer has no {target} (a gpt-oss family's FusedMoE holds its biases)")
        copy_checked(getattr(layer, target).data, t)
        return [f"{target}#{s}" for s in layer.weight_shards(target)]

    @torch.no_grad()
    def init_random(self, layer: FusedMoE, weight: str, dtype: torch.dtype, generator: torch.Generator) -> None:
        """dummy: models: normal(0, 0.02) in ``dtype`` at the unquantized model's shape and generator position, each
        expert's gate, up and down quantized as a checkpoint's would be."""
        e, h, i = layer.num_local_experts, layer.hidden_size, layer.intermediate_local
        shape = (e, 2 * i, h) if weight == "w13_weight" else (e, h, i)
        w = torch.empty(shape, dtype=dtype, device=getattr(layer, weight).device).normal_(0.0, 0.02,
                                                                                         generator=generator)
        stack = weight.removesuffix("weight")
        parts = ((slice(0, i), 0), (slice(i, 2 * i), 1)) if weight == "w13_weight" else ((slice(0, h), 0),)
        # a few experts at a time: the quantization's fp32 temporaries of a whole stack (gpt-oss-120b's w13: 1.1G
        # elements, ~13 GB) would not fit beside the loaded model on an 80 GB card. Each expert's scales are its
        # own, so the result is the same.
        chunk = max(1, INIT_CHUNK_ELEMENTS // (shape[1] * shape[2]))
        for e0 in range(0, e, chunk):
            ex = slice(e0, min(e, e0 + chunk))
            for rows, slot in parts:
                packed, scale, global_ = quantize_fp4(w[ex, rows], self.fmt)
                getattr(layer, weight).data[ex, rows] = packed
                getattr(layer, f"{stack}weight_scale").data[ex, rows] = scale
                if global_ is not None:
                    getattr(layer, f"{stack}weight_scale_2").data[ex, slot] = global_

    # ---- forward --------------------------------------------------------------------------------
    def apply_experts(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, valid: torch.Tensor | None, use_kernels: bool) -> torch.Tensor:
        w13_global, w2_global = self.globals_(layer)
        args = (hidden, layer.w13_weight, layer.w13_weight_scale, w13_global, layer.w2_weight, layer.w2_weight_scale,
                w2_global, self.fmt, topk_weights, topk_ids)
        opts = dict(valid=valid, expert_start=layer.expert_start, w13_bias=getattr(layer, "w13_bias", None),
                    w2_bias=getattr(layer, "w2_bias", None), activation=getattr(layer, "activation", "silu"),
                    alpha=getattr(layer, "swiglu_alpha", 1.702), limit=getattr(layer, "swiglu_limit", 7.0))
        if use_kernels:
            from graphserve.kernels.fp4_moe import fp4_fused_experts

            return fp4_fused_experts(*args, counts=layer.expert_counts, **opts)
        layer.expert_counts.copy_(expert_counts_reference(topk_ids, valid, layer.num_experts))
        return fp4_fused_experts_reference(*args, **opts)

    def dequantized(self, layer: FusedMoE, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in ``dtype``."""
        from graphserve.kernels.fp4_reference import fp4_dequantize

        g13, g2 = self.globals_(layer)
        return (fp4_dequantize(layer.w13_weight, layer.w13_weight_scale, g13, self.fmt, dtype),
                fp4_dequantize(layer.w2_weight, layer.w2_weight_scale, g2, self.fmt, dtype))


def quantize_fp4_experts(model: CausalLM, config: Fp4Config) -> int:
    """Attach an Fp4MoEMethod to every ``FusedMoE`` the config does not keep in the model dtype; the number
    attached."""
    ignore = GlobIgnoreList(config, model.map_weight_name, model.stacked_params)
    return attach_to_experts(model, ignore, lambda: Fp4MoEMethod(config))
