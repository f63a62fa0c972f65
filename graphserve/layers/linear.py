"""Linear layers: decode-sized batches on CUDA go through the gemv kernel where it was measured to
beat cuBLAS, the rest through F.linear.

At decode batch sizes a projection is a weight stream; on some shapes cuBLAS reads the weight well
below the card's bandwidth and the gemv kernel, which streams each weight slab once over every SM,
is faster; on others cuBLAS wins. Which is which is measured, per projection shape, row count and
card, by benchmarks/gemv.py, which writes the table this module routes by
(kernels/gemv_rule.json, read through ``kernels.gemv_config.rule_for``). A shape or card not in the
table stays on cuBLAS.

q/k/v and gate/up are fused into one matmul each (few large GEMMs are what the GPU path
wants); the checkpoint stores them apart, so each fused layer knows where every shard goes.

Tensor parallelism (the parallel classes at the end): a column-parallel layer keeps a slice of the
output rows, a row-parallel one a slice of the input columns, and each loads only its slice from the
checkpoint tensor. They compute with ``Linear.forward`` (so the gemv routing is the same at every tp);
the sum of a row-parallel layer's partial outputs is the caller's all-reduce (distributed/comm.py),
issued once per block after whatever else joins it. At tp 1 they hold the whole weight. An FP8 layer's
quantization method takes the rank's part itself (``rank_slice``): the weight with its scales, cut in whole
scale blocks (layers/quant/fp8.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.kernels.gemv_config import MAX_M, rule_for
from graphserve.layers.activation import silu_and_mul

if TYPE_CHECKING:
    from collections.abc import Callable

    from graphserve.layers.norm import RMSNorm

_GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def use_gemv(x: torch.Tensor, weight: torch.Tensor, kind: str = "linear") -> bool:
    """True when the rows of ``x`` ([..., K]) against ``weight`` [N, K] take the gemv kernel of ``kind``
    ("linear", "silu_mul" or "norm": what is fused into its loads), by the measured rule.

    The kernel has no backward, so a call that autograd would record stays on F.linear.
    """
    if not x.is_cuda or x.dtype != weight.dtype or x.dtype not in _GEMV_DTYPES or weight.stride(-1) != 1:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= MAX_M:
        return False
    n, k = weight.shape
    # silu_mul's input is [rows, 2K] (gate and up); the weight it multiplies is [N, K]
    return rows <= rule_for(x.device).max_rows(kind, n, k)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and checkpoint names) with the small-batch gemv path on CUDA.

    A quantization method (layers/quant) set as ``quant_method`` owns the stored weight, its loading
    and the matmul; the gemv paths below then never match (the weight is not in x's dtype).
    """

    quant_method = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        if use_gemv(x, self.weight):
            from graphserve.kernels.gemv import gemv

            out = gemv(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def rank_slice(self, shard: int | None) -> RankSlice | None:
        """The part of checkpoint tensor ``shard`` this rank holds (the tensor-parallel classes below); None:
        whole."""
        return None

    @torch.no_grad()
    def load_weight(self, param_name: str, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        if self.quant_method is not None:
            return self.quant_method.load_weight(self, param_name, param, loaded, shard)
        if shard is not None:
            raise ValueError(f"{type(self).__name__} takes no shard {shard!r}")
        if param.shape != loaded.shape:
            raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(loaded)


def silu_mul_linear(gate_up: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(silu_and_mul(gate_up))``: an MLP's activation and down projection.

    For decode-sized batches on CUDA the activation is computed inside the gemv kernel's loads,
    saving one launch and the [M, intermediate] round trip through memory.
    """
    fuse = getattr(getattr(linear, "quant_method", None), "apply_silu_mul", None)  # FP8: layers/quant/fp8.py
    if fuse is not None and (fused := fuse(linear, gate_up)) is not None:
        return fused
    if use_gemv(gate_up, linear.weight, "silu_mul"):
        from graphserve.kernels.gemv import silu_mul_gemv

        out = silu_mul_gemv(gate_up.reshape(-1, gate_up.shape[-1]), linear.weight, linear.bias)
        return out.view(*gate_up.shape[:-1], linear.out_features)
    return linear(silu_and_mul(gate_up))


def quantized_input_linear(
    linear: nn.Linear, m: int, dtype: torch.dtype, device: torch.device,
    make: Callable[..., tuple[torch.Tensor, torch.Tensor] | None],
) -> torch.Tensor | None:  # fmt: skip
    """``linear`` of an input its producer writes already quantized, or None.

    An FP8 layer whose call of ``m`` rows quantizes its input by a launch of its own (layers/quant/fp8.py
    ``input_quant``) says how; ``make(**layout)`` (per_token_group_quant's keywords) then returns the
    quantized input, written by the kernel that computes it, and the quantization launch is saved. None
    where the layer reads its input unquantized or ``make`` cannot write it so: the caller runs the
    producer and ``linear`` as usual."""
    method = getattr(linear, "quant_method", None)
    want = getattr(method, "input_quant", None)
    layout = want(linear, m, dtype, device) if want is not None else None
    if layout is None or (made := make(**layout)) is None:
        return None
    return method.apply_quantized(linear, *made, m, dtype)


def norm_linear(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, linear: nn.Linear
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(x [+ residual])), new residual)``: a decoder layer's norm and the projection it feeds.

    Without a residual (the first layer) the new residual is ``x`` itself. For decode-sized batches
    on CUDA the norm runs inside the gemv kernel's loads: two fewer launches per layer, which at one
    row cost more than the norm's arithmetic.
    """
    fuse = getattr(getattr(linear, "quant_method", None), "apply_norm", None)  # FP8: layers/quant/fp8.py
    if fuse is not None and (fused := fuse(linear, norm, x, residual)) is not None:
        return fused
    if use_gemv(x, linear.weight, "norm"):
        from graphserve.kernels.gemv import norm_gemv

        rows = x.reshape(-1, x.shape[-1])
        res_rows = residual.reshape(rows.shape) if residual is not None else None
        y, summed = norm_gemv(rows, norm.weight, norm.eps, linear.weight, linear.bias, res_rows)
        new_residual = summed.view(x.shape) if summed is not None else x
        return y.view(*x.shape[:-1], linear.out_features), new_residual
    if residual is None:
        residual, h = x, norm(x)
    else:
        h, residual = norm(x, residual)
    return linear(h), residual


def norm_mlp(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, gate_up: nn.Linear, down: nn.Linear
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(down(silu_and_mul(gate_up(norm(x [+ residual])))), new residual)``: a decoder layer's post-attention norm
    and gated MLP. An FP8 gate_up with a measured gated tile for the call computes silu·up in its epilogue and
    writes it quantized as ``down`` reads it (layers/quant/fp8.py ``apply_norm_mlp``); otherwise ``norm_linear``
    then ``silu_mul_linear``, each with the fusions it finds."""
    fuse = getattr(getattr(gate_up, "quant_method", None), "apply_norm_mlp", None)  # FP8: layers/quant/fp8.py
    if fuse is not None and (fused := fuse(gate_up, norm, x, residual, down)) is not None:
        return fused
    h, residual = norm_linear(norm, x, residual, gate_up)
    return silu_mul_linear(h, down), residual


class MergedLinear(Linear):
    """``Linear`` whose output rows are ``output_sizes`` stacked in order."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def weight_shards(self, param_name: str) -> list[int]:
        return list(range(len(self.output_sizes)))

    @torch.no_grad()
    def load_weight(self, param_name: str, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        """Checkpoint tensor ``shard`` (q, k or v; gate or up) into its rows of the fused parameter."""
        if shard is None:
            raise ValueError(f"a merged projection takes its {len(self.output_sizes)} parts one by one")
        if self.quant_method is not None:
            return self.quant_method.load_weight(self, param_name, param, loaded, shard)
        target = param.data[self.shard_rows(shard)]
        if target.shape != loaded.shape:
            raise ValueError(f"shard {shard} has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded)


# ---- tensor parallelism -----------------------------------------------------------------------------


def _split(total: int, tp_size: int, what: str) -> int:
    if total % tp_size:
        raise ValueError(f"{what}={total} does not split over tp_size={tp_size}")
    return total // tp_size


@dataclass(frozen=True)
class RankSlice:
    """The part of a checkpoint tensor one rank holds: ``size`` output rows (``dim`` 0, a column-parallel
    layer) or input columns (``dim`` 1, row-parallel) from ``start``, in the weight's coordinates."""

    dim: int
    start: int
    size: int

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows or columns of ``t`` (a weight, or a per-row vector along dim 0)."""
        if t.shape[self.dim] < self.start + self.size:
            raise ValueError(f"has {t.shape[self.dim]} {self._what} where this rank's are [{self.start}, "
                             f"{self.start + self.size})")
        return t.narrow(self.dim, self.start, self.size)

    def check_blocks(self, block: int, ends_the_weight: bool) -> None:
        """Refuse a part that cuts the ``block``-wide fp8 scale tiles along ``dim``, naming its rows or columns: it
        must start on a tile and cover whole tiles, but for a last one that ends with the weight."""
        if self.start % block or (self.size % block and not ends_the_weight):
            raise ValueError(f"this rank's {self._what} [{self.start}, {self.start + self.size}) cut the fp8 scale "
                             f"blocks of {block}: each rank's part must be whole blocks (a multiple of {block})")

    def take_fp8(self, weight: torch.Tensor, block: int | None) -> torch.Tensor:
        """This rank's part of an fp8 checkpoint weight scaled in ``block``-wide tiles along ``dim`` (whole tiles
        only, ``check_blocks``), or per channel or tensor (``block`` None: any part)."""
        if block:
            self.check_blocks(block, self.start + self.size == weight.shape[self.dim])
        return self.take(weight)

    def take_scales(self, scales: torch.Tensor, block: int | None) -> torch.Tensor:
        """This rank's scales of an fp8 weight: its whole ``block``-wide tiles along ``dim``; per channel (``block``
        None) its output rows' (a row-parallel rank keeps every row's); one per tensor, whole."""
        if scales.numel() == 1:
            return scales
        if not block:
            return self.take(scales) if self.dim == 0 else scales
        tiles = RankSlice(self.dim, self.start // block, -(-self.size // block))
        self.check_blocks(block, tiles.start + tiles.size == scales.shape[self.dim])
        return tiles.take(scales)

    def quantized(self, weight: torch.Tensor, quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                  blocked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize``'s (fp8 values, scales) for this rank's part of a model-dtype ``weight``, tp 1's where they
        can be: a part quantized in whole scale blocks or per channel on its own rows gets tp 1's, and is quantized
        alone (so is a part that would cut a block: its blocks then start at its first row or column); a
        row-parallel part per channel is quantized with its whole rows (tp 1's scales, every row's) and then cut."""
        if blocked or self.dim == 0:
            return quantize(self.take(weight))
        q, scales = quantize(weight)
        return self.take(q), scales

    @property
    def _what(self) -> str:
        return "rows" if self.dim == 0 else "columns"


def _fit(target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"{what} has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded)


class ColumnParallelLinear(Linear):
    """Output rows split over ``tp_size`` ranks: rank r computes rows ``[r·n, (r+1)·n)`` of the result."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(in_features, _split(out_features, tp_size, "out_features"), bias=bias)
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def rank_slice(self, shard: int | None) -> RankSlice | None:
        n = self.out_features
        return RankSlice(0, self.tp_rank * n, n) if self.tp_size > 1 else None

    @torch.no_grad()
    def load_weight(self, param_name: str, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        if self.quant_method is not None and param_name != "bias":  # it cuts the weight with its scales (rank_slice)
            return self.quant_method.load_weight(self, param_name, param, loaded, shard)
        part = self.rank_slice(shard)
        _fit(param.data, part.take(loaded) if part else loaded, f"{param_name} (rank {self.tp_rank}'s rows)")


class RowParallelLinear(Linear):
    """Input columns split over ranks; each rank's output is a partial sum that the caller all-reduces.

    The bias is held by rank 0 only (zeros elsewhere), so the all-reduced sum adds it exactly once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(_split(in_features, tp_size, "in_features"), out_features, bias=bias)
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def rank_slice(self, shard: int | None) -> RankSlice | None:
        k = self.in_features
        return RankSlice(1, self.tp_rank * k, k) if self.tp_size > 1 else None

    @torch.no_grad()
    def load_weight(self, param_name: str, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        if param_name == "bias":
            _fit(param.data, loaded if self.tp_rank == 0 else torch.zeros_like(loaded), "bias")
            return
        if self.quant_method is not None:
            return self.quant_method.load_weight(self, param_name, param, loaded, shard)
        part = self.rank_slice(shard)
        _fit(param.data, part.take(loaded) if part else loaded, f"{param_name} (rank {self.tp_rank}'s columns)")


class MergedColumnParallelLinear(MergedLinear):
    """Several column-parallel projections fused in one matmul (gate/up): each rank holds its slice of
    every part, stacked in order. ``output_sizes`` are the full sizes; ``self.output_sizes`` the local ones."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        local = [_split(n, tp_size, f"output_sizes[{i}]") for i, n in enumerate(output_sizes)]
        super().__init__(in_features, local, bias=bias)
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def shard_slice(self, shard: int) -> tuple[int, int]:
        """(first checkpoint row, rows) of part ``shard`` that this rank holds."""
        n = self.output_sizes[shard]
        return self.tp_rank * n, n

    def rank_slice(self, shard: int | None) -> RankSlice | None:
        return RankSlice(0, *self.shard_slice(shard)) if self.tp_size > 1 else None

    @torch.no_grad()
    def load_weight(self, param_name: str, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        if shard is None:
            raise ValueError(f"a merged projection takes its {len(self.output_sizes)} parts one by one")
        if self.quant_method is not None and param_name != "bias":
            return self.quant_method.load_weight(self, param_name, param, loaded, shard)
        part = RankSlice(0, *self.shard_slice(shard))
        _fit(param.data[self.shard_rows(shard)], part.take(loaded), f"shard {shard} (rank {self.tp_rank})")


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v fused, split by heads: each rank holds ``num_heads / tp`` query heads and
    ``max(1, num_kv_heads / tp)`` KV heads. With fewer KV heads than ranks, the ``tp / num_kv_heads``
    ranks whose query heads share a KV head each hold a copy of it."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        _split(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads >= tp_size:
            kv_local = _split(num_kv_heads, tp_size, "num_key_value_heads")
        elif tp_size % num_kv_heads:
            raise ValueError(f"num_key_value_heads={num_kv_heads} cannot be replicated evenly over {tp_size} ranks")
        else:
            kv_local = 1
        q, kv = num_heads * head_dim, kv_local * head_dim * tp_size  # "full" sizes that split to the local ones
        super().__init__(hidden_size, [q, kv, kv], bias=bias, tp_rank=tp_rank, tp_size=tp_size)
        self.head_dim, self.num_kv_heads = head_dim, num_kv_heads
        self.num_local_heads, self.num_local_kv_heads = num_heads // tp_size, kv_local

    def shard_slice(self, shard: int) -> tuple[int, int]:
        if shard == 0:
            return super().shard_slice(0)
        n = self.output_sizes[shard]
        if self.num_kv_heads >= self.tp_size:
            return self.tp_rank * n, n
        # rank r's query heads [r·H/tp, (r+1)·H/tp) all read KV head r·kv/tp (rounded down)
        kv_head = self.tp_rank * self.num_kv_heads // self.tp_size
        return kv_head * self.head_dim, n
