"""The FP4 weight layout the kernels read, its checks, and the widening every FP4 kernel shares.

Layout (the contract with the loading side, kernels/fp4_reference.py, whose dequantization the kernels' references use): E2M1 codes, two a byte, element 2i in
the low nibble of byte i, bit 3 the sign; ``packed`` [..., N, K/2] uint8. NVFP4: one float8_e4m3fn scale per
16 elements along K ([..., N, K/16]) and an fp32 global scale (a scalar, or per expert [E, 2] for w13 (gate's,
up's) and [E, 1] for w2). MXFP4: one E8M0 (uint8, 2^(s - 127)) scale per 32 elements ([..., N, K/32]), no
global scale.

Widening. A nibble's three magnitude bits placed at bits 9-11 of an fp16 (the sign at bit 15) make an fp16
whose value is exactly the E2M1 value times 2^-14 (code 1, 0.5, lands on the subnormal 2^-15, which fp16
keeps); placed at bits 2-4 of an e4m3 byte (sign at bit 7) they make the E2M1 value times 2^-6. So widening
is integer masks and shifts, no table, and the power of two goes into the block scale. E2M1 times an e4m3
scale has at most 5 significant bits and times an E8M0 scale 2: every dequantized weight is a bf16 value
(bf16 keeps fp32's exponent range), so a tile widened and scaled in registers feeds the bf16 tensor cores
without rounding. The global scale multiplies the fp32 accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FORMATS = ("nvfp4", "mxfp4")
GROUP = {"nvfp4": 16, "mxfp4": 32}  # elements along K per block scale
SCALE_DTYPE = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.uint8}
FP16_UNIT_LOG2 = 14  # the fp16 bit placement's value is e2m1 * 2^-14
FP8_UNIT_LOG2 = 6  # the e4m3 bit placement's value is e2m1 * 2^-6
# the streaming kernels' widenings (kernels/fp4_words.py), by code: 0 byte-wise (fp4_gemv.py's own loop), 1-3 ``widen8``
WIDENINGS = ("byte", "word", "e4m3", "e4m3_ptx")
WIDEN_UNIT_LOG2 = (FP16_UNIT_LOG2, FP16_UNIT_LOG2, FP8_UNIT_LOG2, FP8_UNIT_LOG2)
PTX_WIDENINGS = ("e4m3_ptx",)  # inline PTX: CUDA sm_89+ only
E4M3_WIDENINGS = ("e4m3", "e4m3_ptx")  # e4m3 -> fp16 conversions: sm_89+ on CUDA
# the widening the streaming kernels take when the caller names none (default_widen adapts it to the device): "word"
# by measurement, llama3-8b NVFP4 decode on an H100 (results/fp4_decode.json at d7f8134, one run): bs 1 ctx 512 took
# 4.718 ms with "word", 5.103 with "e4m3_ptx", 5.337 with "byte"; at bs 64 ctx 2048 all three 32.41-32.46 ms
DEFAULT_WIDEN = "word"


def default_widen(device: torch.device, widen: str | None = None) -> str:
    """``widen`` (default ``DEFAULT_WIDEN``) where ``device`` runs it, else the nearest that does: inline PTX off CUDA
    becomes its Triton twin "e4m3"; an e4m3 widening below sm_89 (no e4m3 conversion) the fp16 placement "word"."""
    widen = widen or DEFAULT_WIDEN
    if widen in PTX_WIDENINGS and device.type != "cuda":
        return "e4m3"
    if widen in E4M3_WIDENINGS and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "word"
    return widen


def widen_code(name: str, widen: str, device: torch.device) -> int:
    """``widen``'s code for the kernels; a ValueError naming the caller, the value and the limit where it is not one
    of ``WIDENINGS`` or cannot run on ``device``."""
    if widen not in WIDENINGS:
        raise ValueError(f"{name}: widen={widen!r} must be one of {WIDENINGS}")
    if widen in PTX_WIDENINGS:
        if device.type != "cuda":
            raise ValueError(f"{name}: widen={widen!r} runs inline PTX, CUDA only (device {device}); 'e4m3' computes "
                             "the same values anywhere")
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"{name}: widen={widen!r} needs cvt.rn.f16x2.e4m3x2 (sm_89 or later), this GPU is "
                             f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}")
    return WIDENINGS.index(widen)


@triton.jit
def group_bytes(BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr):
    """A K step of BLOCK_K columns over scale groups of GROUP_K: its groups (offs_g, [KB]) and each group's packed
    code bytes (byte3, [KB, GROUP_K / 2], offsets from the step's first byte), as the FP4 kernels index a weight row."""
    KB: tl.constexpr = BLOCK_K // GROUP_K
    G2: tl.constexpr = GROUP_K // 2
    offs_g = tl.arange(0, KB)
    return offs_g, offs_g[:, None] * G2 + tl.arange(0, G2)[None, :]


@triton.jit
def widen_fp16(b):
    """Bytes (int32) -> (low, high) nibbles as fp16 holding e2m1 * 2^-14, exactly."""
    lo = (((b & 0x8) << 12) | ((b & 0x7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (((b & 0x80) << 8) | ((b & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def widen_word(w, J: tl.constexpr):
    """int32 words of packed FP4 (four bytes: element 8i + j in nibble j of word i) -> nibbles J and J + 4 of each
    word as fp16 holding e2m1 * 2^-14, exactly (``widen_fp16``'s placement). One mask-and-shift pass over the word
    places both: nibble J lands in its low half and nibble J + 4 in its high half, so a word's eight values take four
    passes of about five integer operations, where byte-wise widening takes about five a value."""
    t = w >> (4 * J)  # arithmetic: the sign copies fill bits 20 and up, which the masks drop
    f = ((t & 0x00070007) << 9) | ((t & 0x00080008) << 12)
    lo = f.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (f >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _e4m3_byte(v, BYTE: tl.constexpr):
    return ((v >> (8 * BYTE)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def widen_word_e4m3(w):
    """int32 words of packed FP4 -> their eight values in element order as fp16 holding e2m1 * 2^-6, exactly:
    ``widen_fp8``'s placement done on the four bytes of a word at once (the low nibbles, elements 0 2 4 6, then the
    high ones), each e4m3 byte then converted to fp16 (on sm_89+ the conversion is ``cvt.rn.f16x2.e4m3x2``, two a
    instruction). The pure-Triton twin of ``widen_word_e4m3_ptx``."""
    u = w.to(tl.uint32, bitcast=True)
    lo = ((u << 4) & 0x80808080) | ((u << 2) & 0x1C1C1C1C)
    hi = (u & 0x80808080) | ((u >> 2) & 0x1C1C1C1C)
    return (_e4m3_byte(lo, 0), _e4m3_byte(hi, 0), _e4m3_byte(lo, 1), _e4m3_byte(hi, 1), _e4m3_byte(lo, 2),
            _e4m3_byte(hi, 2), _e4m3_byte(lo, 3), _e4m3_byte(hi, 3))


@triton.jit
def widen_word_e4m3_ptx(w):
    """``widen_word_e4m3`` in inline PTX (sm_89+, CUDA only: Triton's interpreter cannot run it): the two e4m3 words
    by shifts and masks (ptxas folds them into ``lop3``), four ``cvt.rn.f16x2.e4m3x2``, and the fp16 halves handed out
    as registers, without the byte extraction the Triton version goes through. The same eight values in the same
    order (tests/gpu/test_fp4.py compares the two bit for bit)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, b, lo, hi, p0, p1, p2, p3;
        .reg .b16 l0, l1, h0, h1;
        shl.b32 a, $8, 4;
        shl.b32 b, $8, 2;
        and.b32 a, a, 0x80808080;
        and.b32 b, b, 0x1C1C1C1C;
        or.b32 lo, a, b;
        shr.u32 b, $8, 2;
        and.b32 a, $8, 0x80808080;
        and.b32 b, b, 0x1C1C1C1C;
        or.b32 hi, a, b;
        mov.b32 {l0, l1}, lo;
        mov.b32 {h0, h1}, hi;
        cvt.rn.f16x2.e4m3x2 p0, l0;
        cvt.rn.f16x2.e4m3x2 p1, l1;
        cvt.rn.f16x2.e4m3x2 p2, h0;
        cvt.rn.f16x2.e4m3x2 p3, h1;
        mov.b32 {$0, $2}, p0;
        mov.b32 {$4, $6}, p1;
        mov.b32 {$1, $3}, p2;
        mov.b32 {$5, $7}, p3;
        }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r", args=[w], dtype=(tl.float16,) * 8, is_pure=True, pack=1)


@triton.jit
def widen8(w, WIDEN: tl.constexpr):
    """int32 words -> their eight values as fp16 in element order, by the widening ``WIDEN`` (1 "word": fp16
    placement, unit 2^-14; 2 "e4m3" and 3 "e4m3_ptx": e4m3 placement, unit 2^-6; ``WIDEN_UNIT_LOG2``)."""
    if WIDEN == 1:
        v0, v4 = widen_word(w, 0)
        v1, v5 = widen_word(w, 1)
        v2, v6 = widen_word(w, 2)
        v3, v7 = widen_word(w, 3)
    elif WIDEN == 2:
        v0, v1, v2, v3, v4, v5, v6, v7 = widen_word_e4m3(w)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = widen_word_e4m3_ptx(w)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def split8(x, A: tl.constexpr, B: tl.constexpr):
    """[A, B, 8] -> its eight [A, B] slices along the last axis, in order: x loaded once, wide, and taken apart in
    registers rather than loaded as eight strided tiles."""
    ev, od = tl.split(tl.reshape(x, (A, B, 4, 2)))  # elements 0 2 4 6 and 1 3 5 7
    e04, e26 = tl.split(tl.reshape(ev, (A, B, 2, 2)))
    o15, o37 = tl.split(tl.reshape(od, (A, B, 2, 2)))
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3, x7 = tl.split(o37)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def widen_fp8(b):
    """Bytes (int32) -> (low, high) nibbles as the uint8 bits of e4m3 values holding e2m1 * 2^-6, exactly
    (bytes, so that they can be interleaved before the bitcast)."""
    lo = (((b & 0x8) << 4) | ((b & 0x7) << 2)).to(tl.uint8)
    hi = ((b & 0x80) | ((b & 0x70) >> 2)).to(tl.uint8)
    return lo, hi


@triton.jit
def fp8_weight_tile(b, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed bytes [BLOCK_N, BLOCK_K / 2] (int32) -> the e4m3 tile [BLOCK_N, BLOCK_K] in K order, each weight its
    e2m1 value times 2^-6 exactly (``widen_fp8``): the FP8 tensor cores' operand, made by masks and shifts alone."""
    lo, hi = widen_fp8(b)
    return tl.reshape(tl.interleave(lo, hi), (BLOCK_N, BLOCK_K)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def fp8_mma_step(acc, w, a, s_ptrs, k0, GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr, MX: tl.constexpr):
    """``acc`` [BLOCK_N, BLOCK_M] plus one K step of ``BLOCK_K`` = 32 columns (the fp8 MMA's K) from column ``k0``:
    ``w`` the e4m3 weight tile (``fp8_weight_tile``), ``a`` [BLOCK_M, BLOCK_K] x's fp8 bytes (uint8), ``s_ptrs``
    [BLOCK_N] each weight row's block scales at column 0. A block scale varies every 16 (NVFP4) or 32 (MXFP4)
    columns, finer than the accumulator can take it, so each MMA's partial is scaled on the CUDA cores: MXFP4 one
    MMA a step, NVFP4 two, each over x with the other 16-column group's columns zeroed (the weight stays whole)."""
    if GROUP_K == BLOCK_K:
        part = tl.dot(w, tl.trans(a.to(tl.float8e4nv, bitcast=True)))
        acc += part * block_scale(tl.load(s_ptrs + k0 // GROUP_K), MX, 6)[:, None]
    else:
        low_half = (tl.arange(0, BLOCK_K) < GROUP_K)[None, :]
        s0 = block_scale(tl.load(s_ptrs + k0 // GROUP_K), MX, 6)
        s1 = block_scale(tl.load(s_ptrs + k0 // GROUP_K + 1), MX, 6)
        a_lo = tl.where(low_half, a, 0).to(tl.float8e4nv, bitcast=True)
        a_hi = tl.where(low_half, 0, a).to(tl.float8e4nv, bitcast=True)
        acc += tl.dot(w, tl.trans(a_lo)) * s0[:, None]
        acc += tl.dot(w, tl.trans(a_hi)) * s1[:, None]
    return acc


@triton.jit
def block_scale(s, MX: tl.constexpr, UNIT_LOG2: tl.constexpr):
    """Loaded block scales (uint8) -> fp32 times 2^UNIT_LOG2 (the widening's unit folded in). E8M0 becomes an fp32
    exponent field; a checkpoint's scales stay far below 255 - UNIT_LOG2 (fp4_check refuses 255, NaN)."""
    if MX:
        return ((s.to(tl.int32) + UNIT_LOG2) << 23).to(tl.float32, bitcast=True)
    sf = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # the kernels take e4m3 scales as their bytes
    if UNIT_LOG2 == 14:
        return sf * 16384.0
    return sf * 64.0


def fp4_check(name: str, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None, fmt: str,
              k: int | None = None, lead: tuple[int, ...] = ()) -> tuple[int, int]:
    """Validate one FP4 weight ([*lead, N, K/2] with its scales); returns (N, K). ``k``: the K the caller's
    input has. The errors name the tensor, the value and the limit."""
    if fmt not in FORMATS:
        raise ValueError(f"{name}: fmt={fmt!r} must be one of {FORMATS}")
    if packed.dtype != torch.uint8 or packed.dim() != len(lead) + 2 or tuple(packed.shape[:-2]) != lead:
        raise ValueError(f"{name}: packed weight must be uint8 [{', '.join(map(str, lead)) + ', ' if lead else ''}"
                         f"N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    if not packed.is_contiguous():
        raise ValueError(f"{name}: packed weight must be contiguous, got strides {packed.stride()}")
    n, kk = packed.shape[-2], packed.shape[-1] * 2
    g = GROUP[fmt]
    if k is not None and kk != k:
        raise ValueError(f"{name}: packed weight holds K = {kk} (2 x {packed.shape[-1]} bytes), the input has {k}")
    if kk % g:
        raise ValueError(f"{name}: K = {kk} must be a multiple of the {fmt} scale block ({g})")
    want = (*lead, n, kk // g)
    if scale.dtype != SCALE_DTYPE[fmt] or tuple(scale.shape) != want or not scale.is_contiguous():
        raise ValueError(f"{name}: {fmt} scale must be contiguous {SCALE_DTYPE[fmt]} {want}, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    if fmt == "nvfp4":
        if global_scale is None or global_scale.dtype != torch.float32:
            raise ValueError(f"{name}: nvfp4 needs an fp32 global scale (weight_scale_2), got "
                             f"{None if global_scale is None else global_scale.dtype}")
    elif global_scale is not None:
        raise ValueError(f"{name}: mxfp4 has no global scale, got one of shape {tuple(global_scale.shape)}")
    return n, kk



def row_global(name: str, global_scale: torch.Tensor | None, n: int) -> bool:
    """Whether ``global_scale`` is one per output row (fp32 [N], contiguous: fused parts with different globals
    scale their rows in the kernel's epilogue, no launch after it) rather than one value; any other shape is
    refused naming it."""
    if global_scale is None or global_scale.numel() == 1:
        return False
    if global_scale.shape != (n,) or not global_scale.is_contiguous():
        raise ValueError(f"{name}: the global scale must be one value or one per output row ({n},) contiguous, "
                         f"got shape {tuple(global_scale.shape)}")
    return True
