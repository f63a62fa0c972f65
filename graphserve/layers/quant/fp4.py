"""FP4 linear layers: the quantization method a ``Linear`` / ``MergedLinear`` (layers/linear.py) delegates its stored
weight, its loading and its matmul to (the layout: kernels/fp4_reference.py).

Stored per layer [N, K]: ``weight`` uint8 [N, K/2] (two E2M1 codes a byte, low nibble first), ``weight_scale``
[N, K/G] (NVFP4: float8_e4m3fn, G = 16; MXFP4: E8M0 uint8, G = 32) and, NVFP4 only, ``weight_scale_2`` float32
[parts]: one global scale per fused checkpoint module (q, k, v; gate, up), as ModelOpt exports each part with its
own; from a checkpoint also ``input_scale`` [parts], held and checked (activations stay in the model dtype). From a
checkpoint these are Parameters it must fill; quantized at load (``--quantization nvfp4``/``mxfp4``) the scales are
buffers the weight's load fills.

Tensor parallelism: a column-parallel rank takes whole rows (every row has its own scales); a row-parallel rank takes
K columns, which must start and end on a scale group: a group two ranks would share is refused naming the columns.
A weight quantized here is quantized whole (each part with its own global scale) and then cut, so every rank holds
exactly tp 1's codes and scales.

The matmul: on CPU ``fp4_linear_reference``'s dequantize-then-multiply; on CUDA kernels/fp4_gemm.fp4_linear. A fused
layer whose parts' global scales differ hands the kernels one global per output row (``fp4_row_global``, made as
the globals load), applied in their epilogue: no launch after the matmul. Equal globals, the usual ModelOpt export,
pass as one scalar. Each row's FP8 power of two (``fp8_row_scale``, [N] fp32: what the "dequant_fp8" variant converts
the weight over at prefill rows, kernels/fp4_dequant_fp8.py) is made once the weights have loaded (``prepare_fp4_linears``,
which the loader calls), or at a layer's first CUDA call where nothing made it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.kernels.fp4_dequant_fp8 import fp8_row_scales
from graphserve.kernels.fp4_reference import E8M0_NAN, fp4_dequantize, mxfp4_quantize, nvfp4_quantize
from graphserve.layers.quant.attach import attach_to_linears, copy_checked, part_rows
from graphserve.layers.quant.fp4_config import Fp4Config, GlobIgnoreList

if TYPE_CHECKING:
    from graphserve.layers.linear import Linear, RankSlice
    from graphserve.models.base import CausalLM

SCALE_DTYPES = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.uint8}


def quantize_fp4(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(packed, scale, global or None) of a model-dtype weight [..., N, K]."""
    if fmt == "nvfp4":
        return nvfp4_quantize(w)
    packed, scale = mxfp4_quantize(w)
    return packed, scale, None


def check_global_scale(t: torch.Tensor) -> None:
    """A global (``weight_scale_2``) or input scale: one float value, finite and > 0; a ValueError its caller
    prefixes with the tensor's name."""
    if not t.dtype.is_floating_point or t.dtype == torch.float8_e4m3fn:
        raise ValueError(f"dtype {t.dtype}, expected a float32 scale")
    bad = ~(torch.isfinite(t.float()) & (t.float() > 0))
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{int(bad.sum())} of {t.numel()} scales are not finite and > 0 (the first, at {index}, is "
                         f"{t.float()[index].item()}): a global scale is amax / (448 * 6) > 0")


def check_block_scales(t: torch.Tensor, fmt: str) -> None:
    """FP4 group scales: float8_e4m3fn (NVFP4) or E8M0 uint8 (MXFP4), none NaN (e4m3's 0x7f, E8M0's 255)."""
    want = SCALE_DTYPES[fmt]
    if t.dtype != want:
        raise ValueError(f"dtype {t.dtype}, expected {want} ({fmt} group scales)")
    bad = torch.isnan(t.float()) if fmt == "nvfp4" else t == E8M0_NAN
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{int(bad.sum())} of {t.numel()} group scales are NaN (the first at {index})")


def take_groups(part: RankSlice | None, t: torch.Tensor, per_byte: int, group: int) -> torch.Tensor:
    """This rank's part of a packed weight (``per_byte`` 2: two columns a byte) or of its group scales (``per_byte``
    = the group size) along K or rows; a K cut that splits a scale group is refused naming the columns."""
    if part is None:
        return t
    check_rank_groups(part, group)
    if part.dim == 0:
        return part.take(t)
    return t.narrow(1, part.start // per_byte, part.size // per_byte)


def check_rank_groups(part: RankSlice | None, group: int) -> None:
    """Refuse a rank's K columns that do not start and end on an FP4 scale group, naming them."""
    if part is not None and part.dim == 1 and (part.start % group or part.size % group):
        raise ValueError(f"this rank's columns [{part.start}, {part.start + part.size}) cut the FP4 scale groups of "
                         f"{group}: each rank's part of K must be whole groups (a multiple of {group})")


class Fp4LinearMethod:
    def __init__(self, config: Fp4Config) -> None:
        self.config = config
        self.fmt, self.group = config.fmt, config.group

    # ---- construction -------------------------------------------------------------------------
    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        device = layer.weight.device
        if not hasattr(layer, "output_sizes"):  # a row-parallel rank's K columns, named where they cut a group
            check_rank_groups(layer.rank_slice(None), self.group)
        if k % self.group:
            raise ValueError(f"in_features={k} is not a multiple of the {self.fmt} scale group {self.group}")
        parts = len(getattr(layer, "output_sizes", [n]))
        layer.weight = nn.Parameter(torch.empty(n, k // 2, dtype=torch.uint8, device=device), requires_grad=False)
        tensors = {"weight_scale": torch.empty(n, k // self.group, dtype=SCALE_DTYPES[self.fmt], device=device)}
        if self.config.global_scale:
            tensors["weight_scale_2"] = torch.ones(parts, dtype=torch.float32, device=device)
            if self.config.serialized:
                tensors["input_scale"] = torch.ones(parts, dtype=torch.float32, device=device)
        for name, t in tensors.items():
            if self.config.serialized:
                layer.register_parameter(name, nn.Parameter(t, requires_grad=False))
            else:
                layer.register_buffer(name, t)
        layer.fp4_row_global = None  # per output row, where the parts' global scales differ (``_set_global``)
        layer.fp8_row_scale = None  # per output row, made once the weight has loaded (``prepare``)
        layer.quant_method = self

    # ---- loading --------------------------------------------------------------------------------
    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard: int | None) -> None:
        start, stop = part_rows(layer, shard)
        part = layer.rank_slice(shard)
        if name == "bias":
            copy_checked(param.data[start:stop], loaded)
        elif name == "weight":
            if self.config.serialized:
                self._load_packed(layer, loaded, start, stop, part)
            else:
                self._quantize_into(layer, loaded, start, stop, shard or 0, part)
        elif name == "weight_scale":
            check_block_scales(loaded, self.fmt)
            k = layer.in_features * (layer.tp_size if part is not None and part.dim == 1 else 1)
            _check_full(loaded, (stop - start, k // self.group), part, "scales", self.group)
            copy_checked(param.data[start:stop], take_groups(part, loaded, self.group, self.group))
        elif name in ("weight_scale_2", "input_scale") and self.config.global_scale:
            if loaded.numel() != 1:
                raise ValueError(f"shape {tuple(loaded.shape)}, expected one value (one per checkpoint module)")
            check_global_scale(loaded)
            param.data[shard or 0] = loaded.reshape(()).float()
            if name == "weight_scale_2":
                self._set_global(layer)
        else:
            raise ValueError(f"an {self.fmt} layer has no tensor {name!r}")

    def _load_packed(self, layer: Linear, loaded: torch.Tensor, start: int, stop: int, part: RankSlice | None) -> None:
        if loaded.dtype != torch.uint8:
            raise ValueError(f"dtype {loaded.dtype}, expected torch.uint8 (two E2M1 codes a byte; {self.fmt})")
        k = layer.in_features * (layer.tp_size if part is not None and part.dim == 1 else 1)
        _check_full(loaded, (stop - start, k // 2), part, "packed codes", self.group)
        copy_checked(layer.weight.data[start:stop], take_groups(part, loaded, 2, self.group))

    def _quantize_into(self, layer: Linear, w: torch.Tensor, start: int, stop: int, shard: int,
                       part: RankSlice | None) -> None:
        """A model-dtype weight (the whole checkpoint module) quantized whole, then this rank's part of it."""
        device = layer.weight.device
        packed, scale, global_ = quantize_fp4(w.to(device), self.fmt)
        copy_checked(layer.weight.data[start:stop], take_groups(part, packed, 2, self.group))
        copy_checked(layer.weight_scale.data[start:stop], take_groups(part, scale, self.group, self.group))
        if global_ is not None:
            layer.weight_scale_2.data[shard] = global_
            self._set_global(layer)

    def _set_global(self, layer: Linear) -> None:
        g = layer.weight_scale_2.data
        sizes = getattr(layer, "output_sizes", None)
        if sizes is None or bool((g == g[0]).all()):
            layer.fp4_row_global = None
            return
        layer.fp4_row_global = g.repeat_interleave(torch.tensor(sizes, device=g.device))

    @torch.no_grad()
    def init_random(self, layer: Linear, dtype: torch.dtype, generator: torch.Generator) -> None:
        """dummy: models: a normal(0, 0.02) [N, K] weight in ``dtype`` (the unquantized model's draw), each fused
        part quantized with its own global scale as a checkpoint's would be."""
        n, k = layer.out_features, layer.in_features
        w = torch.empty(n, k, dtype=dtype, device=layer.weight.device).normal_(0.0, 0.02, generator=generator)
        sizes = getattr(layer, "output_sizes", [n])
        start = 0
        for shard, size in enumerate(sizes):
            self._quantize_into(layer, w[start : start + size], start, start + size, shard, None)
            start += size

    def prepare(self, layer: Linear) -> None:
        """Once the weight and its group scales have loaded: each row's FP8 power of two (the "dequant_fp8" variant's
        conversion scale; fp4_to_fp8.pow2_fp8's rule), [N] fp32 beside the weight."""
        layer.fp8_row_scale = fp8_row_scales(layer.weight.data, layer.weight_scale.data, self.fmt)

    def _row_scale(self, layer: Linear) -> torch.Tensor:
        if layer.fp8_row_scale is None:  # a layer no loader prepared (built in place): made by its first call
            self.prepare(layer)
        return layer.fp8_row_scale

    # ---- forward --------------------------------------------------------------------------------
    def global_rows(self, layer: Linear) -> torch.Tensor | None:
        """The global scale per output row (NVFP4), None for MXFP4."""
        if not self.config.global_scale:
            return None
        g = layer.weight_scale_2
        sizes = getattr(layer, "output_sizes", [layer.out_features])
        return g.repeat_interleave(torch.tensor(sizes, device=g.device)) if g.numel() > 1 else g.reshape(())

    def dequantized_weight(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        return fp4_dequantize(layer.weight, layer.weight_scale, self.global_rows(layer), self.fmt, dtype)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            # fp4_linear_reference's order: the fp32 dequantized weight, the product in fp32, rounded once
            out = F.linear(x.float(), self.dequantized_weight(layer, torch.float32), None)
            return (out + layer.bias.float() if layer.bias is not None else out).to(x.dtype)
        from graphserve.kernels.fp4_gemm import fp4_linear

        rows = x.reshape(-1, x.shape[-1])
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = fp4_linear(rows, layer.weight, layer.weight_scale, self._kernel_global(layer, slice(None)), self.fmt,
                         layer.bias, fp8_row_scale=self._row_scale(layer))
        return out.view(*x.shape[:-1], layer.out_features)

    def apply_rows(self, layer: Linear, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``x @ W[start:stop].T`` for the output rows ``start:stop`` alone (no bias), on the same kernels as
        ``apply``: a block-diagonal product (DeepSeek-V4's grouped output projection) runs one call per group
        and never dequantizes the weight, which would cost a full-precision copy a step and cannot be captured."""
        if not x.is_cuda:
            w = fp4_dequantize(layer.weight[start:stop], layer.weight_scale[start:stop],
                               _row_slice(self.global_rows(layer), start, stop), self.fmt, torch.float32)
            return F.linear(x.float(), w, None).to(x.dtype)
        from graphserve.kernels.fp4_gemm import fp4_linear

        rows = x if x.is_contiguous() else x.contiguous()
        return fp4_linear(rows, layer.weight[start:stop], layer.weight_scale[start:stop],
                          self._kernel_global(layer, slice(start, stop)), self.fmt,
                          fp8_row_scale=self._row_scale(layer)[start:stop])

    def _kernel_global(self, layer: Linear, rows: slice) -> torch.Tensor | None:
        """The global scale the kernels take for the output rows ``rows``: none (MXFP4), the one per tensor, or
        one per row where the fused parts' scales differ (``fp4_row_global``)."""
        if not self.config.global_scale:
            return None
        if layer.fp4_row_global is None:
            return layer.weight_scale_2[:1]
        return layer.fp4_row_global[rows]


def _row_slice(g: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    """A per-row global scale cut to the rows ``start:stop``; a per-tensor one (0-d) or none as it is."""
    return g[start:stop] if g is not None and g.dim() == 1 else g


def _check_full(loaded: torch.Tensor, local: tuple[int, int], part: RankSlice | None, what: str, group: int) -> None:
    """The checkpoint tensor's own shape: its K side exactly the model's (packed: K/2), its rows at least this rank's."""
    if loaded.dim() != 2 or loaded.shape[1] != local[1] or (part is None or part.dim == 1) and loaded.shape[0] != local[0]:
        raise ValueError(f"{what} have shape {tuple(loaded.shape)}, expected {local} (K packed two codes a byte, "
                         f"one scale per {group} elements)")


def quantize_fp4_linears(model: CausalLM, config: Fp4Config) -> int:
    """Attach an Fp4LinearMethod to every ``Linear`` the config does not keep (``GlobIgnoreList``; none when the
    config's projections stay dense, as gpt-oss's MXFP4); the number attached."""
    if not config.dense:
        return 0
    return attach_to_linears(model, Fp4LinearMethod(config), GlobIgnoreList(config, model.map_weight_name,
                                                                            model.stacked_params))


def prepare_fp4_linears(model: nn.Module) -> int:
    """Each loaded FP4 ``Linear`` of ``model`` on a GPU prepared for its prefill variants (``Fp4LinearMethod.prepare``);
    the number prepared. On the CPU (the reference path) and the meta device nothing is made."""
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, Fp4LinearMethod) and module.weight.device.type == "cuda":
            method.prepare(module)
            count += 1
    return count
