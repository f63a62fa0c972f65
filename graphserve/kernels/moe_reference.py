"""Plain-PyTorch mixture-of-experts: routing, sort/align and the experts' gated MLP.

These are the CPU path of layers/moe.py and the references every MoE kernel is tested against.
Numerics follow the fused kernels: fp32 routing; each expert's gate and up projections accumulate
in fp32 and are rounded to the activation dtype, ``silu(gate) * up`` is computed in fp32 and
rounded; the down projection accumulates in fp32, is multiplied by the fp32 routing weight and
rounded per (token, slot) pair; the k pairs of a token are summed in fp32. (The small-batch
streaming kernels skip the per-pair rounding: they sum the slots in fp32 and round once.) In fp32
this is transformers' Qwen3-MoE/Mixtral/OLMoE/Qwen2-MoE expert computation exactly.

gpt-oss's experts add two things, both optional here: biases (``w13_bias [E, 2I]`` added to the gate/up
accumulators before they are rounded, ``w2_bias [E, H]`` to the down accumulator before the routing weight)
and the ``swiglu_oai`` activation (``activation_reference``), on gate/up rows already de-interleaved into
[gate rows; up rows] at load. In fp32 that is transformers' ``GptOssExperts`` exactly.

A (token, slot) pair p = t * top_k + s is *routed* when token t is valid (not a padding row of a
CUDA-graph batch) and its expert lies in this rank's range [expert_start, expert_start + E_local).
Pairs that are not routed contribute nothing and are not counted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softmax_topk_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int32 [T, k]) of softmax(logits) in fp32, as transformers routes."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def grouped_sigmoid_topk_reference(
    logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing: sigmoid scores; experts chosen by score + bias within the best groups.

    Experts fall into ``n_group`` equal groups; a group's merit is the sum of its two best biased
    scores; only the ``topk_group`` best groups compete for the top-k. The weights are the
    *unbiased* sigmoid scores of the chosen experts, renormalised if asked, times
    ``routed_scaling_factor``. Pure tensor ops, no host sync, so it runs inside CUDA graphs too.
    """
    t, e = logits.shape
    scores = torch.sigmoid(logits.float())
    biased = scores + correction_bias.float()[None, :]
    grouped = biased.view(t, n_group, e // n_group)
    group_merit = grouped.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)
    best_groups = group_merit.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_merit).scatter_(1, best_groups, 1.0)
    expert_mask = group_mask[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)
    ids = biased.masked_fill(expert_mask == 0, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def uniform_routing(
    num_tokens: int, top_k: int, num_experts: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-robin routing for benchmarks: pair p = t * k + s goes to expert p % E, each weighted 1/k."""
    ids = (torch.arange(num_tokens * top_k, device=device, dtype=torch.int32) % num_experts).view(num_tokens, top_k)
    weights = torch.full((num_tokens, top_k), 1.0 / top_k, device=device, dtype=torch.float32)
    return weights, ids


def routed_pairs(topk_ids: torch.Tensor, valid: torch.Tensor | None, expert_start: int, num_local: int) -> torch.Tensor:
    """bool [T * k]: which pairs this rank computes (valid token, expert in the local range)."""
    local = topk_ids.long() - expert_start
    routed = (local >= 0) & (local < num_local)
    if valid is not None:
        routed &= valid[:, None]
    return routed.reshape(-1)


def expert_counts_reference(topk_ids: torch.Tensor, valid: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """int32 [E]: (token, slot) pairs per global expert, padding rows excluded."""
    ones = torch.ones_like(topk_ids, dtype=torch.int32)
    if valid is not None:
        ones = ones * valid[:, None].to(torch.int32)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=topk_ids.device)
    return counts.scatter_add_(0, topk_ids.reshape(-1).long(), ones.reshape(-1))


def moe_align_reference(
    topk_ids: torch.Tensor, valid: torch.Tensor | None, expert_start: int, num_local: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The sort the grouped GEMM reads: (sorted pair ids, expert per block, padded pair count).

    Pairs of local expert e occupy a run starting at a multiple of ``block_m``, in pair order,
    padded with the sentinel T * k up to the next multiple. Buffers are sized for the worst case
    T * k + E_local * (block_m - 1); blocks past the padded count get expert -1.
    """
    num_pairs = topk_ids.numel()
    max_padded = num_pairs + num_local * (block_m - 1)
    max_blocks = -(-max_padded // block_m)
    sorted_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32)
    expert_ids = torch.full((max_blocks,), -1, dtype=torch.int32)
    routed = routed_pairs(topk_ids.cpu(), None if valid is None else valid.cpu(), expert_start, num_local)
    local = topk_ids.reshape(-1).cpu().long() - expert_start
    pos = 0
    for e in range(num_local):
        pairs = torch.nonzero(routed & (local == e)).flatten()
        n_blocks = -(-pairs.numel() // block_m)
        sorted_ids[pos : pos + pairs.numel()] = pairs.to(torch.int32)
        expert_ids[pos // block_m : pos // block_m + n_blocks] = e
        pos += n_blocks * block_m
    return sorted_ids, expert_ids, pos


ACTIVATIONS = ("silu", "swiglu_oai", "silu_clamp")
KERNEL_ACTIVATIONS = ACTIVATIONS  # those the Triton expert kernels build (moe_gemm's ACT, fp4_moe's), all of them
SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid slope (transformers GptOssExperts.alpha)
SWIGLU_LIMIT = 7.0  # its clamp (config.json swiglu_limit)


def _silu_mul(gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    gate, up = gate_up.to(dtype).float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(dtype)


def activation_reference(gate_up: torch.Tensor, dtype: torch.dtype, activation: str = "silu",
                         alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """The gated activation of ``gate_up [..., 2I]`` ([gate; up] along the last dim), gate and up rounded to
    ``dtype`` first, the product computed in fp32 and rounded to ``dtype``.

    ``silu``: silu(gate) * up. ``swiglu_oai`` (gpt-oss): gate clamped above at ``limit``, up to +-``limit``,
    (up + 1) * gate * sigmoid(alpha * gate). ``silu_clamp`` (DeepSeek-V4): silu(gate) * up clamped alike."""
    if activation == "silu":
        return _silu_mul(gate_up, dtype)
    if activation == "silu_clamp":
        gate, up = gate_up.to(dtype).float().chunk(2, dim=-1)
        return (F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)).to(dtype)
    if activation != "swiglu_oai":
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
    gate, up = gate_up.to(dtype).float().chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return ((up + 1) * gate * torch.sigmoid(alpha * gate)).to(dtype)


def experts_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
    expert_start: int = 0,
    pairs_per_chunk: int | None = None,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = SWIGLU_ALPHA,
    limit: float = SWIGLU_LIMIT,
) -> torch.Tensor:
    """sum over slots of weight * down(act(gate(x), up(x))) for each token's routed experts.

    Vectorised over pairs: each routed pair gathers its expert's weights and the pairs go through
    one batched matmul, ``pairs_per_chunk`` at a time (by default as many as keep the gathered
    fp32 weights near 256 MiB) so memory stays bounded at any batch. ``w13_bias [E_local, 2I]`` /
    ``w2_bias [E_local, H]``: added to gate/up and to down's output (before the routing weight).
    """
    if pairs_per_chunk is None:
        pairs_per_chunk = max(1, min(256, (64 << 20) // (w13[0].numel() + w2[0].numel())))
    t, h = hidden.shape
    k = topk_ids.shape[1]
    num_local = w13.shape[0]
    routed = routed_pairs(topk_ids, valid, expert_start, num_local)
    pair_ids = torch.arange(t * k, device=hidden.device)[routed]
    experts = topk_ids.reshape(-1).long()[pair_ids] - expert_start
    rows = hidden[pair_ids // k].float()
    out = torch.zeros(t * k, h, dtype=torch.float32, device=hidden.device)
    for c in range(0, pair_ids.numel(), pairs_per_chunk):
        e = experts[c : c + pairs_per_chunk]
        x = rows[c : c + pairs_per_chunk, :, None]
        gate_up = torch.bmm(w13[e].float(), x)[..., 0]
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e].float()
        act = activation_reference(gate_up, hidden.dtype, activation, alpha, limit)
        down = torch.bmm(w2[e].float(), act.float()[..., None])[..., 0]
        if w2_bias is not None:
            down = down + w2_bias[e].float()
        w = topk_weights.reshape(-1)[pair_ids[c : c + pairs_per_chunk]].float()
        out[pair_ids[c : c + pairs_per_chunk]] = (down * w[:, None]).to(hidden.dtype).float()
    return out.view(t, k, h).sum(dim=1).to(hidden.dtype)


def experts_loop_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The plain PyTorch loop over experts (transformers' eager form): the benchmarks' baseline.

    One gather, three matmuls and an index_add per expert that received a pair; the list of those
    experts is read on the host, so this path cannot be captured in a CUDA graph.
    """
    t, h = hidden.shape
    k = topk_ids.shape[1]
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids.long(), minlength=w13.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // k
        gate_up = hidden[tokens] @ w13[e].T
        act = _silu_mul(gate_up, hidden.dtype)
        down = (act @ w2[e].T).float() * topk_weights.reshape(-1)[pairs, None]
        out.index_add_(0, tokens, down)
    return out.to(hidden.dtype)
