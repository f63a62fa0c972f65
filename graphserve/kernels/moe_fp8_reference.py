"""Plain-PyTorch FP8 experts: dequantize the stacked fp8 weights, then the model-dtype experts.

The CPU path of FP8 MoE layers (layers/quant/fp8_moe.py) and the references the FP8 expert
kernels (kernels/moe_fused.py) are tested against. Scale layout (fp32, ``x ~= q * scale``):
block ``(bn, bk)``: w13 ``[E, 2 * ceil(I / bn), ceil(H / bk)]`` (gate's row blocks, then up's, as the
checkpoints store gate_proj and up_proj apart), w2 ``[E, ceil(H / bn), ceil(I / bk)]``; per output
channel: w13 ``[E, 2I, 1]``, w2 ``[E, H, 1]``.
"""

from __future__ import annotations

import torch

from graphserve.kernels.fp8_quant import dequantize_blocks, per_token_group_quant_reference, static_quant_reference
from graphserve.kernels.moe_reference import _silu_mul, routed_pairs


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                       parts: int = 1) -> torch.Tensor:  # fmt: skip
    """fp32 ``[E, N, K]`` from fp8 ``w`` and its scales; ``parts`` 2 for w13 (gate and up blocked apart)."""
    if block is None:
        return w.float() * scale.float()
    rows = w.shape[1] // parts
    out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    scale_rows = scale.shape[1] // parts
    for e in range(w.shape[0]):
        for p in range(parts):
            sl, ss = slice(p * rows, (p + 1) * rows), slice(p * scale_rows, (p + 1) * scale_rows)
            out[e, sl] = dequantize_blocks(w[e, sl], scale[e, ss], *block)
    return out


def _quant_dequant(x: torch.Tensor, group_k: int, static: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x`` after per-token-group fp8 quantization, or with one ``static`` scale (what the W8A8 kernels
    multiply)."""
    if static is not None:
        return static_quant_reference(x, static).float() * static.float().reshape(())
    q, s = per_token_group_quant_reference(x, group_k)
    return dequantize_blocks(q, s, 1, group_k)


def experts_fp8_reference(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
    block: tuple[int, int] | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    valid: torch.Tensor | None = None, expert_start: int = 0, w8a8: bool | tuple[bool, bool] = False,
    input_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """The experts of moe_reference.experts_reference on the dequantized weights, one expert at a
    time (so memory stays one expert's fp32 weights at any shape); ``w8a8``: x and the activated
    product also go through per-token-group fp8 quantization (groups of the block's K, or whole
    rows per channel), as the W8A8 grouped GEMM computes; a pair (gate_up's, down's) for a call whose
    steps differ (kernels/moe_fused.quantized_steps); ``input_scales``: those steps quantize with these static
    scales instead. Reads the routing on the host."""
    static13, static2 = input_scales or (None, None)
    quant13, quant2 = (w8a8, w8a8) if isinstance(w8a8, bool) else w8a8
    t, h = hidden.shape
    k = topk_ids.shape[1]
    inter = w2.shape[2]
    gk13, gk2 = (block[1], block[1]) if block else (h, inter)
    routed = routed_pairs(topk_ids, valid, expert_start, w13.shape[0])
    local = topk_ids.reshape(-1).long() - expert_start
    out = torch.zeros(t * k, h, dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):
        pairs = torch.nonzero(routed & (local == e)).flatten()
        if pairs.numel() == 0:
            continue
        d13 = dequantize_experts(w13[e : e + 1], w13_scale[e : e + 1], block, parts=2)[0]
        d2 = dequantize_experts(w2[e : e + 1], w2_scale[e : e + 1], block)[0]
        rows = hidden[pairs // k].float()
        if quant13:
            rows = _quant_dequant(rows, gk13, static13)
        act = _silu_mul(rows @ d13.T, hidden.dtype).float()
        if quant2:
            act = _quant_dequant(act, gk2, static2)
        down = (act @ d2.T) * topk_weights.reshape(-1)[pairs].float()[:, None]
        out[pairs] = down.to(hidden.dtype).float()
    return out.view(t, k, h).sum(dim=1).to(hidden.dtype)
