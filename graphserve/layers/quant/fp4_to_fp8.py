"""``--fp4-load-as fp8``: FP4 weights (an NVFP4 or MXFP4 checkpoint, or ``--quantization nvfp4`` / ``mxfp4``)
converted to FP8 e4m3 once loaded, so the model runs the FP8 kernels (layers/quant/fp8.py, fp8_moe.py): their
cuBLASLt prefill and tuned decode streams, at twice FP4's weight bytes. The name follows SGLang/vLLM's
``--kv-cache-dtype fp8_e4m3``: a flag names the dtype a stored thing is held in, beside ``--quantization``, which
names the checkpoint's format.

Layout, as ``--quantization fp8`` quantizes a bf16 model (so the same kernels, tables and routes run): dense
projections with one fp32 scale per output channel (``weight_scale`` [N]), routed experts in 128x128 blocks
(``w13_weight_scale_inv``, gate's and up's row blocks apart; ``w2_weight_scale_inv``). The layers the FP4 config
kept in the model dtype stay there.

Exactness. Each FP8 scale is a power of two (the smallest with every value of its row or block within e4m3's 448)
times the part's NVFP4 global, so dividing by it only shifts exponents; an FP4 value times its group scale then
lands in e4m3 exactly when its significand fits e4m3's 4 bits and its exponent stays at or above e4m3's subnormal
grid (2^-9 of the FP8 scale):
- MXFP4: E2M1 codes have at most 2 significant bits and E8M0 scales are powers of two, so every value is exact while
  the group scales of one row (dense) or 128x128 block (experts) span at most 14 binades; a group more than that
  below the largest rounds on e4m3's subnormal grid (absolute error <= 2^-10 of the FP8 scale) or flushes to zero.
- NVFP4: codes 0.5, 1, 2, 4 (and 0) times an e4m3 group scale are exact (the same span condition); codes 1.5, 3, 6
  carry a second significant bit, and their product with a group scale whose mantissa is odd (e.g. 1.5 x 1.125 =
  1.6875, five bits) rounds to nearest: relative error <= 2^-4 of that weight, the same bound as ``--quantization
  fp8`` on a bf16 weight, and zero on the codes' half that is a power of two. ``exactness`` counts both per tensor.
The dequantized FP8 weight thus differs from the FP4 one by at most e4m3's half-ulp on a minority of weights. On the
tiny random-weight models of tests/models/test_fp4_load_as_fp8.py (NVFP4): 2.1% RMS relative weight error, and logits
0.023-0.032 (relative) from the FP4 model's, against FP4's own 0.11-0.12 from the bf16 model's (and
``--quantization fp8``'s 0.028-0.034): the conversion costs what an FP8 quantization costs. MXFP4: identical.

The dense FP4 GEMM's "dequant_fp8" variant (kernels/fp4_dequant_fp8.py) makes the same FP8 weight per call at
prefill rows, by the same rule (``pow2_scale``), from the FP4 weight this flag would replace: FP8's prefill matmul at
FP4's held bytes.

Memory: the conversion runs layer by layer on the load device (FP4 and FP8 of one layer at a time, fp32 temporaries
of at most ``CHUNK_ELEMENTS``); the memory plan prices the FP8 layers (``fp8_description``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphserve.errors import ConfigError
from graphserve.kernels.fp4_dequant_fp8 import pow2_scale
from graphserve.kernels.fp4_reference import fp4_dequantize
from graphserve.kernels.fp8_quant import FP8_DTYPE, FP8_MAX
from graphserve.layers.quant.config import DEFAULT_BLOCK, Fp8Config, quantized_description
from graphserve.layers.quant.fp4 import Fp4LinearMethod
from graphserve.layers.quant.fp4_config import Fp4Config, GlobIgnoreList
from graphserve.layers.quant.fp4_moe import Fp4MoEMethod
from graphserve.layers.quant.fp8 import Fp8LinearMethod
from graphserve.layers.quant.fp8_moe import Fp8MoEMethod

if TYPE_CHECKING:
    from graphserve.layers.linear import Linear
    from graphserve.layers.moe import FusedMoE

logger = logging.getLogger(__name__)

# what --quantization fp8 writes (layers/quant/config.online_config): the FP8 kernels' measured-fastest layout
FP8_LAYOUT = Fp8Config(block=None, expert_block=DEFAULT_BLOCK, serialized=False)
CHUNK_ELEMENTS = 1 << 26  # fp32 temporaries of at most 256 MiB a step (a few experts, or rows of a projection)
_FP4_LINEAR = ("weight_scale", "weight_scale_2", "input_scale")
_FP4_EXPERTS = ("w13_weight_scale", "w2_weight_scale", "w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale",
                "w2_input_scale")


def check_fp4_load_as(fp4_load_as: str, quant: Any, source: str) -> bool:
    """Whether the loaded model's FP4 weights go to FP8; ``--fp4-load-as fp8`` without FP4 weights is refused."""
    if fp4_load_as == "none":
        return False
    if not isinstance(quant, Fp4Config):
        has = "no quantization (bf16 weights)" if quant is None else quant.name
        raise ConfigError(f"--fp4-load-as={fp4_load_as} needs FP4 weights (an NVFP4 or MXFP4 checkpoint, or "
                          f"--quantization nvfp4 / mxfp4), but {source} loads with {has}: drop the flag or add "
                          "--quantization nvfp4", param="fp4_load_as")
    return True


def pow2_fp8(v: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` fp32 [E, N, K] -> (e4m3 [E, N, K], fp32 scales [E, N, 1] per channel or [E, ceil(N/bn), ceil(K/bk)] per
    block) with ``v ~= q * scale``, every scale the smallest power of two that keeps its values within 448: the
    division shifts exponents only (the module's note says when the result is exact). An all-zero row or block
    takes scale 1 (frexp(0) = (0, 0))."""
    e, n, k = v.shape
    if block is None:
        amax = v.abs().amax(dim=2, keepdim=True)
    else:
        bn, bk = block
        nb, kb = -(-n // bn), -(-k // bk)
        tiles = nn.functional.pad(v, (0, kb * bk - k, 0, nb * bn - n)).view(e, nb, bn, kb, bk)
        amax = tiles.abs().amax(dim=(2, 4))
    # the rule the dense FP4 GEMM's "dequant_fp8" variant converts by per call (kernels/fp4_dequant_fp8.py)
    scale = pow2_scale(amax)
    full = scale if block is None else scale.repeat_interleave(block[0], 1)[:, :n].repeat_interleave(block[1], 2)[..., :k]
    return (v / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def exactness(v: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> dict:
    """How far ``q * scale`` (from ``pow2_fp8``) is from ``v``: the share of weights not exact and the largest
    relative error among the nonzero ones."""
    _, n, k = v.shape
    full = scale if block is None else scale.repeat_interleave(block[0], 1)[:, :n].repeat_interleave(block[1], 2)[..., :k]
    back = q.float() * full
    nonzero = v != 0
    rel = ((back - v).abs() / v.abs().clamp(min=torch.finfo(torch.float32).tiny))[nonzero]
    return {"inexact": float((back != v).float().mean()), "max_rel": float(rel.max()) if rel.numel() else 0.0}


def _unit(method: Fp4LinearMethod | Fp4MoEMethod, lead: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """The globals (one per matrix of ``lead``) that leave codes times group scales as they are: NVFP4's own go to
    the FP8 scales instead."""
    return torch.ones(lead, device=device) if method.config.global_scale else None


@torch.no_grad()
def convert_linear(layer: Linear, fp8: Fp8LinearMethod) -> None:
    """An FP4 ``Linear`` in place to FP8 per channel: each row's scale a power of two times its part's global."""
    fp4: Fp4LinearMethod = layer.quant_method
    n = layer.out_features
    device = layer.weight.device
    if device.type != "meta":  # on meta (host_memory's sizes before a load) only the storage changes
        globals_ = fp4.global_rows(layer)
        q = torch.empty(n, layer.in_features, dtype=FP8_DTYPE, device=device)
        scale = torch.empty(n, dtype=torch.float32, device=device)
        step = max(1, CHUNK_ELEMENTS // layer.in_features)
        for r in range(0, n, step):
            rows = slice(r, min(n, r + step))
            v = fp4_dequantize(layer.weight[rows], layer.weight_scale[rows], _unit(fp4, (), device), fp4.fmt)
            part_q, part_scale = pow2_fp8(v[None], None)
            q[rows], scale[rows] = part_q[0], part_scale.reshape(-1)
        if globals_ is not None:
            scale *= globals_.float().expand(n) if globals_.dim() == 0 else globals_.float()
    for name in _FP4_LINEAR:
        _drop(layer, name)
    layer.fp4_row_global = layer.fp8_row_scale = None
    fp8.create_weights(layer)
    if device.type != "meta":
        layer.weight.data.copy_(q)
        fp8.scale(layer).copy_(scale)


@torch.no_grad()
def convert_experts(layer: FusedMoE, fp8: Fp8MoEMethod) -> None:
    """An FP4 ``FusedMoE`` in place to FP8 128x128 blocks, gate and up blocked apart, each block's scale a power
    of two times its expert's part's global."""
    fp4: Fp4MoEMethod = layer.quant_method
    e, h, i = layer.num_local_experts, layer.hidden_size, layer.intermediate_local
    device = layer.w13_weight.device
    g13, g2 = fp4.globals_(layer)
    block = fp8.block
    stacks = (("w13_", ((slice(0, i), 0), (slice(i, 2 * i), 1)), g13), ("w2_", ((slice(0, h), 0),), g2))
    converted = {}
    for stack, parts, globals_ in () if device.type == "meta" else stacks:  # meta: the storage changes only
        packed, groups = getattr(layer, f"{stack}weight"), getattr(layer, f"{stack}weight_scale")
        n, k = packed.shape[1], packed.shape[2] * 2
        q = torch.empty(e, n, k, dtype=FP8_DTYPE, device=device)
        scales = []
        chunk = max(1, CHUNK_ELEMENTS // (n * k))
        for rows, slot in parts:
            part_scales = []
            for e0 in range(0, e, chunk):
                ex = slice(e0, min(e, e0 + chunk))
                v = fp4_dequantize(packed[ex, rows], groups[ex, rows], _unit(fp4, (ex.stop - e0,), device), fp4.fmt)
                q[ex, rows], s = pow2_fp8(v, block)
                if globals_ is not None:
                    s = s * globals_[ex, slot].float().view(-1, 1, 1)
                part_scales.append(s)
            scales.append(torch.cat(part_scales))
        converted[stack] = (q, torch.cat(scales, dim=1))
    act_dtype = fp4.act_dtype
    for name in _FP4_EXPERTS:
        _drop(layer, name)
    fp8.create_weights(layer)
    fp8.act_dtype = act_dtype  # create_weights read it off the FP4 stacks (uint8): the activations' dtype is kept
    w13_scale, w2_scale = fp8.scales(layer)
    for (stack, (q, s)), target in zip(converted.items(), (w13_scale, w2_scale)):
        getattr(layer, f"{stack}weight").data.copy_(q)
        target.copy_(s)


def _drop(module: nn.Module, name: str) -> None:
    for table in (module._parameters, module._buffers):
        table.pop(name, None)


def _bytes(module: nn.Module) -> int:
    """A layer's quantized weights and their scales (its biases stay in the model dtype either way)."""
    tensors = (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
    return sum(t.numel() * t.element_size() for name, t in tensors if "bias" not in name)


def convert_fp4_model(model: nn.Module, quant: Fp4Config) -> tuple[int, int]:
    """Every FP4 linear and routed-expert layer of ``model`` (as loaded under ``quant``) to FP8; logs the layers
    and the weight bytes before and after (not for a model on the meta device: sizes only). Returns (linear
    layers, expert layers) converted."""
    from graphserve.layers.linear import Linear
    from graphserve.layers.moe import FusedMoE

    linear, experts = Fp8LinearMethod(FP8_LAYOUT), Fp8MoEMethod(FP8_LAYOUT)
    counts, before, after = [0, 0], 0, 0
    for _, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, Linear) and isinstance(method, Fp4LinearMethod):
            before += _bytes(module)
            convert_linear(module, linear)
            after += _bytes(module)
            counts[0] += 1
        elif isinstance(module, FusedMoE) and isinstance(method, Fp4MoEMethod):
            before += _bytes(module)
            convert_experts(module, experts)
            after += _bytes(module)
            counts[1] += 1
    if next(model.parameters()).device.type == "meta":
        return counts[0], counts[1]
    logger.info("fp4-load-as fp8: %d linear and %d routed-expert layers of %s converted to %s: their weights and "
                "scales %.3f GiB -> %.3f GiB (x%.2f: a byte a weight against FP4's half byte and group scales)",
                counts[0], counts[1], quant.name, FP8_LAYOUT.name, before / 2**30, after / 2**30,
                after / max(before, 1))
    return counts[0], counts[1]


class _Fp4Layers:
    """The layers an FP4 config made FP4, which ``convert_fp4_model`` made FP8: its ignore list, and with a config
    whose dense projections stay in the model dtype (gpt-oss's MXFP4) every projection kept."""

    def __init__(self, ignore: Any, dense: bool) -> None:
        self.ignore, self.dense = ignore, dense

    def keeps(self, name: str, shards: Any = None) -> bool:
        return not self.dense or self.ignore.keeps(name, shards)

    def keeps_experts(self, name: str, num_experts: int) -> bool:
        return self.ignore.keeps_experts(name, num_experts)


def fp8_description(desc: Any, quant: Fp4Config, model_dtype: torch.dtype, ignore: Any | None) -> Any:
    """``desc`` as held after ``convert_fp4_model``: the FP4 layers at FP8's bytes and scales, the rest as before.
    ``ignore``: the FP4 config's ignore list through the family's names (``fp4_ignore_list``; None where it lists
    nothing)."""
    if ignore is None:
        if quant.ignored:
            raise ValueError(f"{quant.ignored_field} names modules kept in the model dtype: pricing them needs the "
                             "family's names (GlobIgnoreList)")
        ignore = GlobIgnoreList(quant, lambda name: None, {})
    return quantized_description(desc, FP8_LAYOUT, model_dtype, _Fp4Layers(ignore, quant.dense))
