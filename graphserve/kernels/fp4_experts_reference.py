"""Plain-PyTorch FP4 routed experts: the CPU path of layers/quant/fp4_moe.py and the reference of
kernels/fp4_moe.fp4_fused_experts (same arguments).

Weights (kernels/fp4_reference.py): w13 uint8 [E, 2I, H/2] (gate rows, then up rows), w2 uint8 [E, H, I/2], group
scales [E, N, K/G]; NVFP4 globals float32 [E, 2] for w13 (gate's, up's) and [E, 1] for w2, or one per row
([E, 2I], [E, H]), None for MXFP4.
Activations: ``silu`` (silu(gate) * up) or gpt-oss's ``swiglu_oai`` (gate = min(gate, limit); up = clamp(up, -limit,
limit); (up + 1) * gate * sigmoid(alpha * gate)); ``w13_bias`` [E, 2I] joins gate/up before the activation,
``w2_bias`` [E, H] each expert's down output before its routing weight. Each expert is dequantized to fp32 alone
(memory stays one expert's weights), products in fp32, the activated product and each weighted output rounded to
the activations' dtype as the unquantized reference (kernels/moe_reference.py) rounds them. ``variant="fp8"``
(the grouped GEMM's W4A8 variant) also rounds each input of the two GEMMs to e4m3 with one scale a row, amax / 448,
as that variant's inputs are: x per token before gate_up, the activation per pair before down.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphserve.kernels.fp4_reference import fp4_dequantize
from graphserve.kernels.moe_reference import routed_pairs

ACTIVATIONS = ("silu", "swiglu_oai", "silu_clamp")


def fp4_activation(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """fp32 [rows, 2I] -> fp32 [rows, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "silu_clamp":  # DeepSeek-V4
        return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)
    raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")


def fp4_fused_experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w13_global: torch.Tensor | None, w2: torch.Tensor,
    w2_scale: torch.Tensor, w2_global: torch.Tensor | None, fmt: str, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, *, valid: torch.Tensor | None = None, expert_start: int = 0,
    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None, activation: str = "silu",
    alpha: float = 1.702, limit: float = 7.0, variant: str = "bf16",
) -> torch.Tensor:  # fmt: skip
    """sum over slots of weight * (down(act(gate_up(x) + b13)) + b2) over this rank's experts, [T, H] in x's
    dtype."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
    if variant not in ("bf16", "fp8"):
        raise ValueError(f"variant={variant!r} is not one of ('bf16', 'fp8')")
    t, h = x.shape
    k = topk_ids.shape[1]
    routed = routed_pairs(topk_ids, valid, expert_start, w13.shape[0])
    local = topk_ids.reshape(-1).long() - expert_start
    out = torch.zeros(t * k, h, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        pairs = torch.nonzero(routed & (local == e)).flatten()
        if pairs.numel() == 0:
            continue
        d13 = fp4_dequantize(w13[e], w13_scale[e], None if w13_global is None else w13_global[e], fmt)
        g2 = None if w2_global is None else w2_global[e] if w2_global.shape[-1] > 1 else w2_global[e].reshape(())
        d2 = fp4_dequantize(w2[e], w2_scale[e], g2, fmt)
        gate_up = _rounded(x[pairs // k], variant) @ d13.T
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e].float()
        act = fp4_activation(gate_up.to(x.dtype).float(), activation, alpha, limit).to(x.dtype).float()
        down = _rounded(act, variant) @ d2.T
        if w2_bias is not None:
            down = down + w2_bias[e].float()
        out[pairs] = (down * topk_weights.reshape(-1)[pairs].float()[:, None]).to(x.dtype).float()
    return out.view(t, k, h).sum(dim=1).to(x.dtype)


def _rounded(rows: torch.Tensor, variant: str) -> torch.Tensor:
    """fp32 ``rows``, through e4m3 with one scale a row under the fp8 variant."""
    if variant != "fp8":
        return rows.float()
    from graphserve.kernels.fp8_quant import per_token_group_quant_reference  # Triton only where the variant is

    q, scale = per_token_group_quant_reference(rows, rows.shape[1])
    return q.float() * scale
