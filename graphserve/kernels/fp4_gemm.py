"""Tiled FP4-weight GEMM for prefill and large batches, and ``fp4_linear``, which routes a call by its rows.

Hopper multiplies no FP4, so a tile of packed weights becomes a tensor-core operand in registers. Two ways:

- ``"bf16"`` (W4A16): each [BLOCK_N, BLOCK_K] tile widened (kernels/fp4_layout.py), multiplied by its block
  scales in fp32 and rounded to bf16 (exact: every dequantized FP4 weight is a bf16 value), in K order
  (kernels/fp4_moe_gemm.py's ``_widened_tile``), against x's contiguous [BLOCK_M, BLOCK_K] tile. Below 64 rows a
  tile x is the MMA's first operand (16 or 32 rows, as in the MoE kernel), from 64 the widened weight is. The
  widening is CUDA-core work per weight element per M tile: it is amortized over BLOCK_M rows.
- ``"fp8"`` (W4A8): E2M1 is exact in e4m3, so the tile becomes fp8 by masks and shifts alone (no float
  arithmetic on the weight) and runs on the FP8 tensor cores against x quantized per token (one scale a row,
  kernels/fp8_quant.per_token_group_quant with the group K: one launch before). A block scale varies every
  16 (NVFP4) or 32 (MXFP4) columns, which is finer than an MMA's K (32 for fp8): each step is one 32-column
  MMA whose partial takes its scales on the CUDA cores; NVFP4's two 16-column groups a step take two MMAs,
  each over x with the other half's columns zeroed. The weight is always the first operand (BLOCK_N >= 64).

Past the decode rows two more variants run the weight through a transient copy and a library matmul: ``"dequant"``
(bf16 [N, K], one cuBLAS matmul) and ``"dequant_fp8"`` (e4m3 [N, K] over per-row powers of two, then the FP8 linear's
cuBLASLt matmul on x quantized per token: kernels/fp4_dequant_fp8.py).

Split-K (a tile's ``split_k``): a weight of few columns at a decode batch has fewer column tiles than the card has
SMs, each walking all of K alone; split, each program walks its share of K and stores an fp32 partial, and a second
launch sums the partials in split order (deterministic, no atomics) and applies the global scale and bias.

Which variant and tile: per card, shape and rows, kernels/fp4_gemm_config.py (``fp4_gemm_tiles.json``, measured by
``graphserve tune --tables fp4``); a shape it does not list takes the variant kernels/fp4_rule.json names (per
(format, N, K) the most rows the streaming kernel takes and the fewest from which the fp8 variant wins, measured by
the same tune or benchmarks/fp4.py) and a default tile sized to the card. A shape or card neither lists takes the
defaults (streaming up to ``DEFAULT_STREAM_ROWS`` rows, the fp8 variant from ``DEFAULT_FP8_ROWS``, the bf16 variant
between), with a start-up line naming the command, never a wrong answer (both variants compute the same product up
to the fp8 rounding of x).

Measured on an H100 before per-shape tiles (benchmarks/results/fp4_kernels.json, llama3-8b's projections, one fixed
tile of 64 weight rows by 64 or 128 rows of x, the bf16 variant stepping 256 columns as even and odd halves): the
streaming kernel won up to 8 rows, the fp8 variant from 32 (MXFP4 from 8 on three of four shapes), the bf16 variant
only at 8 rows of NVFP4; o_proj at 64 rows took 0.175 ms (bf16) and 0.105 ms (fp8) against bf16 cuBLAS's 0.016; an
8x2048 prefill ran 685k tok/s (MXFP4, fp8 variant) against FP8 cuBLASLt's 2.6M. Not yet re-measured with the tiles.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from graphserve.kernels import tables
from graphserve.kernels.common import sm_count
from graphserve.kernels.fp4_dequant_fp8 import dequant_fp8_gemm, dequant_fp8_gemm_reference
from graphserve.kernels.fp4_gemm_config import (
    VARIANTS,
    Fp4GemmConfig,
    Fp4GemmTile,
    check_fp8_tensor_cores,
    default_config,
    gemm_tile,
)
from graphserve.kernels.fp4_gemv import MAX_ROWS as STREAM_MAX_ROWS
from graphserve.kernels.fp4_gemv import fp4_gemv
from graphserve.kernels.fp4_layout import (
    GROUP,
    fp4_check,
    fp8_mma_step,
    fp8_weight_tile,
    group_bytes,
    row_global,
)
from graphserve.kernels.fp4_moe_gemm import _dense_weight_tile, _widened_tile
from graphserve.kernels.fp4_reference import fp4_dequantize
from graphserve.kernels.fp8_quant import FP8_DTYPE, per_token_group_quant
from graphserve.kernels.pdl import pdl_args, pdl_enter
from graphserve.kernels.tile_order import grouped_tile_ids

FP8_STEP = 32  # the fp8 MMA's K
DEFAULT_STREAM_ROWS = 8  # the H100 measurements' crossovers (module docstring), for shapes and cards not measured
DEFAULT_FP8_ROWS = 32
X_DTYPES = (torch.bfloat16, torch.float16)
REDUCE_BLOCK = (16, 128)  # the split-K sum's tile: rows, columns


@triton.jit
def _store_tile(acc, offs_m, offs_n, M, N, gs_ptr, b_ptr, out_ptr, stride_om, HAS_GLOBAL: tl.constexpr,
                ROW_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """A [BLOCK_M, BLOCK_N] fp32 tile of the product: global scale, bias, rounded to the output's dtype, stored."""
    n_ok = offs_n < N
    if HAS_GLOBAL:
        if ROW_GLOBAL:  # fused parts with different globals: each output row its own, no launch after this one
            acc *= tl.load(gs_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        else:
            acc *= tl.load(gs_ptr)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_ok[None, :])


@triton.jit
def _fp4_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_xsm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, GROUP_K: tl.constexpr, MX: tl.constexpr, HAS_GLOBAL: tl.constexpr, ROW_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] output tile over K (SPLIT_K 1), or over the K_SPLIT columns of split ``program_id(1)``,
    its fp32 partial then stored at ``out_ptr`` [SPLIT_K, M, N] for ``_fp4_split_sum_kernel``. Loop bounds are
    constants (the interpreter cannot take a program id as one; Triton pipelines either)."""
    pdl_enter(PDL)
    pid_m, pid_n = grouped_tile_ids(N, tl.cdiv(M, BLOCK_M), BLOCK_N, GROUP_M)
    k_first = tl.program_id(1) * K_SPLIT
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = tl.minimum(offs_m, M - 1).to(tl.int64)  # rows past M re-read row M-1; never stored
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]
    # below 64 rows x is the MMA's first operand, as in the MoE kernel (kernels/fp4_moe_gemm.py); from 64 the widened
    # weight is, from registers: as the second (through shared memory) it failed to compile at 64 and 128 (Triton
    # 3.6, sm_90). The fp8 variant's weight is always first (the e4m3 tile from registers, x's bytes from shared)
    W_FIRST: tl.constexpr = FP8 or BLOCK_M >= 64
    if W_FIRST:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:
        w_ptrs = w_ptr + w_rows[:, None] * stride_wn + tl.arange(0, BLOCK_K // 2)[None, :]
        s_ptrs = s_ptr + w_rows * stride_sn
        for kk in range(0, K_SPLIT, BLOCK_K):  # BLOCK_K = 32 (one MMA) divides K_SPLIT, which divides K
            k0 = k_first + kk
            a = tl.load(x_ptrs + k0)  # x's fp8 bytes (uint8): selected as integers, then bitcast
            w = fp8_weight_tile(tl.load(w_ptrs + k0 // 2).to(tl.int32), BLOCK_N, BLOCK_K)
            acc = fp8_mma_step(acc, w, a, s_ptrs, k0, GROUP_K, BLOCK_K, MX)
        acc *= tl.load(xs_ptr + x_rows * stride_xsm)[None, :]
    else:
        # the widened tile in K order (kernels/fp4_moe_gemm.py's), so x's tile is one contiguous load
        offs_g, byte3 = group_bytes(BLOCK_K, GROUP_K)
        w_ptrs = w_ptr + w_rows[:, None, None] * stride_wn + byte3[None, :, :]
        s_ptrs = s_ptr + w_rows[:, None] * stride_sn + offs_g[None, :]
        for kk in range(0, K_SPLIT, BLOCK_K):  # K_SPLIT divides K where whole steps do; else a tail masked by group
            k0 = k_first + kk
            if K % BLOCK_K == 0:
                a = tl.load(x_ptrs + k0)
            else:
                a = tl.load(x_ptrs + k0, mask=(k0 + offs_k < K)[None, :], other=0.0)
            w = _widened_tile(w_ptrs, s_ptrs, k0, offs_g, K, GROUP_K, MX, BLOCK_N, BLOCK_K, a.dtype)
            if W_FIRST:
                acc = tl.dot(w, tl.trans(a), acc)
            else:
                acc = tl.dot(a, tl.trans(w), acc)
    if W_FIRST:
        acc = tl.trans(acc)
    if SPLIT_K == 1:
        _store_tile(acc, offs_m, offs_n, M, N, gs_ptr, b_ptr, out_ptr, stride_om, HAS_GLOBAL, ROW_GLOBAL, HAS_BIAS)
    else:
        part_ptr = out_ptr + tl.program_id(1).to(tl.int64) * M * N
        _store_tile(acc, offs_m, offs_n, M, N, gs_ptr, b_ptr, part_ptr, N, False, False, False)


@triton.jit
def _fp4_split_sum_kernel(
    part_ptr, gs_ptr, b_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    ROW_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The split-K partials [SPLIT_K, M, N] (fp32) summed in split order (the same sum every run), then the GEMM's
    epilogue."""
    pdl_enter(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = part_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ptrs + s * M * N, mask=ok, other=0.0)
    _store_tile(acc, offs_m, offs_n, M, N, gs_ptr, b_ptr, out_ptr, stride_om, HAS_GLOBAL, ROW_GLOBAL, HAS_BIAS)


@triton.jit
def _fp4_dequant_kernel(
    w_ptr, s_ptr, gs_ptr, out_ptr, N, stride_wn, stride_sn, stride_on, K: tl.constexpr, GROUP_K: tl.constexpr,
    MX: tl.constexpr, HAS_GLOBAL: tl.constexpr, ROW_GLOBAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """The "dequant" variant's first launch: a [BLOCK_N, BLOCK_K] tile of the weight dequantized in fp32 (block scale
    and global scale), rounded once to the output's dtype."""
    pdl_enter(PDL)
    w, offs_n, rows, k0 = _dense_weight_tile(w_ptr, s_ptr, N, stride_wn, stride_sn, K, GROUP_K, MX, BLOCK_N, BLOCK_K)
    if HAS_GLOBAL:
        if ROW_GLOBAL:
            w *= tl.load(gs_ptr + rows)[:, None]
        else:
            w *= tl.load(gs_ptr)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    out_ptrs = out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + offs_k[None, :]
    tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])


def k_split(cfg: Fp4GemmConfig, k: int) -> int:
    """Columns each split walks, whole steps: where K is whole steps, the most splits up to ``cfg.split_k`` that
    divide them evenly (a split past K would read past the weight's rows, whose steps are unmasked there); else K's
    steps cut in ``cfg.split_k`` (the tail masked by scale group)."""
    steps = triton.cdiv(k, cfg.block_k)
    split = min(cfg.split_k, steps)
    if k % cfg.block_k == 0:
        while steps % split:
            split -= 1
    return triton.cdiv(steps, split) * cfg.block_k


def fp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
             fmt: str, bias: torch.Tensor | None = None, out: torch.Tensor | None = None, *, variant: str = "bf16",
             config: Fp4GemmConfig | None = None, fp8_row_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``x`` [M, K] (bf16/fp16) times the FP4 weight [N, K/2] (+ bias), x's dtype out; ``global_scale`` (NVFP4) one
    value or fp32 [N] one per output row; ``variant`` "bf16" (W4A16), "fp8" (W4A8: x quantized per token by one
    launch first), "dequant" (the weight dequantized to x's dtype, then cuBLAS) or "dequant_fp8" (the weight converted
    to e4m3 over ``fp8_row_scale``, fp32 [N] from kernels/fp4_dequant_fp8.fp8_row_scales, made in the call where
    None; then the FP8 matmul). ``config`` the tile (default: kernels/fp4_gemm_config.default_config for this card;
    "dequant" and "dequant_fp8": their first launch's)."""
    n, k = fp4_check("fp4_gemm", packed, scale, global_scale, fmt, x.shape[-1])
    if variant not in VARIANTS:
        raise ValueError(f"fp4_gemm: variant={variant!r} must be one of {VARIANTS}")
    if x.dim() != 2 or x.dtype not in X_DTYPES:
        raise ValueError(f"fp4_gemm: x must be 2-D {X_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    per_row = row_global("fp4_gemm", global_scale, n)
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"fp4_gemm: bias must be contiguous with shape ({n},), got {tuple(bias.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1):
        raise ValueError(f"fp4_gemm: out must be [{m}, {n}] {x.dtype} row-major, got {out.dtype} {tuple(out.shape)}")
    group = GROUP[fmt]
    if variant == "dequant_fp8" and m and n:
        check_fp8_tensor_cores("fp4_gemm", variant, x.device)
        cfg = config or default_config(variant, m, n, k, group, sm_count(x.device))
        cfg.check("fp4_gemm", variant, group, k)
        # the FP8 matmul writes its own output: a caller's ``out`` takes a copy (the layers pass none)
        y = dequant_fp8_gemm(x, packed, scale, global_scale, fmt, bias, cfg, fp8_row_scale)
        return out.copy_(y) if out is not None else y
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    fp8 = variant == "fp8"
    cfg = config or default_config(variant, m, n, k, group, sm_count(x.device))
    cfg.check("fp4_gemm", variant, group, k)
    if variant == "dequant":
        return _dequant_gemm(x, packed, scale, global_scale, per_row, fmt, bias, out, cfg)
    if fp8:
        xq, xs = per_token_group_quant(x, k)
        xq = xq.view(torch.uint8)
    else:
        xq, xs = x, x
    cols = k_split(cfg, k)
    splits = triton.cdiv(k, cols)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    gs = global_scale if global_scale is not None else out
    b = bias if bias is not None else out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), splits)
    _fp4_gemm_kernel[grid](
        xq, xs, packed, scale.view(torch.uint8), gs, b, target, m, n, xq.stride(0), xs.stride(0), packed.stride(0),
        scale.stride(0), out.stride(0), K=k, GROUP_K=group, MX=fmt == "mxfp4", HAS_GLOBAL=global_scale is not None,
        ROW_GLOBAL=per_row, HAS_BIAS=bias is not None, FP8=fp8, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=splits, K_SPLIT=cols, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(x.device, "_fp4_gemm_kernel"),
    )  # fmt: skip
    if splits > 1:
        rm, rn = REDUCE_BLOCK
        _fp4_split_sum_kernel[(triton.cdiv(m, rm), triton.cdiv(n, rn))](
            target, gs, b, out, m, n, out.stride(0), SPLIT_K=splits, HAS_GLOBAL=global_scale is not None,
            ROW_GLOBAL=per_row, HAS_BIAS=bias is not None, BLOCK_M=rm, BLOCK_N=rn, num_warps=4,
            **pdl_args(x.device, "_fp4_split_sum_kernel"),
        )  # fmt: skip
    return out


def _dequant_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                  per_row: bool, fmt: str, bias: torch.Tensor | None, out: torch.Tensor,
                  cfg: Fp4GemmConfig) -> torch.Tensor:  # fmt: skip
    """The "dequant" variant: the weight dequantized into a transient [N, K] of x's dtype (global scale folded in, one
    rounding), then one cuBLAS matmul with the bias in its epilogue. At prefill rows the dequantization's one pass over
    the weight is small beside the matmul, which then runs at the bf16 tensor cores' full rate."""
    n, k = packed.shape[0], x.shape[1]
    w = torch.empty(n, k, dtype=x.dtype, device=x.device)
    _fp4_dequant_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k))](
        packed, scale.view(torch.uint8), global_scale if global_scale is not None else w, w, n, packed.stride(0),
        scale.stride(0), w.stride(0), K=k, GROUP_K=GROUP[fmt], MX=fmt == "mxfp4", HAS_GLOBAL=global_scale is not None,
        ROW_GLOBAL=per_row, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        **pdl_args(x.device, "_fp4_dequant_kernel"),
    )  # fmt: skip
    if bias is not None:
        return torch.addmm(bias, x, w.t(), out=out)
    return torch.mm(x, w.t(), out=out)


def fp4_gemm_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       global_scale: torch.Tensor | None, fmt: str, bias: torch.Tensor | None = None,
                       variant: str = "bf16") -> torch.Tensor:  # fmt: skip
    """fp32 ``x @ dequant(w).T (+ bias)``; for the fp8 variant x quantized per token as the kernel's input is; for
    "dequant_fp8" the ``--fp4-load-as fp8`` conversion and the FP8 reference matmul."""
    if variant == "dequant_fp8":
        return dequant_fp8_gemm_reference(x, packed, scale, global_scale, fmt, bias)
    xf = x.float()
    if variant == "fp8":
        s = (xf.abs().amax(dim=1, keepdim=True) / torch.finfo(FP8_DTYPE).max).clamp(min=1e-12)
        xf = (xf / s).clamp(-448.0, 448.0).to(FP8_DTYPE).float() * s
    out = xf @ fp4_dequantize(packed, scale, global_scale, fmt).T
    return out + bias.float() if bias is not None else out


# -- routing: by rows, from the measured table ---------------------------------------------------------------
RULE_PATH = Path(__file__).with_name("fp4_rule.json")


@dataclass(frozen=True)
class Fp4Rule:
    """Per (fmt, N, K): the most rows the streaming kernel takes, and the fewest from which the fp8 GEMM
    variant wins (0: never); measured on ``device``."""

    device: str
    shapes: dict[tuple[str, int, int], tuple[int, int]]

    def route(self, fmt: str, n: int, k: int, m: int) -> str:
        stream_rows, fp8_from = self.shapes.get((fmt, n, k), (DEFAULT_STREAM_ROWS, DEFAULT_FP8_ROWS))
        if m <= min(stream_rows, STREAM_MAX_ROWS):
            return "stream"
        return "fp8" if fp8_from and m >= fp8_from else "bf16"

    @classmethod
    def from_json(cls, data: dict) -> Fp4Rule:
        shapes = {(str(s["fmt"]), int(s["n"]), int(s["k"])): (int(s["stream_max_rows"]), int(s["fp8_min_rows"]))
                  for s in data["shapes"]}
        return cls(str(data["device"]), shapes)


_DEFAULT_RULE = Fp4Rule("", {})


@tables.reader_cache
@functools.lru_cache(maxsize=1)
def _load_rule(path: str = str(RULE_PATH)) -> Fp4Rule:
    if not Path(path).exists():
        return _DEFAULT_RULE
    return Fp4Rule.from_json(json.loads(Path(path).read_text()))


@tables.reader_cache
@functools.lru_cache(maxsize=16)
def rule_for(device: torch.device) -> Fp4Rule:
    """This card's measured rule (kernels/tables.py: the tune cache, then the shipped tables), else the defaults
    (streaming up to DEFAULT_STREAM_ROWS, the fp8 GEMM from DEFAULT_FP8_ROWS; the start-up line names the
    command that measures it)."""
    if device.type != "cuda":
        return _DEFAULT_RULE
    found = tables.find(RULE_PATH.name, torch.cuda.get_device_name(device), Fp4Rule.from_json, "fp4")
    return found.table if found else _DEFAULT_RULE


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
               fmt: str, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
               fp8_row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(w).T (+ bias)`` for x [..., K]: the streaming kernel at decode rows, else the tiled GEMM
    variant the rule names for the shape. A pure function of the shape: a captured graph replays one path.
    ``fp8_row_scale``: the weight's per-row powers of two (kernels/fp4_dequant_fp8.fp8_row_scales), which the
    "dequant_fp8" variant reads; a caller without them gets them computed in the call."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = packed.shape[0]
    out2 = out.view(-1, n) if out is not None else None
    path, tile = linear_path(fmt, n, x2.shape[1], x2.shape[0], x.device)
    if tile is None:
        y = fp4_gemv(x2, packed, scale, global_scale, fmt, bias, out2)
    else:
        y = fp4_gemm(x2, packed, scale, global_scale, fmt, bias, out2, variant=path, config=tile.config,
                     fp8_row_scale=fp8_row_scale)
    return y.view(*lead, n)


def linear_path(fmt: str, n: int, k: int, m: int, device: torch.device) -> tuple[str, Fp4GemmTile | None]:
    """What ``fp4_linear`` runs for ``m`` rows of the weight (fmt, N, K): ("stream", None), or the GEMM variant and its
    tile (the tile table's, else the rule's variant with the default tile)."""
    path = rule_for(device).route(fmt, n, k, m)
    if path == "stream":
        return path, None
    tile = gemm_tile(fmt, n, k, m, device, path)
    return tile.variant, tile
