"""FP4 (E2M1) weights in plain PyTorch: packing, NVFP4 (ModelOpt) and MXFP4 (OCP MX, gpt-oss) quantize and
dequantize, and the reference linear that the CPU path runs and the FP4 kernels are tested against.

Layout shared by every FP4 reader in graphserve:
- an E2M1 code is 4 bits, bit 3 the sign, bits 0-2 index (0, 0.5, 1, 1.5, 2, 3, 4, 6);
- two codes a byte, LOW nibble first: element 2i sits in the low nibble of byte i, 2i+1 in the high one;
- NVFP4: one float8_e4m3fn scale per 16 elements along K, times a float32 global scale (ModelOpt's
  `weight_scale_2`); MXFP4: one E8M0 scale (uint8, value 2^(s - 127)) per 32 elements along K.
Leading dimensions (experts) are allowed everywhere: packed [..., N, K/2], scales [..., N, K/G].
"""

from __future__ import annotations

from typing import Literal

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_GROUP = 16
MXFP4_GROUP = 32
E8M0_BIAS = 127
E8M0_NAN = 255
FP4Format = Literal["nvfp4", "mxfp4"]
FP4_GROUPS = {"nvfp4": NVFP4_GROUP, "mxfp4": MXFP4_GROUP}

_CODE_VALUES = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (each < 16) -> uint8 [..., K/2], element 2i in the low nibble of byte i."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4: codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dimension must be even to pack two codes a byte, got {codes.shape[-1]}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"pack_fp4: codes must be < 16, got {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K] (inverse of pack_fp4)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4: packed must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, < 16) -> their float32 values (code 8 is -0.0)."""
    return _CODE_VALUES.to(codes.device)[codes.long()]


def float_to_fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    3.5 -> 4, 5 -> 4, as ModelOpt and the OCP spec round); magnitudes above 6 saturate to 6. The sign bit follows
    the input's sign bit, so a small negative rounds to code 8 (-0)."""
    a = x.float().abs()
    # Strict '>' where the lower neighbour's code is even, '>=' where the upper one's is.
    mag = (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    return mag.to(torch.uint8) | (torch.signbit(x.float()).to(torch.uint8) << 3)


def _check_finite(w: torch.Tensor, who: str) -> None:
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{who}: the weight holds non-finite values; FP4 cannot represent them")


def _check_groups(packed: torch.Tensor, scale: torch.Tensor, group: int, who: str) -> int:
    """K from the packed shape, checked against the scale's shape; returns K."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"{who}: packed weight must be uint8, got {packed.dtype}")
    k = packed.shape[-1] * 2
    want = (*packed.shape[:-1], k // group)
    if k % group or tuple(scale.shape) != want:
        raise ValueError(
            f"{who}: scale shape {tuple(scale.shape)} does not fit packed {tuple(packed.shape)} "
            f"(K = {k}, one scale per {group} elements: want {want})"
        )
    return k


def _expand_groups(scale: torch.Tensor, group: int) -> torch.Tensor:
    return scale.repeat_interleave(group, dim=-1)


def _global_rows(global_scale: torch.Tensor | float, lead: tuple[int, ...], n: int, who: str) -> torch.Tensor:
    """A global scale per matrix (shape = leading dims) or per part of its rows (leading dims + [P], the rows split
    into P equal parts: a fused gate/up keeps each part's own scale) -> a float32 factor broadcastable to [..., N, 1]."""
    g = torch.as_tensor(global_scale, dtype=torch.float32)
    if tuple(g.shape) == lead:
        return g.reshape(*lead, 1, 1)
    if g.dim() == len(lead) + 1 and tuple(g.shape[:-1]) == lead and g.shape[-1] >= 1 and n % g.shape[-1] == 0:
        return g.repeat_interleave(n // g.shape[-1], dim=-1).unsqueeze(-1)
    raise ValueError(
        f"{who}: global scale shape {tuple(g.shape)} fits neither one per matrix {lead} nor "
        f"one per equal part of the {n} rows ({lead} + [P])"
    )


def nvfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (packed uint8 [..., N, K/2], scale float8_e4m3fn [..., N, K/16], global float32 [...]).

    ModelOpt's recipe: global = amax(w) / (448 * 6), block scale = amax(block) / 6 / global cast to e4m3, codes =
    RNE E2M1 of w / (scale * global). An all-zero matrix gets global 1 and zero block scales (a zero global would
    be refused at load)."""
    if w.dim() < 2 or w.shape[-1] % NVFP4_GROUP:
        raise ValueError(f"nvfp4_quantize: need [..., N, K] with K a multiple of {NVFP4_GROUP}, got {tuple(w.shape)}")
    _check_finite(w, "nvfp4_quantize")
    w = w.float()
    amax = w.abs().amax(dim=(-2, -1))
    global_scale = torch.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax))
    blocks = w.unflatten(-1, (-1, NVFP4_GROUP))
    block_amax = blocks.abs().amax(dim=-1)
    g = global_scale.reshape(*global_scale.shape, 1, 1)
    scale = (block_amax / E2M1_MAX / g).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = scale.float().unsqueeze(-1) * g.unsqueeze(-1)
    # A block whose scale underflows to 0 in e4m3 holds only values too small for any code but 0.
    scaled = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, 1.0), 0.0)
    return pack_fp4(float_to_fp4_codes(scaled.flatten(-2))), scale, global_scale


def nvfp4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """value = e2m1 * float(scale[..., n, k // 16]) * global (per matrix, or per equal part of the rows)."""
    _check_groups(packed, scale, NVFP4_GROUP, "nvfp4_dequantize")
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"nvfp4_dequantize: scale must be float8_e4m3fn, got {scale.dtype}")
    g = _global_rows(global_scale, tuple(packed.shape[:-2]), packed.shape[-2], "nvfp4_dequantize").to(packed.device)
    vals = fp4_codes_to_float(unpack_fp4(packed)) * _expand_groups(scale.float(), NVFP4_GROUP)
    return (vals * g).to(dtype)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (packed uint8 [..., N, K/2], scale uint8 E8M0 [..., N, K/32]).

    The OCP MX recipe: shared exponent = floor(log2(amax(block))) - 2 (E2M1's largest exponent), so the block's
    largest magnitude lands in [4, 8) and saturates to 6 above it; codes = RNE E2M1 of w / 2^exponent. An all-zero
    block gets the smallest scale (2^-127)."""
    if w.dim() < 2 or w.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"mxfp4_quantize: need [..., N, K] with K a multiple of {MXFP4_GROUP}, got {tuple(w.shape)}")
    _check_finite(w, "mxfp4_quantize")
    blocks = w.float().unflatten(-1, (-1, MXFP4_GROUP))
    block_amax = blocks.abs().amax(dim=-1)
    # frexp gives amax = m * 2^e with m in [0.5, 1): floor(log2(amax)) = e - 1, exactly.
    _, e = torch.frexp(block_amax)
    exp = torch.where(block_amax > 0, e - 1 - 2, torch.full_like(e, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = torch.ldexp(blocks, (-exp).unsqueeze(-1).to(torch.float32))
    scale = (exp + E8M0_BIAS).to(torch.uint8)
    return pack_fp4(float_to_fp4_codes(scaled.flatten(-2))), scale


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 (uint8) -> float32 2^(s - 127); 255 is NaN, as the OCP spec defines it."""
    s = scale.to(torch.int32)
    out = torch.ldexp(torch.ones_like(s, dtype=torch.float32), (s - E8M0_BIAS).to(torch.float32))
    return torch.where(s == E8M0_NAN, torch.nan, out)


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """value = e2m1 * 2^(scale[..., n, k // 32] - 127)."""
    _check_groups(packed, scale, MXFP4_GROUP, "mxfp4_dequantize")
    if scale.dtype != torch.uint8:
        raise ValueError(f"mxfp4_dequantize: scale must be uint8 (E8M0), got {scale.dtype}")
    vals = fp4_codes_to_float(unpack_fp4(packed)) * _expand_groups(e8m0_to_float(scale), MXFP4_GROUP)
    return vals.to(dtype)


def fp4_dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float | None,
    fmt: FP4Format,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Either format by name; MXFP4 takes no global scale."""
    if fmt == "nvfp4":
        if global_scale is None:
            raise ValueError("fp4_dequantize: nvfp4 needs a global scale")
        return nvfp4_dequantize(packed, scale, global_scale, dtype)
    if fmt == "mxfp4":
        if global_scale is not None:
            raise ValueError("fp4_dequantize: mxfp4 takes no global scale")
        return mxfp4_dequantize(packed, scale, dtype)
    raise ValueError(f"fp4_dequantize: fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")


def fp4_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float | None,
    fmt: FP4Format,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(packed [N, K/2]).T (+ bias) -> [M, N] in x's dtype; dequantize, then matmul in fp32."""
    w = fp4_dequantize(packed, scale, global_scale, fmt)
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"fp4_linear_reference: x has K = {x.shape[-1]}, the weight has K = {w.shape[-1]}")
    out = x.float() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
