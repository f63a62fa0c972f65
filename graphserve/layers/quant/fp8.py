"""FP8 linear layers: a quantization method a ``Linear`` / ``MergedLinear`` (layers/linear.py) delegates
its stored weight, its loading and its matmul to.

Stored per layer: ``weight`` fp8 e4m3 [N, K] and fp32 scales, ``weight_scale_inv``
[ceil(N/bn), ceil(K/bk)] for 128x128 blocks or ``weight_scale`` [N] per channel (a per-tensor
checkpoint scale is broadcast to its rows: exact, and one layout for the kernels), plus
``input_scale`` (one per merged shard; the largest is used, so no shard's activations clip) for
static activations. From an fp8 checkpoint they are Parameters the checkpoint must fill; quantized
at load (``--quantization``) the scales are buffers the weight's load fills.

The matmul, routed by rows and device (kernels/fp8_config.py: the table benchmarks/fp8_route.py measured
per projection shape and row count, else its defaults):
- CPU: the reference: dequantize the weight and ``F.linear`` (activations unquantized);
- CUDA ``stream`` (decode batch sizes): kernels/fp8_gemv.py, fp8 weights streamed against bf16
  activations (widened in registers, or x quantized in the kernel for the FP8 tensor cores: no
  activation quantization launch either way); at a few rows the RMSNorm before qkv / gate_up and the
  SiLU·mul before down run in its loads (``apply_norm`` / ``apply_silu_mul``, which layers/linear.py's
  norm_linear / silu_mul_linear call; row limits below). ``a8`` tiles read x quantized by a launch
  before them, as the two paths below;
- CUDA ``scaled_mm``, 128x128 blocks: per-token-group activation quantization (written padded and
  column-major, as cuBLASLt takes it) and ``torch._scaled_mm``'s block-scaled mode, where this
  build has it (probed once per device);
- CUDA ``w8a8``: per-token (group) or static activation quantization, then ``torch._scaled_mm``
  rowwise for per-channel scales where the shape takes it, else the Triton W8A8 kernel.
Where a path quantizes its input dynamically, the norm or SiLU·mul that makes the input runs in that
quantization's launch (kernels/fp8_quant.norm_group_quant / silu_mul_group_quant): the normed or activated
rows are never written, and the layer launches one kernel fewer. A gated MLP whose table has a tile pair for
the call goes one step further (``apply_norm_mlp``, which layers/linear.py's norm_mlp calls): gate_up's tile holds
gate and up rows, its epilogue computes silu·up and writes it quantized as down reads it, so neither gate_up's
[M, 2N] output nor silu_mul_group_quant's launch is left (benchmarks/fp8_gated_mlp.py measures the pairs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.kernels.common import sm_count
from graphserve.kernels.fp8_config import GatedMlp, Route, choose_route, gated_mlp
from graphserve.kernels.fp8_gemm import (
    blockwise_scale_layout,
    blockwise_scaled_mm_available,
    scaled_mm_blockwise,
    scaled_mm_rowwise,
    scaled_mm_supported,
    w8a8_matmul,
)
from graphserve.kernels.fp8_gemv import fp8_gate_up_a8, fp8_gemv, fp8_gemv_a8, fp8_norm_gemv, fp8_silu_mul_gemv
from graphserve.kernels.fp8_quant import (
    FP8_DTYPE,
    dequantize_blocks,
    norm_group_quant,
    per_token_group_quant,
    quantize_weight_blocks,
    quantize_weight_channels,
    silu_mul_group_quant,
    static_quant,
)
from graphserve.layers.quant.attach import attach_to_linears, copy_checked, part_rows
from graphserve.layers.quant.config import Fp8Config, IgnoreList

if TYPE_CHECKING:
    from graphserve.layers.linear import Linear, RankSlice
    from graphserve.models.base import CausalLM

# Rows up to which the streaming kernel computes its input's prologue itself. Every program reads the rows
# it multiplies again: a norm prologue reads whole rows (x and the residual) for the statistics, in every
# program and every K split, so its extra reads grow as programs * rows * K and pass the weight's own bytes
# within a few rows (llama3-8b qkv at 8 rows: 384 programs * 64 KB twice = 50 MB against a 25 MB weight).
# SiLU·mul reads gate and up for its own K share only: twice x's bytes instead of once. Past these rows the
# separate launch (one read and one write of the rows) costs less.
NORM_PROLOGUE_MAX_ROWS = 2
SILU_PROLOGUE_MAX_ROWS = 4


def add_input_scales(layer: nn.Module, shapes: dict[str, tuple[int, ...]], device: torch.device) -> None:
    """A checkpoint's static activation scales on ``layer``: a Parameter per name of ``shapes`` (one entry per fused
    part, or per expert and part) for the checkpoint to fill, and beside each the buffer ``{name}_max``, their
    largest: the one scale the kernels apply, so no part's activations clip (``record_input_scale`` fills it)."""
    for name, shape in shapes.items():
        layer.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device),
                                                    requires_grad=False))  # fmt: skip
        layer.register_buffer(f"{name}_max", torch.empty(1, dtype=torch.float32, device=device), persistent=False)
    # the entries loaded so far, per name: until all are, the others hold no value
    layer.input_scales_loaded = {name: set() for name in shapes}


def record_input_scale(layer: nn.Module, name: str, entry: int | tuple[int, ...], loaded: torch.Tensor) -> None:
    """One loaded static activation scale (checked: one value, finite and > 0) into entry ``entry`` of ``name``; once
    every entry has loaded, their largest into ``{name}_max``, at load, so no step takes it again."""
    held = getattr(layer, name)
    held.data[entry] = loaded.reshape(()).to(torch.float32)
    seen = layer.input_scales_loaded[name]
    seen.add(entry)
    if len(seen) == held.numel():
        getattr(layer, f"{name}_max").copy_(held.data.amax().reshape(1))


def check_scales(scales: torch.Tensor) -> None:
    """Refuse checkpoint scales (``weight_scale_inv``, ``weight_scale``, ``input_scale``) not in a float dtype, or not
    finite and positive, by a ValueError its caller prefixes with the tensor's name: an fp8 scale is an amax / 448,
    and a NaN, infinite, zero or negative one would load quietly and turn the layer's output into NaN, zero or its
    negative."""
    if not scales.dtype.is_floating_point or scales.dtype == FP8_DTYPE:
        raise ValueError(f"dtype {scales.dtype}, expected a float32 scale")
    bad = ~(torch.isfinite(scales) & (scales > 0))
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{int(bad.sum())} of {scales.numel()} scales are not finite and > 0 (the first, at "
                         f"{index}, is {scales[index].item()}): an fp8 scale is a positive amax / 448")


class Fp8LinearMethod:
    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        self.group_n, self.group_k = config.block if config.block else (1, 0)
        self._routes: dict[tuple, Route] = {}

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.config.block else "weight_scale"

    # ---- construction -------------------------------------------------------------------------
    def create_weights(self, layer: Linear) -> None:
        """Replace the layer's model-dtype weight by fp8 storage and its scales (on the layer's device)."""
        n, k = layer.out_features, layer.in_features
        device = layer.weight.device
        sizes = getattr(layer, "output_sizes", [n])
        if self.config.block and any(s % self.group_n for s in sizes[:-1]):
            raise ValueError(f"a fused projection's parts {sizes} must be multiples of the fp8 block "
                             f"{self.group_n} (weight_block_size[0])")
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE, device=device), requires_grad=False)
        shape = (-(-n // self.group_n), -(-k // self.group_k)) if self.config.block else (n,)
        scale = torch.empty(shape, dtype=torch.float32, device=device)
        if self.config.serialized:
            layer.register_parameter(self.scale_name, nn.Parameter(scale, requires_grad=False))
            if self.config.activation_scheme == "static":
                add_input_scales(layer, {"input_scale": (len(sizes),)}, device)
        else:
            layer.register_buffer(self.scale_name, scale)
        layer.quant_method = self

    def scale(self, layer: Linear) -> torch.Tensor:
        return getattr(layer, self.scale_name)

    # ---- loading --------------------------------------------------------------------------------
    def load_weight(self, layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard: int | None) -> None:
        """A checkpoint tensor (``weight``, its scale, ``input_scale`` or the bias of a layer that is not
        tensor-parallel, whose own loading takes its bias) into its rows; of a tensor-parallel layer, this rank's
        part of it (``Linear.rank_slice``): a weight and its block scales in whole blocks only."""
        start, stop = part_rows(layer, shard)
        part = layer.rank_slice(shard)
        if name == "bias":
            copy_checked(param.data[start:stop], loaded)
        elif name == "weight":
            self._load_weight(layer, param, loaded, start, stop, part)
        elif name == self.scale_name:
            check_scales(loaded)
            scales = part.take_scales(loaded, self._block(part)) if part is not None else loaded
            self._load_scale(param, scales, start, stop, layer.in_features)
        elif name == "input_scale":
            if loaded.numel() != 1:
                raise ValueError(f"input_scale has shape {tuple(loaded.shape)}, expected one value")
            check_scales(loaded)
            record_input_scale(layer, "input_scale", shard or 0, loaded)
        else:
            raise ValueError(f"an fp8 layer has no tensor {name!r}")

    def _block(self, part: RankSlice) -> int | None:
        """The scale tile's width along the dimension ``part`` cuts (None: per channel or tensor)."""
        return (self.group_n if part.dim == 0 else self.group_k) if self.config.block else None

    def _load_weight(self, layer: Linear, param: nn.Parameter, loaded: torch.Tensor, start: int, stop: int,
                     part: RankSlice | None = None) -> None:
        """A checkpoint weight (this rank's ``part`` of it: ``RankSlice.take_fp8``, or for a model-dtype weight
        quantized here, ``RankSlice.quantized``) into rows ``[start, stop)``."""
        target = param.data[start:stop]
        if self.config.serialized:
            loaded = part.take_fp8(loaded, self._block(part)) if part is not None else loaded
            if target.shape != loaded.shape:
                raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
            if loaded.dtype != FP8_DTYPE:
                raise ValueError(f"dtype {loaded.dtype}, expected {FP8_DTYPE} (the config's quant_method is fp8)")
            target.copy_(loaded)
            return

        def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            w = w.to(target.device)
            return quantize_weight_blocks(w, self.group_n, self.group_k) if self.config.block \
                else quantize_weight_channels(w)

        q, s = part.quantized(loaded, quantize, bool(self.config.block)) if part is not None else quantize(loaded)
        if target.shape != q.shape:
            raise ValueError(f"shape {tuple(q.shape)}, expected {tuple(target.shape)}")
        target.copy_(q)
        if self.config.block:
            self.scale(layer)[start // self.group_n: start // self.group_n + s.shape[0]].copy_(s)
        else:
            self.scale(layer)[start:stop].copy_(s)

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor, start: int, stop: int, k: int) -> None:
        if self.config.block:
            rows = slice(start // self.group_n, -(-stop // self.group_n))
            target = param.data[rows]
            if target.shape != loaded.shape:
                raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(target.shape)} "
                                 f"(one scale per {self.group_n}x{self.group_k} block of a [{stop - start}, {k}] weight)")
            target.copy_(loaded)
            return
        target = param.data[start:stop]
        if loaded.numel() == 1:  # per-tensor: every row of this part shares it
            target.fill_(loaded.reshape(()).item())
        elif loaded.numel() == target.numel() and loaded.dim() <= 2 and loaded.shape[0] == target.shape[0]:
            target.copy_(loaded.reshape(-1))
        else:
            raise ValueError(f"shape {tuple(loaded.shape)}, expected one scale (per tensor) or {stop - start} "
                             "(per channel)")

    @torch.no_grad()
    def init_random(self, layer: Linear, dtype: torch.dtype, generator: torch.Generator) -> None:
        """dummy: models: a normal(0, 0.02) weight in ``dtype``, quantized as a checkpoint's would be."""
        w = torch.empty(layer.weight.shape, dtype=dtype, device=layer.weight.device).normal_(0.0, 0.02, generator=generator)
        self._load_weight(layer, layer.weight, w, 0, layer.out_features)

    # ---- forward --------------------------------------------------------------------------------
    def dequantized_weight(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        return self._dequantized(layer.weight, self.scale(layer), dtype)

    def _dequantized(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.config.block:
            return dequantize_blocks(weight, scale, self.group_n, self.group_k).to(dtype)
        return (weight.float() * scale[:, None]).to(dtype)

    def apply_rows(self, layer: Linear, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``x @ W[start:stop].T`` for the output rows ``start:stop`` alone (no bias), on the kernels ``apply``
        routes to for that many rows: a block-diagonal product (DeepSeek-V4's grouped output projection) runs one
        call per group on its rows and their block scales, and never dequantizes the weight, which would cost a
        full-precision copy a step. Rows that split a scale block are refused, naming them."""
        rows = self.row_block(layer, start, stop)
        if not x.is_cuda:
            return F.linear(x, self._dequantized(rows.weight, self.scale(rows), x.dtype))
        flat = x.reshape(-1, x.shape[-1])
        out = self._cuda_matmul(rows, flat if flat.is_contiguous() else flat.contiguous())
        return out.view(*x.shape[:-1], stop - start)

    def check_rows(self, layer: Linear, start: int, stop: int) -> None:
        """Refuse, naming them, rows ``start:stop`` that ``apply_rows`` cannot run: outside the weight, or splitting
        a scale block (each block's one scale belongs to all its rows)."""
        n = layer.out_features
        if not 0 <= start < stop <= n:
            raise ValueError(f"rows [{start}, {stop}) are not a row range of a {n}-row fp8 weight")
        if self.config.block and (start % self.group_n or (stop % self.group_n and stop != n)):
            raise ValueError(f"rows [{start}, {stop}) split the fp8 scale blocks of {self.group_n} rows "
                             f"(weight_block_size[0]) of a {n}-row weight: a row range must start on a block and "
                             "end on one or at the last row")

    def row_block(self, layer: Linear, start: int, stop: int) -> RowBlock:
        """The rows ``start:stop`` of ``layer`` as the matmul paths read a layer (views of its weight and scales),
        made once per row range and weight: the block scales' cuBLASLt layout is cached on it as on a layer, and
        a CUDA-graph capture finds it made by the eager steps before."""
        self.check_rows(layer, start, stop)
        scale = self.scale(layer)
        key = (layer.weight.data_ptr(), scale.data_ptr())
        cache = layer.__dict__.setdefault("_fp8_row_blocks", {})
        held = cache.get((start, stop))
        if held is None or held[0] != key:
            block_rows = slice(start // self.group_n, -(-stop // self.group_n)) if self.config.block \
                else slice(start, stop)
            held = (key, RowBlock(layer, self.scale_name, scale[block_rows], start, stop))
            cache[(start, stop)] = held
        return held[1]

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return F.linear(x, self.dequantized_weight(layer, x.dtype), layer.bias)
        rows = x.reshape(-1, x.shape[-1])
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = self._cuda_matmul(layer, rows)
        return out.view(*x.shape[:-1], layer.out_features)

    def _prologue_route(self, layer: Linear, x: torch.Tensor, k: int, max_rows: int) -> Route | None:
        """The route of a call whose input a prologue (norm, SiLU·mul) makes, where that prologue runs inside
        the call: in the launch that quantizes the input, or in a streaming tile's loads up to ``max_rows``
        rows; None where the caller runs it separately."""
        if not x.is_cuda or x.dim() != 2 or (torch.is_grad_enabled() and x.requires_grad):
            return None
        route = self._route(x, layer.out_features, k)
        if self._quantizes_input(route) or (route.path == "stream" and not route.config.a8 and x.shape[0] <= max_rows):
            return route
        return None

    def _quantizes_input(self, route: Route) -> bool:
        """Whether this route quantizes its input per token (group) by a launch of its own."""
        if self.config.activation_scheme != "dynamic":
            return False
        return route.path != "stream" or route.config.a8

    def apply_silu_mul(self, layer: Linear, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``layer(silu_and_mul(gate_up))`` with the activation computed in the launch that reads it (the
        streaming kernel's loads at a few rows, else the input's quantization), or None where it cannot be
        (the caller then runs the two steps)."""
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        k = layer.in_features
        if rows.shape[-1] != 2 * k or not rows.is_contiguous():
            return None
        route = self._prologue_route(layer, rows[:, :k], k, SILU_PROLOGUE_MAX_ROWS)
        if route is None:
            return None
        if self._quantizes_input(route):
            group, blockwise = self._quant_layout(layer, route, k)
            a_q, a_s = silu_mul_group_quant(rows, group, **_layout(blockwise))
            out = self._quantized_matmul(layer, route, a_q, a_s, rows.shape[0], gate_up.dtype, blockwise)
        else:
            scale = self.scale(layer)
            out = fp8_silu_mul_gemv(rows, layer.weight, scale.view(scale.shape[0], -1), self.group_n,
                                    self.group_k or k, layer.bias, config=route.config)
        return out.view(*gate_up.shape[:-1], layer.out_features)

    def apply_norm(self, layer: Linear, norm: nn.Module, x: torch.Tensor,
                   residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(layer(norm(x [+ residual])), new residual)`` with the norm computed in the launch that reads it
        (as ``apply_silu_mul``), or None where it cannot be."""
        rows = x.reshape(-1, x.shape[-1])
        k = layer.in_features
        if rows.shape[-1] != k or not rows.is_contiguous():
            return None
        route = self._prologue_route(layer, rows, k, NORM_PROLOGUE_MAX_ROWS)
        if route is None:
            return None
        res_rows = residual.reshape(rows.shape) if residual is not None else None
        if self._quantizes_input(route):
            group, blockwise = self._quant_layout(layer, route, k)
            a_q, a_s, summed = norm_group_quant(rows, norm.weight, norm.eps, group, res_rows, **_layout(blockwise))
            y = self._quantized_matmul(layer, route, a_q, a_s, rows.shape[0], x.dtype, blockwise)
        else:
            scale = self.scale(layer)
            y, summed = fp8_norm_gemv(rows, norm.weight, norm.eps, layer.weight, scale.view(scale.shape[0], -1),
                                      self.group_n, self.group_k or k, layer.bias, res_rows, config=route.config)
        new_residual = summed.view(x.shape) if summed is not None else x
        return y.view(*x.shape[:-1], layer.out_features), new_residual

    def apply_norm_mlp(self, layer: Linear, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                       down: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(down(silu_and_mul(layer(norm(x [+ residual])))), new residual)`` for a merged [gate | up] ``layer`` and
        its MLP's ``down`` (quantized alike), through ``norm_mlp_with`` where the measured table has a tile pair for
        the call (kernels/fp8_config.gated_mlp); None elsewhere (the caller runs the steps)."""
        k, inter = layer.in_features, layer.out_features // 2
        if (not x.is_cuda or x.shape[-1] != k or layer.bias is not None or self.config.activation_scheme != "dynamic"
                or getattr(down, "quant_method", None) is None or down.quant_method.config != self.config
                or down.in_features != inter or down.out_features != k):  # fmt: skip
            return None
        tiles = gated_mlp(x.numel() // k, k, inter, self.group_n, self.group_k or k, x.device)
        if tiles is None or (torch.is_grad_enabled() and x.requires_grad):
            return None
        return self.norm_mlp_with(tiles, layer, norm, x, residual, down)

    def norm_mlp_with(self, tiles: GatedMlp, layer: Linear, norm: nn.Module, x: torch.Tensor,
                      residual: torch.Tensor | None, down: Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """``apply_norm_mlp`` on the pair ``tiles`` (benchmarks/fp8_gated_mlp.py times candidates through it): the
        norm rides in the launch that quantizes gate_up's input as its a8 tile reads it, gate_up's epilogue computes
        silu·up and writes it quantized in groups of down's K step (kernels/fp8_gemv.fp8_gate_up_a8), and down's
        tile reads that: silu_mul_group_quant's launch and gate_up's [M, 2N] output are saved."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        k, m = rows.shape[1], rows.shape[0]
        group = self._quant_layout(layer, Route("stream", tiles.gate_up), k)[0]
        res_rows = residual.reshape(rows.shape) if residual is not None else None
        a_q, a_s, summed = norm_group_quant(rows, norm.weight, norm.eps, group, res_rows)
        scale = self.scale(layer)
        h_q, h_s = fp8_gate_up_a8(a_q, a_s, layer.weight, scale.view(scale.shape[0], -1), self.group_n,
                                  self.group_k or k, x.dtype, config=tiles.gate_up,
                                  quant_group=tiles.gate_up.block_n // 2)  # fmt: skip
        out = down.quant_method._quantized_matmul(down, Route("stream", tiles.down), h_q, h_s, m, x.dtype)
        new_residual = summed.view(x.shape) if summed is not None else x
        return out.view(*x.shape[:-1], k), new_residual

    def input_quant(self, layer: Linear, m: int, dtype: torch.dtype, device: torch.device) -> dict | None:
        """How a call of ``m`` rows of ``dtype`` quantizes its input by a launch of its own (per_token_group_quant's
        ``group_size``, ``pad_rows_to`` and ``scales_column_major``), so that whatever makes the input can write
        it so instead and hand it to ``apply_quantized``; None where the call reads its input unquantized."""
        if device.type != "cuda":
            return None
        k = layer.in_features
        route = self._route_for(m, layer.out_features, k, dtype, device)
        if not self._quantizes_input(route):
            return None
        group, blockwise = self._quant_layout(layer, route, k)
        return {"group_size": group, **_layout(blockwise)}

    def apply_quantized(self, layer: Linear, a_q: torch.Tensor, a_s: torch.Tensor, m: int,
                        out_dtype: torch.dtype) -> torch.Tensor:
        """The layer on an input quantized as ``input_quant`` said for ``m`` rows: ``[m, out_features]`` (rows
        padded for cuBLASLt are dropped by its call)."""
        k = layer.in_features
        route = self._route_for(m, layer.out_features, k, out_dtype, a_q.device)
        blockwise = self._quant_layout(layer, route, k)[1]
        return self._quantized_matmul(layer, route, a_q, a_s, m, out_dtype, blockwise)

    def _route(self, x: torch.Tensor, n: int, k: int) -> Route:
        return self._route_for(x.shape[0], n, k, x.dtype, x.device)

    def _route_for(self, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Route:
        """The path of a call of ``m`` rows (kernels/fp8_config.py: measured table, else defaults); cached per shape."""
        key = (m, n, k, dtype, device)
        route = self._routes.get(key)
        if route is None:
            capturing = torch.cuda.is_current_stream_capturing()
            scaled_mm_ok = (self.config.block == (128, 128) and self.config.activation_scheme == "dynamic"
                            and n % 128 == 0 and k % 128 == 0 and dtype == torch.bfloat16 and not capturing
                            and blockwise_scaled_mm_available(device))
            route = choose_route(m, n, k, self.group_n, self.group_k or k, scaled_mm_ok, device, sm_count(device))
            if not capturing:  # in a capture the availability probe was skipped: decide again outside
                self._routes[key] = route
        return route

    def _scale_layout(self, layer: Linear) -> torch.Tensor | None:
        """The block scales as cuBLASLt takes them, made once per loaded scale (the eager run before
        graph capture makes it; inside a capture there is none yet and the call takes the Triton GEMM)."""
        scale = self.scale(layer)
        cached = getattr(layer, "_fp8_scale_layout", None)
        if cached is not None and cached[0] == (scale.data_ptr(), scale._version):
            return cached[1]
        if torch.cuda.is_current_stream_capturing():
            return None
        layout = blockwise_scale_layout(scale)
        layer._fp8_scale_layout = ((scale.data_ptr(), scale._version), layout)
        return layout

    def _quant_layout(self, layer: Linear, route: Route, k: int) -> tuple[int, bool]:
        """(group size, blockwise) of the input quantization this route reads: a streaming A8 tile of a block-scaled
        weight its K step, else the weight's scale block along K (the whole row: per token); blockwise where the call
        takes cuBLASLt's block-scaled GEMM, which wants rows padded to 4 and column-major scales.

        A streaming A8 tile of a per-channel weight reads x per token: one dot chain over K, both scales after it
        (kernels/fp8_gemv.py's X_TOKEN). A producer that writes x itself (``input_quant``: the attention kernel)
        writes it so too, one scale a row, which saves the quantization launch (kernels/decode_merge.emit_heads)."""
        if route.path == "stream":
            return (route.config.block_k if self.config.block else k), False
        return self.group_k or k, route.path == "scaled_mm" and self._scale_layout(layer) is not None

    def _quantized_matmul(self, layer: Linear, route: Route, a_q: torch.Tensor, a_s: torch.Tensor, m: int,
                          out_dtype: torch.dtype, blockwise: bool = False) -> torch.Tensor:
        """The route's product of quantized activations (first ``m`` rows real) and the fp8 weight;
        ``blockwise``: cuBLASLt's block-scaled GEMM, the activations laid out for it (``_quant_layout``)."""
        w, scale = layer.weight, self.scale(layer)
        group_k = self.group_k or w.shape[1]
        scale_2d = scale.view(scale.shape[0], -1)
        if route.path == "stream":
            return fp8_gemv_a8(a_q, a_s, w, scale_2d, self.group_n, group_k, out_dtype, layer.bias,
                               config=route.config)
        if blockwise:
            out = scaled_mm_blockwise(a_q, a_s, w, self._scale_layout(layer), torch.bfloat16, rows=m)
            return out + layer.bias if layer.bias is not None else out
        if not self.config.block and out_dtype == torch.bfloat16 and scaled_mm_supported(m, w.shape[0], w.shape[1],
                                                                                           a_q.device):
            return scaled_mm_rowwise(a_q, a_s, w, scale, out_dtype, layer.bias)
        return w8a8_matmul(a_q, a_s, w, scale_2d, self.group_n, group_k, out_dtype, layer.bias)

    def _cuda_matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        route = self._route(x, layer.out_features, k)
        if route.path == "stream" and not route.config.a8:
            scale = self.scale(layer)
            return fp8_gemv(x, layer.weight, scale.view(scale.shape[0], -1), self.group_n, self.group_k or k,
                            layer.bias, config=route.config)
        if self.config.activation_scheme == "static":
            a_q, a_s = static_quant(x, layer.input_scale_max)
            return self._quantized_matmul(layer, Route("w8a8"), a_q, a_s.contiguous(), m, x.dtype)
        group, blockwise = self._quant_layout(layer, route, k)
        a_q, a_s = per_token_group_quant(x, group, **_layout(blockwise))
        return self._quantized_matmul(layer, route, a_q, a_s, m, x.dtype, blockwise)


class RowBlock:
    """Rows ``start:stop`` of an fp8 ``Linear``, with what the matmul paths read of a layer: views of its weight and
    of the scales of those rows (per channel: theirs; blocks: the blocks they cover), no bias, its static input
    scale where it has one."""

    def __init__(self, layer: Linear, scale_name: str, scale: torch.Tensor, start: int, stop: int) -> None:
        self.weight = layer.weight[start:stop]
        setattr(self, scale_name, scale)
        self.bias = None
        self.in_features, self.out_features = layer.in_features, stop - start
        if hasattr(layer, "input_scale_max"):
            self.input_scale_max = layer.input_scale_max


def _layout(blockwise: bool) -> dict:
    """The quantized activations' layout: cuBLASLt's block-scaled GEMM takes rows padded to 4 and
    column-major scales; every other kernel reads them as they come."""
    return {"pad_rows_to": 4 if blockwise else 1, "scales_column_major": blockwise}


def quantize_linears(model: CausalLM, config: Fp8Config) -> int:
    """Attach an Fp8LinearMethod to every ``Linear`` the config does not keep in the model dtype (``IgnoreList``:
    a fused layer by the checkpoint modules it fuses); the number attached."""
    return attach_to_linears(model, Fp8LinearMethod(config), IgnoreList(config, model.map_weight_name,
                                                                        model.stacked_params))
