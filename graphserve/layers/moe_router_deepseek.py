"""DeepSeek-V2's routing modes: softmax scores, top-k (``greedy``) or top-k inside the ``topk_group``
best of ``n_group`` expert groups (``group_limited_greedy``), weights times ``routed_scaling_factor``.

(DeepSeek-V3's sigmoid routing with ``e_score_correction_bias`` is layers/moe.GroupedSigmoidTopK.)
Pure tensor ops with no host sync, so the same code runs inside CUDA graphs; on CUDA the greedy mode
takes the MoE layer's one-launch softmax top-k kernel (kernels/moe_routing.py), the group-limited
mode stays a few small ops per layer on a [T, 64..160] score matrix.

The DeepSeek model itself routes ``greedy`` through layers/moe.SoftmaxTopK instead, so that the MoE
layer can fuse it with the gate projection and the post-attention norm (models/deepseek.DeepseekMoE
scales the routed output); this router serves ``group_limited_greedy``, and ``greedy`` for callers
that want the scaled weights themselves.
"""

from __future__ import annotations

import torch

from graphserve.errors import ModelLoadError
from graphserve.layers.moe import Router


def softmax_group_topk_reference(
    logits: torch.Tensor, top_k: int, n_group: int, topk_group: int, routed_scaling_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], ids int32 [T, k]) as transformers' DeepseekV2TopkRouter computes them.

    A group scores as its best expert; experts outside the chosen groups score 0 (not -inf, as in
    the reference: with k larger than the experts of the chosen groups a zero-weight expert is picked).
    ``n_group == 1`` is plain greedy top-k.
    """
    scores = logits.float().softmax(dim=-1)
    if n_group > 1:
        t, e = scores.shape
        grouped = scores.view(t, n_group, e // n_group)
        chosen = grouped.amax(dim=-1).topk(topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros(t, n_group, dtype=torch.bool, device=scores.device).scatter_(1, chosen, True)
        scores = scores.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(t, e), 0.0)
    weights, ids = scores.topk(top_k, dim=-1, sorted=False)
    return weights * routed_scaling_factor, ids.to(torch.int32)


class SoftmaxGroupTopK(Router):
    scoring_func = "softmax"

    def __init__(self, num_experts: int, top_k: int, n_group: int, topk_group: int, routed_scaling_factor: float):
        super().__init__(num_experts, top_k)
        if n_group < 1 or num_experts % n_group:
            raise ModelLoadError(f"n_group={n_group} must divide n_routed_experts={num_experts}")
        if not 0 < topk_group <= n_group:
            raise ModelLoadError(f"topk_group={topk_group} must be in 1..n_group={n_group}")
        if top_k > topk_group * (num_experts // n_group):
            raise ModelLoadError(f"num_experts_per_tok={top_k} exceeds the {topk_group * (num_experts // n_group)} "
                                 f"experts of topk_group={topk_group} groups")
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)

    def forward(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if router_logits.is_cuda and self.n_group == 1:  # greedy (V2-Lite): the one-launch routing kernel
            from graphserve.kernels.moe_routing import moe_softmax_topk

            weights, ids = moe_softmax_topk(router_logits, self.top_k, False)
            return (weights if self.routed_scaling_factor == 1.0 else weights * self.routed_scaling_factor), ids
        return softmax_group_topk_reference(router_logits, self.top_k, self.n_group, self.topk_group,
                                            self.routed_scaling_factor)
