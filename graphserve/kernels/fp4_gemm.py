"""Tiled FP4-weight GEMM for prefill and large batches, and ``fp4_linear``, which routes a call by its rows.

Hopper multiplies no FP4, so a tile of packed weights becomes a tensor-core operand in registers. Two ways:

- ``"bf16"`` (W4A16): each [BLOCK_N, BLOCK_K] tile widened (kernels/fp4_layout.py), multiplied by its block
  scales in fp32 and rounded to bf16 (exact: every dequantized FP4 weight is a bf16 value), its low and high
  nibbles' tiles fed to the bf16 tensor cores against x's even and odd columns (kernels/fp4_gemv.py's dot
  path). The widening is CUDA-core work per weight element per M tile: it is amortized over BLOCK_M rows.
- ``"fp8"`` (W4A8): E2M1 is exact in e4m3, so the tile becomes fp8 by masks and shifts alone (no float
  arithmetic on the weight) and runs on the FP8 tensor cores against x quantized per token (one scale a row,
  kernels/fp8_quant.per_token_group_quant with the group K: one launch before). A block scale varies every
  16 (NVFP4) or 32 (MXFP4) columns, which is finer than an MMA's K (32 for fp8): each step is one 32-column
  MMA whose partial takes its scales on the CUDA cores; NVFP4's two 16-column groups a step take two MMAs,
  each over x with the other half's columns zeroed.

Which is faster depends on the shape; benchmarks/fp4.py times both (and the streaming kernel) per shape and
rows on the card and writes kernels/fp4_rule.json: per (format, N, K) the most rows the streaming kernel
takes and the fewest from which the fp8 variant wins. ``fp4_linear`` reads it; a shape or card it does not
list takes the defaults (streaming up to ``DEFAULT_STREAM_ROWS`` rows, the fp8 variant from ``DEFAULT_FP8_ROWS``,
the bf16 variant between), with a warning naming the command, never a wrong answer (both variants compute the
same product up to the fp8 rounding of x).

Measured on an H100 (benchmarks/results/fp4_kernels.json, llama3-8b's projections): the streaming kernel wins up to
8 rows, the fp8 variant from 32 (MXFP4 from 8 on three of four shapes), the bf16 variant only at 8 rows of NVFP4.
Neither is yet faster than the FP8 kernels on the same shape: at one row the streaming kernel reads 0.85-1.18 TB/s
against the probe's 3.11 (the FP8 stream 1.9-2.7), the widening's integer and conversion work per byte setting
the time, not the bytes; an 8x2048 prefill runs 685k tok/s (MXFP4, fp8 variant) against FP8 cuBLASLt's 2.6M.
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
from graphserve.kernels.fp4_gemv import MAX_ROWS as STREAM_MAX_ROWS
from graphserve.kernels.fp4_gemv import fp4_gemv
from graphserve.kernels.fp4_layout import (
    GROUP,
    block_scale,
    fp4_check,
    fp8_mma_step,
    fp8_weight_tile,
    row_global,
    widen_fp16,
)
from graphserve.kernels.fp4_reference import fp4_dequantize
from graphserve.kernels.fp8_quant import FP8_DTYPE, per_token_group_quant
from graphserve.kernels.pdl import pdl_args, pdl_enter

VARIANTS = ("bf16", "fp8")
FP8_STEP = 32  # the fp8 MMA's K
DEFAULT_STREAM_ROWS = 8  # the H100 measurements' crossovers (module docstring), for shapes and cards not measured
DEFAULT_FP8_ROWS = 32
X_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp4GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


def gemm_config(m: int, variant: str) -> Fp4GemmConfig:
    """A pure function of the rows: 64 weight rows a tile (the MMA's M side, one warpgroup), 64 rows of x up to
    64 rows, else 128 (the widening amortized over more rows); the fp8 variant steps one 32-column MMA at a
    time, 4 stages deep to keep its loads ahead."""
    block_m = 64 if m <= 64 else 128
    if variant == "fp8":
        return Fp4GemmConfig(block_m, 64, FP8_STEP, num_warps=4, num_stages=4)
    return Fp4GemmConfig(block_m, 64, 256, num_warps=4, num_stages=3)


@triton.jit
def _fp4_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_xsm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, GROUP_K: tl.constexpr, MX: tl.constexpr, HAS_GLOBAL: tl.constexpr, ROW_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles walk the same weight columns one after another, so those stay in L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < M
    x_rows = tl.minimum(offs_m, M - 1).to(tl.int64)  # rows past M re-read row M-1; never stored
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    # the widened weight is the MMA's first operand, straight from registers, and x the second: a widened tile as
    # the second operand (through shared memory) failed to compile at 128 columns (Triton 3.6, sm_90)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if FP8:
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + w_rows[:, None] * stride_wn + tl.arange(0, BLOCK_K // 2)[None, :]
        s_ptrs = s_ptr + w_rows * stride_sn
        for k0 in range(0, K, BLOCK_K):  # BLOCK_K = 32 (one MMA) divides K (a multiple of 32 here)
            a = tl.load(x_ptrs + k0)  # x's fp8 bytes (uint8): selected as integers, then bitcast
            w = fp8_weight_tile(tl.load(w_ptrs + k0 // 2).to(tl.int32), BLOCK_N, BLOCK_K)
            acc = fp8_mma_step(acc, w, a, s_ptrs, k0, GROUP_K, BLOCK_K, MX)
        acc *= tl.load(xs_ptr + x_rows * stride_xsm)[None, :]
    else:
        # as kernels/fp4_gemv.py's dot path: the low and high nibbles' tiles apart, against x's even and odd columns
        KB: tl.constexpr = BLOCK_K // GROUP_K
        G2: tl.constexpr = GROUP_K // 2
        offs_g = tl.arange(0, KB)
        byte3 = offs_g[:, None] * G2 + tl.arange(0, G2)[None, :]
        w_ptrs = w_ptr + w_rows[:, None, None] * stride_wn + byte3[None, :, :]
        s_ptrs = s_ptr + w_rows[:, None] * stride_sn + offs_g[None, :]
        for k0 in range(0, K, BLOCK_K):
            g_ok = (k0 // GROUP_K + offs_g) < K // GROUP_K  # K is whole groups: a tail is masked by group
            if K % BLOCK_K == 0:
                b = tl.load(w_ptrs + k0 // 2)
                s = tl.load(s_ptrs + k0 // GROUP_K)
            else:
                b = tl.load(w_ptrs + k0 // 2, mask=g_ok[None, :, None], other=0)
                s = tl.load(s_ptrs + k0 // GROUP_K, mask=g_ok[None, :], other=0)
            lo, hi = widen_fp16(b.to(tl.int32))
            sf = block_scale(s, MX, 14)[:, :, None]
            wl = tl.reshape((lo.to(tl.float32) * sf).to(x_ptr.dtype.element_ty), (BLOCK_N, BLOCK_K // 2))
            wh = tl.reshape((hi.to(tl.float32) * sf).to(x_ptr.dtype.element_ty), (BLOCK_N, BLOCK_K // 2))
            ce = tl.reshape(k0 + 2 * byte3, (BLOCK_K // 2,))
            cm = tl.reshape(g_ok[:, None] & (byte3 >= 0), (BLOCK_K // 2,))
            xe_ptrs = x_ptr + x_rows[:, None] * stride_xm + ce[None, :]
            xe = tl.load(xe_ptrs, mask=cm[None, :], other=0.0)
            xo = tl.load(xe_ptrs + 1, mask=cm[None, :], other=0.0)
            acc = tl.dot(wl, tl.trans(xe), acc)
            acc = tl.dot(wh, tl.trans(xo), acc)
    n_ok = offs_n < N
    if HAS_GLOBAL:
        if ROW_GLOBAL:  # fused parts with different globals: each output row its own, no launch after this one
            acc *= tl.load(gs_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        else:
            acc *= tl.load(gs_ptr)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & n_ok[:, None])


def fp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
             fmt: str, bias: torch.Tensor | None = None, out: torch.Tensor | None = None, *, variant: str = "bf16",
             config: Fp4GemmConfig | None = None) -> torch.Tensor:  # fmt: skip
    """``x`` [M, K] (bf16/fp16) times the FP4 weight [N, K/2] (+ bias), x's dtype out; ``global_scale`` (NVFP4) one
    value or fp32 [N] one per output row; ``variant`` "bf16"
    (W4A16) or "fp8" (W4A8: x quantized per token by one launch first). ``config`` overrides the tiles."""
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
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"fp4_gemm: out must be [{m}, {n}] {x.dtype} row-major, got {out.dtype} {tuple(out.shape)}")
    if m == 0 or n == 0:
        return out
    fp8 = variant == "fp8"
    cfg = config or gemm_config(m, variant)
    group = GROUP[fmt]
    if fp8:
        if cfg.block_k != FP8_STEP or k % FP8_STEP:
            raise ValueError(f"fp4_gemm fp8: steps of {FP8_STEP} columns over K a multiple of {FP8_STEP}, got "
                             f"block_k={cfg.block_k}, K={k}")
        xq, xs = per_token_group_quant(x, k)
        xq = xq.view(torch.uint8)
    else:
        if cfg.block_k % group or cfg.block_k & (cfg.block_k - 1):
            raise ValueError(f"fp4_gemm: block_k={cfg.block_k} must be a power of two and a multiple of {group}")
        xq, xs = x, x
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp4_gemm_kernel[grid](
        xq, xs, packed, scale.view(torch.uint8), global_scale if global_scale is not None else out,
        bias if bias is not None else out, out, m, n, xq.stride(0), xs.stride(0), packed.stride(0), scale.stride(0),
        out.stride(0), K=k, GROUP_K=group, MX=fmt == "mxfp4", HAS_GLOBAL=global_scale is not None,
        ROW_GLOBAL=per_row, HAS_BIAS=bias is not None, FP8=fp8, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(x.device, "_fp4_gemm_kernel"),
    )  # fmt: skip
    return out


def fp4_gemm_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       global_scale: torch.Tensor | None, fmt: str, bias: torch.Tensor | None = None,
                       variant: str = "bf16") -> torch.Tensor:  # fmt: skip
    """fp32 ``x @ dequant(w).T (+ bias)``; for the fp8 variant x quantized per token as the kernel's input is."""
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
               fmt: str, bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(w).T (+ bias)`` for x [..., K]: the streaming kernel at decode rows, else the tiled GEMM
    variant the rule names for the shape. A pure function of the shape: a captured graph replays one path."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = packed.shape[0]
    out2 = out.view(-1, n) if out is not None else None
    path = rule_for(x.device).route(fmt, n, x2.shape[1], x2.shape[0])
    if path == "stream":
        y = fp4_gemv(x2, packed, scale, global_scale, fmt, bias, out2)
    else:
        y = fp4_gemm(x2, packed, scale, global_scale, fmt, bias, out2, variant=path)
    return y.view(*lead, n)
