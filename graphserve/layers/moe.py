"""The mixture-of-experts layer: a router picks k experts per token, the experts' gated MLPs run fused.

The model owns the gate projection (router logits) and any shared expert; this layer owns the
routed experts' stacked weights and turns ``(hidden [T, H], router_logits [T, E])`` into the
routed experts' weighted sum. A router is a routing mode: it maps fp32 logits to
``(topk_weights fp32 [T, k], topk_ids int32 [T, k])`` and the expert kernels see only those, so a
new mode (DeepSeek's grouped sigmoid top-k is one) never touches the kernels.

On CUDA the experts run through kernels/moe_fused.py (routing, sort/align and grouped GEMM
kernels, no host sync, CUDA-graph safe); elsewhere through the PyTorch reference of
kernels/moe_reference.py.
"""

from __future__ import annotations

import torch
from torch import nn

from graphserve.distributed.state import get_parallel
from graphserve.errors import ModelLoadError
from graphserve.kernels.moe_reference import (
    ACTIVATIONS,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    expert_counts_reference,
    experts_reference,
    grouped_sigmoid_topk_reference,
    softmax_topk_reference,
    uniform_routing,
)
from graphserve.layers.linear import RankSlice
from graphserve.layers.quant.config import DOWN_PARTS, EXPERT_PARTS, GATE_UP_PARTS

ROUTING_OVERRIDES = (None, "uniform")


class Router(nn.Module):
    """A routing mode: fp32 router logits [T, E] -> (weights fp32 [T, k], expert ids int32 [T, k])."""

    scoring_func: str = ""

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ModelLoadError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        self.num_experts = num_experts
        self.top_k = top_k

    def forward(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError  # every mode below defines it; the base class is never built


class SoftmaxTopK(Router):
    """softmax over all experts in fp32, the k largest, optionally renormalised to sum to 1.

    Mixtral always renormalises; Qwen2/3-MoE and OLMoE follow ``norm_topk_prob``.
    """

    scoring_func = "softmax"

    def __init__(self, num_experts: int, top_k: int, renormalize: bool):
        super().__init__(num_experts, top_k)
        self.renormalize = renormalize

    def forward(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if router_logits.is_cuda:
            from graphserve.kernels.moe_routing import moe_softmax_topk

            return moe_softmax_topk(router_logits, self.top_k, self.renormalize)
        return softmax_topk_reference(router_logits, self.top_k, self.renormalize)


class GroupedSigmoidTopK(Router):
    """DeepSeek-V3's routing: sigmoid scores, ``e_score_correction_bias`` for the choice only,
    top-k among the ``topk_group`` best of ``n_group`` expert groups, ``routed_scaling_factor``."""

    scoring_func = "sigmoid"

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        renormalize: bool,
        routed_scaling_factor: float,
    ):
        super().__init__(num_experts, top_k)
        if n_group <= 0 or num_experts % n_group:
            raise ModelLoadError(f"n_group={n_group} must divide n_routed_experts={num_experts}")
        if not 0 < topk_group <= n_group:
            raise ModelLoadError(f"topk_group={topk_group} must be in 1..n_group={n_group}")
        if top_k > topk_group * (num_experts // n_group):
            raise ModelLoadError(
                f"num_experts_per_tok={top_k} exceeds the {topk_group * (num_experts // n_group)} experts "
                f"of topk_group={topk_group} groups"
            )
        self.n_group, self.topk_group = n_group, topk_group
        self.renormalize = renormalize
        self.routed_scaling_factor = float(routed_scaling_factor)
        # checkpoint name: mlp.gate.e_score_correction_bias
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def forward(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        route = grouped_sigmoid_topk_reference
        if router_logits.is_cuda:
            from graphserve.kernels.moe_routing import moe_grouped_topk as route
        return route(
            router_logits, self.top_k, self.e_score_correction_bias, self.n_group, self.topk_group,
            self.renormalize, self.routed_scaling_factor,
        )  # fmt: skip


def expert_split() -> dict[str, int]:
    """This rank's share of a FusedMoE: whole experts under --ep, each expert split along its intermediate size
    under --tp. Every rank routes every token (the gate is replicated), so either way its output is a partial sum."""
    ps = get_parallel()
    if ps.ep_size > 1:
        return {"ep_rank": ps.ep_rank, "ep_size": ps.ep_size}
    return {"tp_rank": ps.tp_rank, "tp_size": ps.tp_size}


def make_router(scoring_func: str, num_experts: int, top_k: int, **options) -> Router:
    """The router a checkpoint's config asks for; an unknown ``scoring_func`` is refused by name."""
    if scoring_func == "softmax":
        return SoftmaxTopK(num_experts, top_k, renormalize=options.get("renormalize", False))
    if scoring_func == "sigmoid":
        return GroupedSigmoidTopK(num_experts, top_k, **options)
    raise ModelLoadError(f"scoring_func={scoring_func!r} is not supported; supported: 'softmax', 'sigmoid'")


class FusedMoE(nn.Module):
    """Routed experts of one layer: ``w13_weight [E_local, 2 * I_local, H]`` (gate rows, then up
    rows) and ``w2_weight [E_local, H, I_local]``.

    Tensor parallelism shards each expert's intermediate size (I_local = I / tp_size); expert
    parallelism keeps experts [ep_rank * E / ep_size, ...) and computes only the pairs routed to
    them. Either way the output is a partial sum that the caller all-reduces. FP8 experts (an FP8
    checkpoint or ``--quantization``): ``quant_method`` (layers/quant/fp8_moe.py) stores the stacks
    in fp8 with their scales and owns their loading.

    gpt-oss's experts: ``bias`` adds ``w13_bias [E_local, 2 * I_local]`` and ``w2_bias [E_local, H]`` (in the
    model dtype whatever stores the weights), ``activation="swiglu_oai"`` its clamped SwiGLU with
    ``swiglu_alpha`` and ``swiglu_limit`` (kernels/moe_reference.activation_reference). Under --tp the down
    bias is held by tensor-parallel rank 0 alone (zeros elsewhere): the ranks' outputs are summed.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        router: Router,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        ep_rank: int = 0,
        ep_size: int = 1,
        activation: str = "silu",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        bias: bool = False,
        swiglu_alpha: float = SWIGLU_ALPHA,
        swiglu_limit: float = SWIGLU_LIMIT,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ModelLoadError(f"hidden_act={activation!r} is not supported for experts; supported: "
                                 f"{', '.join(repr(a) for a in ACTIVATIONS)}")
        if not swiglu_limit > 0:
            raise ModelLoadError(f"swiglu_limit={swiglu_limit} must be positive")
        if router.num_experts != num_experts or router.top_k != top_k:
            raise ModelLoadError(
                f"router has num_experts={router.num_experts}, top_k={router.top_k}; "
                f"the layer has num_experts={num_experts}, top_k={top_k}"
            )
        if intermediate_size % tp_size:
            raise ModelLoadError(f"moe_intermediate_size={intermediate_size} is not divisible by tp_size={tp_size}")
        if num_experts % ep_size:
            raise ModelLoadError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
        for name, rank, size in (("tp_rank", tp_rank, tp_size), ("ep_rank", ep_rank, ep_size)):
            if not 0 <= rank < size:
                raise ValueError(f"{name}={rank} must be in 0..{size - 1}")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_local_experts = num_experts // ep_size
        self.expert_start = ep_rank * self.num_local_experts
        self.intermediate_local = intermediate_size // tp_size
        self.router = router
        i, e = self.intermediate_local, self.num_local_experts
        self.w13_weight = nn.Parameter(
            torch.empty(e, 2 * i, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype, device=device), requires_grad=False)
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, float(swiglu_alpha), float(swiglu_limit)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype, device=device), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(e, hidden_size, dtype=dtype, device=device), requires_grad=False)
        # pairs per global expert in the last forward, written on the device by the routing path
        # itself so it stays valid under CUDA-graph replay; padding rows are not counted
        self.register_buffer(
            "expert_counts", torch.zeros(num_experts, dtype=torch.int32, device=device), persistent=False
        )
        from graphserve.kernels.moe_gate_dot import GATE_COUNTERS

        # the fused gate kernels' done-counters (kernels/moe_gate.py), one per row block: zero between launches
        self.register_buffer(
            "gate_counters", torch.zeros(GATE_COUNTERS, dtype=torch.int32, device=device), persistent=False
        )
        self.routing_override: str | None = None
        self.use_kernels: bool | None = None  # None: the fused kernels exactly when the input is on CUDA
        self._quant_groups: dict[tuple[int, torch.device], int | None] = {}  # _hidden_quant_group's answers
        self._prefetches: dict[tuple[int, torch.device], bool] = {}  # _prefetch_target's answers
        # the projection the step reads after these experts (the next layer's qkv; a tuple, so no submodule): the
        # slot-sum launch asks L2 for its weight's first bytes (kernels/l2_prefetch.py)
        self.read_next: tuple[nn.Module, ...] = ()
        # layers/quant/fp8_moe.Fp8MoEMethod when the experts are stored in fp8: it owns their loading
        self.quant_method = None

    def rebuild(self, device: torch.device) -> None:
        """After the loader's ``to_empty``: the buffers hold garbage; the gate kernels' counters must be zero."""
        self.gate_counters.zero_()
        self.expert_counts.zero_()

    def load_expert_weight(self, param: str, expert_id: int, tensor: torch.Tensor) -> None:
        """Copy one expert's full checkpoint matrix (w1/w3 [I, H], w2 [H, I]) into this rank's slice.

        w1 is the gate projection (Qwen's gate_proj), w3 the up projection (up_proj), w2 the down
        projection (down_proj). Experts held by another rank are skipped.
        """
        if param not in EXPERT_PARTS:
            raise ModelLoadError(f"expert weight {param!r} is not one of {EXPERT_PARTS}")
        if not 0 <= expert_id < self.num_experts:
            raise ModelLoadError(f"expert index {expert_id} is out of range for num_experts={self.num_experts}")
        h, i, il = self.hidden_size, self.intermediate_size, self.intermediate_local
        expected = (h, i) if param == "w2" else (i, h)
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(
                f"expert {expert_id} {param}: checkpoint shape {tuple(tensor.shape)} does not match the config's "
                f"{expected} (hidden_size={h}, intermediate_size={i})"
            )
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        part = self.rank_slice(param)
        tensor = part.take(tensor) if part is not None else tensor
        with torch.no_grad():
            if param == "w2":
                self.w2_weight[local].copy_(tensor)
            else:
                rows = slice(0, il) if param == "w1" else slice(il, 2 * il)
                self.w13_weight[local, rows].copy_(tensor)

    def rank_slice(self, part: str) -> RankSlice | None:
        """This rank's part of an expert's checkpoint matrix ``part`` under tensor parallelism: rows of w1/w3
        ``[I, H]``, columns of w2 ``[H, I]`` (None at tp 1: whole)."""
        if self.tp_size == 1:
            return None
        il = self.intermediate_local
        return RankSlice(0 if part in GATE_UP_PARTS else 1, self.tp_rank * il, il)

    # ---- the model loader's protocol (models/base.py): one shard per (expert, part) ----------------
    def weight_shards(self, param_name: str) -> list[tuple[int, str]]:
        experts = range(self.expert_start, self.expert_start + self.num_local_experts)
        parts = DOWN_PARTS if param_name.startswith("w2_") else GATE_UP_PARTS  # w2_weight and its fp8 scales
        return [(e, part) for e in experts for part in parts]

    def load_expert_bias(self, part: str, expert_id: int, tensor: torch.Tensor) -> bool:
        """Copy one expert's checkpoint bias (w1/w3 [I], w2 [H]) into this rank's slice; False when the expert
        lives on another rank."""
        if part not in EXPERT_PARTS or self.w13_bias is None:
            raise ModelLoadError(f"expert bias {part!r} has no place: these experts have "
                                 f"{'biases w1, w3, w2' if self.w13_bias is not None else 'no biases'}")
        if not 0 <= expert_id < self.num_experts:
            raise ModelLoadError(f"expert index {expert_id} is out of range for num_experts={self.num_experts}")
        expected = (self.hidden_size if part == "w2" else self.intermediate_size,)
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"expert {expert_id} {part} bias: checkpoint shape {tuple(tensor.shape)} does not "
                                 f"match the config's {expected}")
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return False
        il = self.intermediate_local
        with torch.no_grad():
            if part == "w2":  # added once to the ranks' sum
                self.w2_bias[local].copy_(tensor if self.tp_rank == 0 else torch.zeros_like(tensor))
            else:
                part_slice = self.rank_slice(part)
                rows = slice(0, il) if part == "w1" else slice(il, 2 * il)
                self.w13_bias[local, rows].copy_(part_slice.take(tensor) if part_slice is not None else tensor)
        return True

    def load_weight(self, param_name: str, param: nn.Parameter, tensor: torch.Tensor, shard: tuple[int, str]) -> bool:
        """Place one expert's checkpoint matrix; False when the expert lives on another rank."""
        if param_name in ("w13_bias", "w2_bias"):  # the model dtype, whatever stores the weights
            expert, part = shard
            if (part == "w2") != (param_name == "w2_bias"):
                raise ValueError(f"expert part {part!r} does not belong in {param_name}")
            return self.load_expert_bias(part, expert, tensor)
        if self.quant_method is not None:
            return self.quant_method.load_weight(self, param_name, tensor, shard)
        expert, part = shard
        if (part == "w2") != (param_name == "w2_weight"):
            raise ValueError(f"expert part {part!r} does not belong in {param_name}")
        self.load_expert_weight(part, expert, tensor)
        return self.expert_start <= expert < self.expert_start + self.num_local_experts

    def workspace_bytes(self, num_tokens: int) -> int:
        """Device memory one forward of ``num_tokens`` rows allocates on the fused path (for the start-up plan)."""
        from graphserve.kernels.moe_fused import moe_workspace_bytes

        return moe_workspace_bytes(
            num_tokens, self.top_k, self.num_local_experts, self.intermediate_local, self.hidden_size,
            self.act_dtype, fp8_group_k=self.fp8_group_k,
        )  # fmt: skip

    @property
    def act_dtype(self) -> torch.dtype:
        """The activations' dtype: the experts' own, or the model's where they are stored in fp8."""
        return self.w13_weight.dtype if self.quant_method is None else self.quant_method.act_dtype

    @property
    def fp8_group_k(self) -> int:
        """The fp8 scale block's K (the hidden size per channel), 0 for unquantized experts."""
        if self.quant_method is None or not hasattr(self.quant_method, "block"):  # FP4 reads bf16 activations
            return 0
        return self.quant_method.block[1] if self.quant_method.block else self.hidden_size


    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.routing_override not in ROUTING_OVERRIDES:
            raise ValueError(f"routing_override={self.routing_override!r} must be one of {ROUTING_OVERRIDES}")
        if self.routing_override == "uniform":
            return uniform_routing(router_logits.shape[0], self.top_k, self.num_experts, router_logits.device)
        return self.router(router_logits)

    def forward(
        self, hidden: torch.Tensor, router_logits: torch.Tensor, valid: torch.Tensor | None = None,
        hidden_q: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The routed experts' weighted sum [T, H] for hidden [T, H] and router logits [T, E].

        ``valid`` marks real rows when the batch is padded (CUDA-graph sizes): a bool mask [T], or
        the number of real rows as an integer tensor on the device. Padding rows route nowhere,
        cost nothing, are not counted, and come out as zeros. ``hidden_q``: hidden already quantized as
        ``_hidden_quant_group`` says, by the launch that made it (kernels/moe_fused.fused_experts' ``hidden_q``).
        """
        t = hidden.shape[0]
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [T, {self.hidden_size}], got {tuple(hidden.shape)}")
        if router_logits.shape != (t, self.num_experts):
            raise ValueError(f"router_logits must be [{t}, {self.num_experts}], got {tuple(router_logits.shape)}")
        return self._experts(hidden, *self.route(router_logits), valid, hidden_q)

    def forward_gate(self, hidden: torch.Tensor, gate: nn.Linear, valid: torch.Tensor | None = None,
                     hidden_q: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """``forward(hidden, gate(hidden), valid)``, with the gate projection and the routing in one
        launch (kernels/moe_gate.py) where it applies: decode-sized batches on the kernel path (up to
        MAX_ROWS rows, up to DOT_MAX_ROWS in 16 bits), softmax top-k routing, a gate without bias.
        ``gate`` keeps the checkpoint's weight. ``hidden_q``: hidden quantized as ``_hidden_quant_group`` said
        (fused_experts' ``hidden_q``)."""
        if self._gate_fusable(hidden, gate):
            from graphserve.kernels.moe_gate import moe_gate_softmax_topk

            routing = moe_gate_softmax_topk(hidden, gate.weight, self.top_k, self.router.renormalize,
                                            self.gate_counters, prefetch=self._prefetch_target(hidden))  # fmt: skip
            return self._experts(hidden, *routing, valid, hidden_q)
        return self.forward(hidden, gate(hidden), valid, hidden_q)

    def forward_add_norm_gate(
        self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, gate: nn.Linear, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(forward_gate(h, gate, valid), h, x + residual)`` with ``h = norm(x + residual)``: a decoder
        layer's post-attention residual add and RMSNorm (``norm``, layers/norm.RMSNorm) ahead of the routed
        experts. Where ``forward_gate`` fuses its gate, the add and the norm join that launch too
        (``h`` is what the router and any shared expert read); otherwise the norm runs first, in the launch that
        quantizes ``h`` for the experts where they would quantize it by a launch of their own (W8A8 fp8 experts,
        kernels/fp8_quant.norm_group_quant_keep), else on its own."""
        from graphserve.kernels.moe_gate import ADD_NORM_MAX_ROWS, moe_add_norm_gate_softmax_topk

        if (x.shape[0] <= ADD_NORM_MAX_ROWS and self._gate_fusable(x, gate) and residual.shape == x.shape
                and residual.dtype == x.dtype):  # fmt: skip
            weights, ids, hidden, summed = moe_add_norm_gate_softmax_topk(
                x, residual, norm.weight, norm.eps, gate.weight, self.top_k, self.router.renormalize,
                self.gate_counters,
            )  # fmt: skip
            return self._experts(hidden, weights, ids, valid), hidden, summed
        group = self._hidden_quant_group(x)
        if group is not None and residual.shape == x.shape and residual.dtype == x.dtype:
            from graphserve.kernels.fp8_quant import norm_group_quant_keep

            hidden, q, scales, residual = norm_group_quant_keep(x, norm.weight, norm.eps, group, residual)
            return self.forward_gate(hidden, gate, valid, hidden_q=(q, scales)), hidden, residual
        hidden, residual = norm(x, residual)
        return self.forward_gate(hidden, gate, valid), hidden, residual

    def _hidden_quant_group(self, x: torch.Tensor) -> int | None:
        """The group size in which the experts would quantize a call of ``x``'s rows by a launch of their own
        (kernels/moe_fused.hidden_quant_group), None where they would not or the call takes no kernels. A
        function of the row count and the device alone once the weights are loaded: asked once each, as every
        layer asks it every eager step."""
        use_kernels = x.is_cuda if self.use_kernels is None else self.use_kernels
        if not use_kernels or self.quant_method is None or x.dim() != 2 or x.stride(-1) != 1:
            return None
        if hasattr(self.quant_method, "apply_experts"):  # FP4 experts read the activations unquantized
            return None
        key = (x.shape[0], x.device)
        if key not in self._quant_groups:
            from graphserve.kernels.moe_fused import hidden_quant_group

            self._quant_groups[key] = hidden_quant_group(x.shape[0], self.top_k, self.w13_weight, self.w2_weight,
                                                         **self.quant_method.kernel_args(self))  # fmt: skip
        return self._quant_groups[key]

    def _prefetch_target(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The weight whose first bytes the gate launch asks L2 for (kernels/l2_prefetch.py): ``w13`` where a call
        of ``hidden``'s rows runs the grouped GEMM and touches nearly every local expert, so the lowest ones the
        GEMM reads first are almost surely read; None elsewhere. A function of the row count and device alone."""
        if hasattr(self.quant_method, "apply_experts"):  # FP4 experts: their own kernels, no prefetch link
            return None
        key = (hidden.shape[0], hidden.device)
        if key not in self._prefetches:
            from graphserve.kernels.l2_prefetch import worth_prefetching
            from graphserve.kernels.moe_fused import runs_grouped_gemm

            self._prefetches[key] = (runs_grouped_gemm(hidden.shape[0], self.top_k, self.w13_weight, self.w2_weight)
                                     and worth_prefetching(hidden.shape[0], self.top_k, self.num_experts))  # fmt: skip
        return self.w13_weight if self._prefetches[key] else None

    def _gate_fusable(self, hidden: torch.Tensor, gate: nn.Linear) -> bool:
        use_kernels = hidden.is_cuda if self.use_kernels is None else self.use_kernels
        if not (use_kernels and self.routing_override is None and isinstance(self.router, SoftmaxTopK)
                and gate.bias is None and hidden.dim() == 2 and hidden.shape[1] == self.hidden_size):  # fmt: skip
            return False
        from graphserve.kernels.moe_gate import gate_fusable

        return gate_fusable(hidden, gate.weight) and gate.weight.shape[0] == self.num_experts

    def _experts(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, valid: torch.Tensor | None,
        hidden_q: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        valid = _valid_mask(valid, hidden.shape[0], hidden.device)
        use_kernels = hidden.is_cuda if self.use_kernels is None else self.use_kernels
        apply = getattr(self.quant_method, "apply_experts", None)  # FP4: layers/quant/fp4_moe.py
        if apply is not None:
            return apply(self, hidden, topk_weights, topk_ids, valid, use_kernels)
        if use_kernels:
            from graphserve.kernels.moe_fused import fused_experts

            quant = self.quant_method.kernel_args(self) if self.quant_method is not None else {}
            return fused_experts(
                hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                valid=valid, expert_start=self.expert_start, counts=self.expert_counts, hidden_q=hidden_q, **quant,
                read_next=self.read_next[0].weight if self.read_next else None, **self._epilogue(),
            )  # fmt: skip
        self.expert_counts.copy_(expert_counts_reference(topk_ids, valid, self.num_experts))
        w13, w2 = self.w13_weight, self.w2_weight
        if self.quant_method is not None:  # the CPU path: dequantize, then the model-dtype experts
            w13, w2 = self.quant_method.dequantized(self, hidden.dtype)
        return experts_reference(hidden, w13, w2, topk_weights, topk_ids, valid, self.expert_start,
                                 **self._epilogue())

    def _epilogue(self) -> dict:
        """The experts' biases and activation, as fused_experts and experts_reference take them (nothing for
        the plain SiLU experts, whose calls stay as they were)."""
        if self.activation == "silu" and self.w13_bias is None:
            return {}
        return {"w13_bias": self.w13_bias, "w2_bias": self.w2_bias, "activation": self.activation,
                "alpha": self.swiglu_alpha, "limit": self.swiglu_limit}


def _valid_mask(valid: torch.Tensor | None, num_rows: int, device: torch.device) -> torch.Tensor | None:
    if valid is None:
        return None
    if valid.dtype == torch.bool:
        if valid.shape != (num_rows,):
            raise ValueError(f"valid mask must be bool [{num_rows}], got {tuple(valid.shape)}")
        return valid
    if valid.numel() != 1 or valid.is_floating_point():
        raise ValueError(
            f"valid must be a bool mask [{num_rows}] or one integer count, got {valid.dtype} {tuple(valid.shape)}"
        )
    # a device-side comparison, not .item(): the count lives on the GPU during graph replay
    return torch.arange(num_rows, device=device) < valid.reshape(())
