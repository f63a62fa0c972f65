"""Small-batch matmul ``x @ weight.T (+ bias)`` for decode: M (1..16) rows against an nn.Linear weight.

At decode batch sizes the matmul is a weight stream: every weight byte is read once and used M
times. Profiled on an H200 (~4.2 TB/s readable), cuBLAS reads the 4-12 MB projections of a 0.6B
model at only 1.4-1.6 TB/s, and its down projection adds a second, split-K reduce kernel. Here
each program owns ``block_n`` weight rows (output columns) for all M rows of x and streams its
``[block_n, K]`` slab once, with loads contiguous along K; ``block_n`` is chosen so there are at
least two programs per SM even for N = 1024, which makes split-K (and a second launch)
unnecessary. On the 48-224 MiB projections of an 8B model cuBLAS still streams faster, so
layers/linear.py routes each shape by the table benchmarks/gemv.py measured (kernels/gemv_rule.json).

Two inner products, picked per call by ``choose_config`` (kernels/gemv_config.py):
- FMA (M <= 4, or wherever 16-row tiles are too few to occupy every SM): each weight tile is
  multiplied by each x row and reduced along K in fp32. The CUDA cores do M multiply-adds per
  weight element, which stays under their peak for small M.
- dot (M > 4): ``tl.dot(w_tile, x_tile.T)`` with the weight as the first operand and x padded to
  16 rows ("swap AB"), so tensor cores take the M dimension at no extra bandwidth.

K is a compile-time constant: a model has three or four distinct K, a K that is a multiple of
``block_k`` drops the tail masks, and the loop bound stays a Python int under the interpreter.
Everything is a pure function of shapes: no autotuning (unsafe inside CUDA-graph capture), no
host syncs, no data-dependent allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import sm_count
from graphserve.kernels.gemv_config import DOT_BLOCK_M, MAX_M, SUPPORTED_DTYPES, GemvConfig, choose_config
from graphserve.kernels.norm import fused_add_rms_norm_reference, rms_norm_reference
from graphserve.kernels.pdl import pdl_args, pdl_enter


@triton.jit
def _x_tile(
    x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, rows, offs_k, mask, rstd,
    K: tl.constexpr, SILU_MUL: tl.constexpr, ADD_RESIDUAL: tl.constexpr, NORM: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """Rows of x at columns offs_k, through the prologue the call asks for.

    SILU_MUL: x = silu(gate) * up from gate_up = [gate | up]. ADD_RESIDUAL: x + residual. NORM:
    RMSNorm with the rows' ``rstd``. Every intermediate is rounded to the input dtype where the
    separate silu_and_mul / fused_add_rms_norm kernels write one, so the fused and unfused paths
    feed the matmul the same numbers.
    """
    ptrs = x_ptr + rows * stride_xm + offs_k
    if SILU_MUL:
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(OUT_DTYPE)
    x = tl.load(ptrs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + rows * stride_rm + offs_k, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(OUT_DTYPE)
    if NORM:
        nw = tl.load(nw_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        x = ((x.to(tl.float32) * rstd).to(OUT_DTYPE).to(tl.float32) * nw).to(OUT_DTYPE)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, nw_ptr, res_out_ptr, w_ptr, b_ptr, out_ptr,
    M, N, stride_xm, stride_rm, stride_rom, stride_wn, stride_om, eps,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_RESIDUAL: tl.constexpr, NORM: tl.constexpr,
    USE_DOT: tl.constexpr, IEEE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:
        # every program takes the rows' statistics itself: a K-wide row is a few KB read from L2,
        # far cheaper than a separate norm launch. Program 0 alone writes x + residual, into a
        # buffer nobody reads during the launch, so the other programs' reads of the old residual
        # cannot race with it.
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs_k[None, :]
            row_mask = (offs_m[:, None] < M) & (cols < K)
            s = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, offs_m[:, None], cols, row_mask, rstd[:, None],
                        K, False, ADD_RESIDUAL, False, w_ptr.dtype.element_ty)  # fmt: skip
            if ADD_RESIDUAL:
                tl.store(res_out_ptr + offs_m[:, None] * stride_rom + cols, s, mask=row_mask & (pid == 0))
            sf = s.to(tl.float32)
            sum_sq += tl.sum(sf * sf, axis=1)
        rstd = 1.0 / tl.sqrt(sum_sq / K + eps)
    # rows past N re-read row N-1 instead of being masked: the weight loads stay unmasked along N
    # and vectorise; those columns are never stored
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        if K % BLOCK_K == 0:  # no tail: unmasked weight loads
            w = tl.load(w_ptrs + k0)
        else:
            w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)
        if USE_DOT:
            x_mask = (offs_m[:, None] < M) & k_mask[None, :]
            x = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, offs_m[:, None], k0 + offs_k[None, :], x_mask,
                        rstd[:, None], K, SILU_MUL, ADD_RESIDUAL, NORM, w_ptr.dtype.element_ty)  # fmt: skip
            if IEEE_DOT:  # fp32 inputs would otherwise be rounded to tf32 by the tensor cores
                acc += tl.dot(w, tl.trans(x), input_precision="ieee")
            else:
                acc += tl.dot(w, tl.trans(x))
        else:
            wf = w.to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                rstd_m = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
                x_row = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, m, k0 + offs_k, k_mask & (m < M),
                                rstd_m, K, SILU_MUL, ADD_RESIDUAL, NORM, w_ptr.dtype.element_ty)  # fmt: skip
                part = tl.sum(wf * x_row.to(tl.float32)[None, :], axis=1)
                acc += tl.where(offs_m[None, :] == m, part[:, None], 0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_m[None, :] < M))


@dataclass(frozen=True)
class _Prologue:
    """What the kernel computes on x before the matmul: nothing, silu(gate) * up, or (residual add +) RMSNorm."""

    name: str
    silu_mul: bool = False
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None


def _launch(
    x: torch.Tensor,
    k: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    pro: _Prologue,
    config: GemvConfig | None,
) -> torch.Tensor:
    name = pro.name
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"{name} needs a 2-D input and weight, got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, n = x.shape[0], weight.shape[0]
    if not 0 < m <= MAX_M:
        raise ValueError(f"{name} takes 1..{MAX_M} rows, got {m}; use F.linear for larger batches")
    if weight.shape[1] != k:
        raise ValueError(f"{name}: weight {tuple(weight.shape)} does not match the input's K = {k}")
    if x.dtype != weight.dtype or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: input {x.dtype} and weight {weight.dtype} must share one of {SUPPORTED_DTYPES}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias must be contiguous with shape ({n},), got {tuple(bias.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError(f"{name}: weight must be contiguous along K (nn.Linear layout)")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"{name}: out must be [{m}, {n}] {x.dtype} contiguous along N, got {tuple(out.shape)}")
    res, res_out = pro.residual, pro.residual_out
    cfg = config or choose_config(m, n, k, sm_count(x.device))
    block_m = DOT_BLOCK_M if cfg.use_dot else triton.next_power_of_2(m)
    placeholder = weight  # pointer arguments a disabled prologue never dereferences
    _gemv_kernel[(cfg.num_programs(n),)](
        x, res if res is not None else placeholder, pro.norm_weight if pro.norm_weight is not None else placeholder,
        res_out if res_out is not None else placeholder, weight, bias if bias is not None else placeholder, out,
        m, n, x.stride(0), res.stride(0) if res is not None else 0, res_out.stride(0) if res_out is not None else 0,
        weight.stride(0), out.stride(0), pro.eps,
        K=k, HAS_BIAS=bias is not None, SILU_MUL=pro.silu_mul, ADD_RESIDUAL=res is not None,
        NORM=pro.norm_weight is not None, USE_DOT=cfg.use_dot, IEEE_DOT=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device, "_gemv_kernel"),
    )  # fmt: skip
    return out


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for x [M, K] (M <= 16), weight [N, K]; fp32 accumulation, x's dtype out.

    ``config`` overrides ``choose_config`` (benchmarks sweep it; the engine never passes it).
    """
    return _launch(x, x.shape[-1], weight, bias, out, _Prologue("gemv"), config)


def silu_mul_gemv(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T (+ bias)`` for gate_up [M, 2K] = [gate | up] and weight [N, K].

    The MLP's activation is computed while loading x, so the down projection needs no separate
    silu_and_mul launch nor its [M, K] intermediate.
    """
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul_gemv needs an even last dim (gate and up halves), got {gate_up.shape[-1]}")
    pro = _Prologue("silu_mul_gemv", silu_mul=True)
    return _launch(gate_up, gate_up.shape[-1] // 2, weight, bias, out, pro, config)


def norm_gemv(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    residual_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(x [+ residual]) @ weight.T (+ bias), x + residual or None)`` for x [M, K], M <= 16.

    A decoder layer's norm feeds its qkv and gate_up projections; at decode batch sizes the norm
    launch costs more than the norm, so every gemv program normalises the rows itself. Numerics
    are kernels/norm.py's: the sum rounded to x's dtype, fp32 statistics, the normalised row
    rounded before and after the norm weight. ``residual_out`` (allocated when None) receives
    ``x + residual``; it must not be ``residual``, which every program still reads.
    """
    name = "norm_gemv"
    m, k = x.shape[0], x.shape[-1]
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        raise ValueError(f"{name}: norm weight must be contiguous with shape ({k},), got {tuple(norm_weight.shape)}")
    if residual is None:
        if residual_out is not None:
            raise ValueError(f"{name}: residual_out given without a residual to add")
    else:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"{name}: residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
            )
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        if residual_out is None:
            residual_out = torch.empty(m, k, dtype=x.dtype, device=x.device)
        elif residual_out.shape != (m, k) or residual_out.dtype != x.dtype or residual_out.stride(-1) != 1:
            raise ValueError(
                f"{name}: residual_out must be [{m}, {k}] {x.dtype} contiguous along K, got {tuple(residual_out.shape)}"
            )
        elif residual_out.data_ptr() == residual.data_ptr():
            raise ValueError(f"{name}: residual_out must be a new buffer, not the residual every program reads")
    pro = _Prologue(name, norm_weight=norm_weight, eps=float(eps), residual=residual, residual_out=residual_out)
    return _launch(x, k, weight, bias, out, pro, config), residual_out


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x @ weight.T (+ bias)``."""
    out = x.float() @ weight.float().T
    return out + bias.float() if bias is not None else out


def silu_mul_gemv_reference(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 matmul of ``silu(gate) * up`` computed in fp32 and rounded to the input dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    x = (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)
    return gemv_reference(x, weight, bias)


def norm_gemv_reference(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 matmul of the reference RMSNorm (of ``x + residual`` rounded to x's dtype), and that sum."""
    if residual is None:
        return gemv_reference(rms_norm_reference(x, norm_weight, eps), weight, bias), None
    h, summed = fused_add_rms_norm_reference(x, residual, norm_weight, eps)
    return gemv_reference(h, weight, bias), summed
