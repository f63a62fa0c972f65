"""The routed experts on CUDA: sort/align, gate_up (+SiLU·mul), down (x routing weight), sum over slots.

``fused_experts`` is what layers/moe.FusedMoE calls with the router's (weights, ids). It reads
nothing back to the host: every buffer is sized from T * k, the grids cover the worst-case sort
and tiles past the padded total exit at once, so a decode step captures into a CUDA graph at any
padded batch size and replays with whatever routing the step produces. Up to the table's
``small_max_pairs`` pairs two streaming kernels replace the sort, the grouped GEMMs and the sum.
Reference: kernels/moe_reference.experts_reference.

FP8 expert weights (``w13_scale`` / ``w2_scale`` given, layout in layers/quant/fp8_moe.py) run in
one of two modes, chosen from the shape alone (so a captured graph always replays the same one):
- W8A16, the streaming path (up to the table's ``small_max_pairs``): fp8 weights widened in registers
  against model-dtype activations, per pair. At those sizes the step is the weight stream.
- W8A8, the grouped GEMM from ``W8A8_MIN_ROWS_PER_EXPERT`` pairs per local expert on average (0: every
  call): activations quantized per token group (kernels/fp8_quant.py, groups of the weight block's K) by a
  launch before each GEMM, both operands on the FP8 tensor cores. Widening instead (W8A16) converts every
  weight element of a program's tile in registers before the MMA, and at 16-row tiles that conversion, not
  the weight stream, set the time: timed as CUDA graphs on an H200 (qwen3-30b-a3b's experts, one layer,
  benchmarks/moe_fp8.py's kernel rows at 1479366), W8A8 took 0.109 / 0.148 / 0.162 / 0.288 ms at 16 / 32 /
  128 / 512 tokens where W8A16 took 0.207 / 0.312 / 0.316 / 0.418, and within 4% of it at 1024 tokens
  (0.553 against 0.533); the decode step at batch 16 and 32 took 10.2 and 10.7 ms instead of 18.4 and 19.5
  (uniform routing, ``--w8a8-rows-per-expert 0`` against 128, the rule before).
Static activation scales (a checkpoint's ``input_scale``, per-channel or per-tensor weights: ``input_scales``)
replace the per-token-group quantization of the W8A8 grouped GEMM: x and the activated product are quantized with
one fp32 scale each (kernels/fp8_quant.static_quant), read by the kernel as every row's scale. The streaming path
reads none, as the dense layers' streaming path does not.
A grouped GEMM tile with ``a8`` set (the tuned table's choice per bucket and step, block scales
only) quantizes inside the GEMM instead (kernels/moe_gemm.py's ``A_QUANT``): no quantization launch and
no fp8 copy of the activations, the same groups and rounding. A caller may still ask for W8A16
(``w8a8=False``: tests, benchmarks).
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from graphserve.kernels.fp8_quant import FP8_MAX, MIN_SCALE, TL_DTYPES, per_token_group_quant, static_quant
from graphserve.kernels.l2_prefetch import no_prefetch_args
from graphserve.kernels.l2_prefetch import plan as prefetch_plan
from graphserve.kernels.moe_align import HISTOGRAM_PAIRS, max_padded_pairs, moe_align
from graphserve.kernels.moe_config import GemmTile, GemvTile, MoeTiles, moe_tiles
from graphserve.kernels.moe_gemm import SILU, SILU_CLAMP, SWIGLU_OAI, fused_moe_gemm_kernel, moe_sum_kernel
from graphserve.kernels.moe_reference import KERNEL_ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT
from graphserve.kernels.moe_scales import ExpertScales, a8_problem, check_a8_tile, expert_scales, scale_args
from graphserve.kernels.moe_stream import fused_moe_gemv_down_kernel, fused_moe_gemv_gate_up_kernel
from graphserve.kernels.pdl import pdl_args

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PATHS = ("gemv", "gemm")
_SUM_WARPS = 4  # the slot sum's warps
FP8_DTYPE = torch.float8_e4m3fn
# average (token, slot) pairs per local expert from which the FP8 grouped GEMM quantizes its
# activations and runs W8A8: from the first (module docstring); benchmarks/moe_fp8.py times both modes per
# batch, and its --w8a8-rows-per-expert runs the decode steps under another value
W8A8_MIN_ROWS_PER_EXPERT = 0


def _check_epilogue(hidden, w13, w2, w13_bias, w2_bias, activation: str) -> None:
    if activation not in KERNEL_ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {KERNEL_ACTIVATIONS}: the ones the expert "
                         "kernels build")
    e, two_i, h = w13.shape
    for name, bias, shape in (("w13_bias", w13_bias, (e, two_i)), ("w2_bias", w2_bias, (e, h))):
        if bias is not None and (tuple(bias.shape) != shape or bias.dtype != hidden.dtype or not bias.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous {hidden.dtype} {list(shape)}, got {bias.dtype} "
                             f"{list(bias.shape)}")


def _check(hidden, w13, w2, topk_weights, topk_ids, fp8: bool) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"need hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")  # fmt: skip
    e, two_i, h = w13.shape
    if hidden.shape[1] != h or two_i % 2 or w2.shape != (e, h, two_i // 2):
        raise ValueError(f"shapes disagree: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    weight_dtype = FP8_DTYPE if fp8 else hidden.dtype
    if hidden.dtype not in SUPPORTED_DTYPES or w13.dtype != weight_dtype or w2.dtype != weight_dtype:
        raise ValueError(f"hidden {hidden.dtype} must be one of {SUPPORTED_DTYPES} and w13 {w13.dtype}, w2 {w2.dtype} "
                         f"must be {weight_dtype}")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError(f"expert weights must be contiguous, got strides w13 {w13.stride()}, w2 {w2.stride()}")
    if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_ids must be int32 and topk_weights fp32, got {topk_ids.dtype}, {topk_weights.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be "
                         f"[{hidden.shape[0]}, k]")  # fmt: skip


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    expert_start: int = 0,
    counts: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    weight_block: tuple[int, int] | None = None,
    tiles: MoeTiles | None = None,
    path: str | None = None,
    w8a8: bool | None = None,
    gemm_tiles: tuple[GemmTile, GemmTile] | None = None,
    gemv_tiles: tuple[GemvTile, GemvTile] | None = None,
    hidden_q: tuple[torch.Tensor, torch.Tensor] | None = None,
    input_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    read_next: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = SWIGLU_ALPHA,
    limit: float = SWIGLU_LIMIT,
) -> torch.Tensor:
    """sum over slots of weight * down(silu(gate(x)) * up(x)) over this rank's experts, [T, H].

    gpt-oss: ``w13_bias [E_local, 2I]`` (gate's, then up's) and ``w2_bias [E_local, H]`` in the activation dtype
    join gate/up before the activation and down before the routing weight; ``activation="swiglu_oai"`` with its
    ``alpha`` and ``limit`` (kernels/moe_reference.activation_reference) replaces silu(gate) * up; DeepSeek-V4's
    ``"silu_clamp"`` clamps gate and up at ``limit`` before it.

    ``valid`` (bool [T]) marks real rows; ``counts`` (int32 [E global]) receives pairs per expert.
    ``w13_scale`` / ``w2_scale``: the fp32 scales of fp8 ``w13`` / ``w2`` (``weight_block`` (bn, bk)
    blocks, or None: per output channel). ``path`` / ``w8a8`` / ``gemm_tiles`` / ``gemv_tiles``
    override the table and the W8A8 rule (tests, tuner, benchmarks). ``hidden_q``: ``hidden`` already
    quantized as ``hidden_quant_group`` says (fp8 [T, H], fp32 scales [T, groups]), by the launch that made it;
    gate_up reads it where it would quantize ``hidden`` by a launch of its own (elsewhere it is not read).
    ``input_scales``: static activation scales (one fp32 value each, on the device) of gate_up's input and of
    down's, with per-channel weight scales; W8A8 then quantizes with them instead of per token group.
    ``read_next``: the weight the step reads after the experts (the next layer's qkv projection); on the grouped
    GEMM path the slot-sum launch asks L2 for its first bytes under kernels/l2_prefetch.py's budget.
    """
    fp8 = w13_scale is not None or w2_scale is not None
    if input_scales is not None and (not fp8 or weight_block is not None or hidden_q is not None
                                     or any(s.numel() != 1 or s.dtype != torch.float32 for s in input_scales)):
        raise ValueError("input_scales (static activation scales) need fp8 experts with per-channel scales and no "
                         "hidden_q, as two one-element fp32 tensors; got weight_block="
                         f"{weight_block}, hidden_q {'given' if hidden_q is not None else 'None'}, "
                         f"{[(tuple(s.shape), s.dtype) for s in input_scales]}")
    _check(hidden, w13, w2, topk_weights, topk_ids, fp8)
    _check_epilogue(hidden, w13, w2, w13_bias, w2_bias, activation)
    act = {"silu": SILU, "swiglu_oai": SWIGLU_OAI, "silu_clamp": SILU_CLAMP}[activation]
    epilogue = {"act": act, "alpha": float(alpha), "limit": float(limit)}
    scales = expert_scales(w13, w2, w13_scale, w2_scale, weight_block) if fp8 else None
    if path not in (None, *PATHS):
        raise ValueError(f"path={path!r} must be one of {PATHS}")
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    t, h = hidden.shape
    num_local, inter = w13.shape[0], w2.shape[2]
    k = topk_ids.shape[1]
    pairs = t * k
    device, dtype = hidden.device, hidden.dtype
    if counts is None:
        counts = torch.empty(expert_start + num_local, dtype=torch.int32, device=device)
    out = torch.empty(t, h, dtype=dtype, device=device)
    if t == 0:
        counts.zero_()
        return out
    tiles = tiles or moe_tiles(num_local, inter, h, w13.dtype if fp8 else dtype, device)
    valid_arg = topk_ids if valid is None else valid.view(torch.uint8)
    chosen, step_tiles, w8a8 = _plan(pairs, num_local, tiles, scales, path, w8a8, gemm_tiles)
    if chosen == "gemv":
        if valid is None:
            # the streaming kernels always take a mask: one compiled variant serves graph replays (padded, masked)
            # and eager steps alike, so no eager step after the warm-up meets a HAS_VALID=False it never compiled;
            # an eager step reads a held all-true one, not a mask allocated and filled per call
            valid_arg = all_rows_valid(t, device)
            valid = valid_arg.view(torch.bool)
        _streaming_path(hidden, w13, w2, topk_weights, topk_ids, valid, valid_arg, expert_start, counts, out,
                        gemv_tiles or tiles.gemv_tiles(k, inter, h, weight_block[1] if weight_block else None),
                        scales, (w13_bias, w2_bias), epilogue)  # fmt: skip
    else:
        _grouped_gemm_path(hidden, w13, w2, topk_weights, topk_ids, valid, valid_arg, expert_start, counts, out,
                           step_tiles, scales, w8a8, hidden_q, input_scales, read_next, (w13_bias, w2_bias),
                           epilogue)  # fmt: skip
    return out


_ALL_ROWS_VALID: dict[torch.device, torch.Tensor] = {}


def all_rows_valid(t: int, device: torch.device) -> torch.Tensor:
    """An all-true uint8 row mask [t] (a view of one held per device, grown by powers of two and never written by
    the kernels), for the streaming kernels on an eager step that passes none. Inside a CUDA-graph capture a mask
    that must grow is made for the call alone: a held one in the graph's pool would outlive what the pool expects."""
    held = _ALL_ROWS_VALID.get(device)
    if held is None or held.numel() < t:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.ones(t, dtype=torch.uint8, device=device)
        held = torch.ones(triton.next_power_of_2(t), dtype=torch.uint8, device=device)
        _ALL_ROWS_VALID[device] = held
    return held[:t]


def hidden_quant_group(t: int, top_k: int, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                       w2_scale: torch.Tensor | None, weight_block: tuple[int, int] | None,
                       input_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> int | None:  # fmt: skip
    """The group size in which ``fused_experts`` quantizes ``hidden`` by a launch of its own before gate_up, for a
    call of ``t`` tokens on these experts (W8A8 grouped GEMM whose gate_up tile does not quantize inside); None
    where it does not, and under static scales (``input_scales``), which no group size describes. The launch that
    makes ``hidden`` may then write it quantized so (``hidden_q``)."""
    if w13_scale is None or t == 0 or input_scales is not None:
        return None
    scales, (chosen, step_tiles, w8a8) = _fp8_plan(t, top_k, w13, w2, w13_scale, w2_scale, weight_block, None, None)
    if chosen != "gemm" or not w8a8 or step_tiles[0].a8:
        return None
    return scales[0].group_k


def runs_grouped_gemm(t: int, top_k: int, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``fused_experts`` takes the grouped GEMM (not the per-pair streaming path) for ``t`` tokens on these
    experts, by the device's table."""
    tiles = moe_tiles(w13.shape[0], w2.shape[2], w2.shape[1], w13.dtype, w13.device)
    return t * top_k > tiles.small_max_pairs


def _fp8_plan(t, top_k, w13, w2, w13_scale, w2_scale, weight_block, path, w8a8):
    """(scales, ``_plan``) of a call of ``t`` tokens on these fp8 experts with the device's table, as
    ``fused_experts`` makes them: what ``quantized_steps`` and ``hidden_quant_group`` ask of it."""
    num_local, inter, h = w13.shape[0], w2.shape[2], w2.shape[1]
    scales = expert_scales(w13, w2, w13_scale, w2_scale, weight_block)
    tiles = moe_tiles(num_local, inter, h, w13.dtype, w13.device)
    return scales, _plan(t * top_k, num_local, tiles, scales, path, w8a8, None)


def _plan(pairs: int, num_local: int, tiles: MoeTiles, scales: ExpertScales | None, path: str | None,
          w8a8: bool | None, gemm_tiles: tuple[GemmTile, GemmTile] | None,
          ) -> tuple[str, tuple[GemmTile, GemmTile] | None, bool]:  # fmt: skip
    """(path, grouped-GEMM tiles, W8A8 by a quantization launch) for a call of ``pairs``. The table's tiles
    run as these weights can: a tile that quantizes in the GEMM (``a8``) needs block scales whose K block
    is its K step, and a call that asks for W8A16 (``w8a8=False``) keeps its activations unquantized;
    elsewhere the tile runs without ``a8``. Tiles passed in run as given (a wrong one is refused)."""
    if path == "gemv" or (path is None and pairs <= tiles.small_max_pairs):
        return "gemv", None, False
    w8a16 = w8a8 is False
    if w8a8 is None:
        w8a8 = scales is not None and pairs >= W8A8_MIN_ROWS_PER_EXPERT * num_local
    if w8a8 and scales is None:
        raise ValueError("w8a8=True needs fp8 expert weights (w13_scale, w2_scale)")
    if gemm_tiles is not None:
        return "gemm", gemm_tiles, w8a8

    def runnable(tile: GemmTile, sb: ExpertScales | None) -> GemmTile:
        if tile.a8 and (w8a16 or a8_problem(tile, sb)):
            return dataclasses.replace(tile, a8=False)
        return tile

    gate_up, down = tiles.gemm_tiles(pairs)
    s13, s2 = scales if scales is not None else (None, None)
    return "gemm", (runnable(gate_up, s13), runnable(down, s2)), w8a8


def quantized_steps(t: int, top_k: int, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                    w2_scale: torch.Tensor, weight_block: tuple[int, int] | None, *, path: str | None = None,
                    w8a8: bool | None = None) -> tuple[bool, bool]:  # fmt: skip
    """Whether ``fused_experts`` quantizes the activations of its gate_up and its down step for a call of
    ``t`` tokens on these fp8 experts (by a launch, W8A8, or inside the GEMM, an ``a8`` tile): what
    kernels/moe_fp8_reference.experts_fp8_reference must do to compute the same product."""
    _, (chosen, step_tiles, w8a8) = _fp8_plan(t, top_k, w13, w2, w13_scale, w2_scale, weight_block, path, w8a8)
    if chosen == "gemv":
        return False, False
    return w8a8 or step_tiles[0].a8, w8a8 or step_tiles[1].a8


def _streaming_path(hidden, w13, w2, topk_weights, topk_ids, valid, valid_arg, expert_start, counts, out, tiles,
                    scales=None, biases=(None, None), epilogue=None):  # fmt: skip
    """Three launches in all with the router: gate_up per pair (+ counts), down per token (+ slot sum).

    Tiles come from the table or, where it has none, from the shape (moe_config.default_gemv_tiles).
    """
    (t, h), (num_local, two_i, _), k = hidden.shape, w13.shape, topk_ids.shape[1]
    inter = two_i // 2
    gu, dn = tiles
    s13, s2 = scales or (None, None)
    gu_k = min(gu.block_k, triton.next_power_of_2(h))
    dn_k = min(dn.block_k, triton.next_power_of_2(inter))
    gu_ks = dn_ks = False
    if scales is not None:
        (gu_k, gu_ks), (dn_k, dn_ks) = s13.stream_step(gu_k, gu.block_n), s2.stream_step(dn_k, dn.block_n)
    a13, a2 = scale_args(s13, w13), scale_args(s2, w2)
    block_e = triton.next_power_of_2(counts.numel())
    act = torch.empty(t * k, inter, dtype=hidden.dtype, device=hidden.device)
    b13, b2 = biases
    epilogue = epilogue or {"act": SILU, "alpha": SWIGLU_ALPHA, "limit": SWIGLU_LIMIT}
    fused_moe_gemv_gate_up_kernel[(t * k, triton.cdiv(inter, gu.block_n))](
        hidden, w13, act, topk_ids, valid_arg, counts, a13["scale"], inter, expert_start, t * k,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0), a13["stride_e"], a13["stride_n"],
        a13["up_row"], K=h, TOP_K=k, E=counts.numel(), E_LOCAL=num_local, HAS_VALID=valid is not None,
        W_FP8=scales is not None, **a13["consts"], K_SCALES=gu_ks, BLOCK_N=gu.block_n, BLOCK_K=gu_k,
        BLOCK_P=HISTOGRAM_PAIRS, BLOCK_E=block_e, num_warps=gu.num_warps, num_stages=gu.num_stages, **pdl_args(hidden.device, "fused_moe_gemv_gate_up_kernel"),
        b13_ptr=w13 if b13 is None else b13, stride_b13e=0 if b13 is None else b13.stride(0),
        HAS_BIAS=b13 is not None, ACT=epilogue["act"], ALPHA=epilogue["alpha"], LIMIT=epilogue["limit"],
    )  # fmt: skip
    fused_moe_gemv_down_kernel[(t, triton.cdiv(h, dn.block_n))](
        act, w2, out, topk_weights, topk_ids, valid_arg, a2["scale"], h, expert_start,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), a2["stride_e"], a2["stride_n"],
        K=inter, TOP_K=k, E_LOCAL=num_local, HAS_VALID=valid is not None, W_FP8=scales is not None,
        **a2["consts"], K_SCALES=dn_ks, BLOCK_S=triton.next_power_of_2(k), BLOCK_N=dn.block_n, BLOCK_K=dn_k,
        num_warps=dn.num_warps, num_stages=dn.num_stages, **pdl_args(act.device, "fused_moe_gemv_down_kernel"),
        b2_ptr=w2 if b2 is None else b2, stride_b2e=0 if b2 is None else b2.stride(0), HAS_BIAS=b2 is not None,
    )  # fmt: skip


def _grouped_gemm_path(hidden, w13, w2, topk_weights, topk_ids, valid, valid_arg, expert_start, counts, out, tiles,
                       scales=None, w8a8=False, hidden_q=None, input_scales=None, read_next=None, biases=(None, None),
                       epilogue=None):  # fmt: skip
    """Sort/align, gate_up and down grouped GEMMs over [pairs] rows, then the slot sum (which asks L2 for the first
    bytes of ``read_next``, kernels/l2_prefetch.py).

    W8A8: x is quantized per token group before gate_up (or comes so, ``hidden_q``) and the activated
    product before down, except for a step whose tile quantizes in the kernel (``GemmTile.a8``); with static
    scales (``input_scales``) each with its one scale.
    """
    static13, static2 = input_scales or (None, None)
    (t, h), (num_local, two_i, _), k = hidden.shape, w13.shape, topk_ids.shape[1]
    inter, pairs = two_i // 2, t * k
    gu, dn = tiles
    if gu.block_m != dn.block_m:
        raise ValueError(f"gate_up block_m={gu.block_m} and down block_m={dn.block_m} must match (one sort)")
    s13, s2 = scales or (None, None)
    align = moe_align(topk_ids, valid, counts, expert_start, num_local, gu.block_m)
    down = torch.empty(pairs, h, dtype=hidden.dtype, device=hidden.device)
    # where gate_up's tile is one of down's activation groups, its epilogue writes down's input as fp8 groups
    quant_out = quant_out_group(gu, dn, s2, w8a8) and input_scales is None
    act = torch.empty(pairs, inter, dtype=FP8_DTYPE if quant_out else hidden.dtype, device=hidden.device)
    act_s = torch.empty(pairs, triton.cdiv(inter, s2.group_k), dtype=torch.float32, device=hidden.device) \
        if quant_out else None  # fmt: skip
    epilogue = epilogue or {}
    gemm_step(hidden, w13, s13, act, gu, align, topk_weights, k, True, w8a8, hidden_q, c_scale=act_s,
              static_scale=static13, bias=biases[0], **epilogue)
    gemm_step(act, w2, s2, down, dn, align, topk_weights, 1, False, w8a8, (act, act_s) if quant_out else None,
              static_scale=static2, bias=biases[1])
    block_h = min(1024, triton.next_power_of_2(h))
    grid = (t, triton.cdiv(h, block_h))
    pf = prefetch_plan(read_next, grid[0] * grid[1], 32 * _SUM_WARPS, "slot_sum")
    moe_sum_kernel[grid](
        down, out, topk_ids, valid_arg, h, expert_start, down.stride(0), out.stride(0),
        **(pf.kernel_args() if pf is not None else no_prefetch_args(down)), PF_THREADS=32 * _SUM_WARPS,
        TOP_K=k, E_LOCAL=num_local, HAS_VALID=valid is not None, BLOCK_H=block_h, num_warps=_SUM_WARPS,
        **pdl_args(down.device, "moe_sum_kernel"),
    )  # fmt: skip


def quant_out_group(gate_up: GemmTile, down: GemmTile, s2: ExpertScales | None, w8a8: bool) -> bool:
    """Whether gate_up's epilogue quantizes the activation for down (``QUANT_OUT``): down runs W8A8 by a
    quantization launch and gate_up's tile is exactly one of its activation groups wide (the scale block's K
    of w2), so each tile holds whole groups and the launch has nothing left to do."""
    return w8a8 and s2 is not None and not down.a8 and gate_up.block_n == s2.group_k


def gemm_step(a: torch.Tensor, b: torch.Tensor, sb: ExpertScales | None, c: torch.Tensor, tile: GemmTile, align,
              topk_weights: torch.Tensor, a_row_div: int, gated: bool, w8a8: bool,
              a_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
              c_scale: torch.Tensor | None = None, static_scale: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, act: int = SILU, alpha: float = SWIGLU_ALPHA,
              limit: float = SWIGLU_LIMIT) -> None:  # fmt: skip
    """One grouped GEMM over the sorted pairs: gate_up (``gated``: rows ``a[pair // a_row_div]``, silu * up
    written) or down (rows ``a[pair]``, times the routing weight). The step's mode: ``tile.a8``
    quantizes a in the kernel (A_QUANT), else ``w8a8`` quantizes it first (A_FP8; ``a_quantized``: a already
    quantized so, by its producer), else W8A16. ``c_scale`` (gate_up, fp32 [pairs, N / block_n]): c is fp8 and
    each tile's rows are quantized as one group, the scales written there (``quant_out_group``). ``static_scale``
    (W8A8 with per-channel weight scales): a quantized with that one scale instead of per token group.
    ``bias``: the experts' bias rows ([E, 2I] gate_up, [E, H] down); ``act``/``alpha``/``limit``: gate_up's
    activation (moe_gemm.gated_epilogue)."""
    n, kk = b.shape[1] // (2 if gated else 1), b.shape[2]
    check_a8_tile(tile, sb)
    # the activation dtype, where the epilogue rounds: c's, or a's where c is the fp8 that QUANT_OUT writes
    act_dtype = TL_DTYPES[c.dtype if c_scale is None else a.dtype]
    if c_scale is not None:
        groups = triton.cdiv(n, tile.block_n)
        if (not gated or c.dtype != FP8_DTYPE or c_scale.dtype != torch.float32 or c_scale.dim() != 2
                or c_scale.shape[1] != groups or c_scale.stride(1) != 1 or c_scale.shape[0] != c.shape[0]):  # fmt: skip
            raise ValueError(f"a quantized gate_up output needs fp8 c with fp32 scales [{c.shape[0]}, {groups}] "
                             f"(groups of block_n={tile.block_n}), got c {c.dtype}, scales {c_scale.dtype} "
                             f"{tuple(c_scale.shape)}, gated={gated}")
    quantize_first = w8a8 and not tile.a8
    a_scale = a  # unread unless W8A8
    if quantize_first and a_quantized is not None:
        a, a_scale = a_quantized
        rows, groups = topk_weights.numel() // a_row_div, triton.cdiv(kk, sb.group_k)
        if (a.dtype != FP8_DTYPE or a.shape != (rows, kk) or a.stride(1) != 1 or a_scale.dim() != 2
                or a_scale.shape != (rows, groups)):  # fmt: skip
            raise ValueError(f"pre-quantized activations must be fp8 [{rows}, {kk}] with scales [{rows}, {groups}] "
                             f"(groups of {sb.group_k}), got {a.dtype} {tuple(a.shape)} and {tuple(a_scale.shape)}")
    elif quantize_first and static_scale is not None:
        if not sb.per_channel:
            raise ValueError("a static activation scale needs per-channel weight scales (one activation scale a row)")
        a, a_scale = static_quant(a, static_scale)
    elif quantize_first:
        a, a_scale = per_token_group_quant(a, sb.group_k)
    fp8_dot = w8a8 or tile.a8
    block_k = min(tile.block_k, max(32 if fp8_dot else 16, triton.next_power_of_2(kk)))
    k_only = sb is not None and sb.k_only_scales(tile.block_n, fp8_dot)
    if sb is not None:
        block_k = sb.gemm_block_k(block_k, tile.block_n, fp8_dot)
    args = scale_args(sb, b)
    pairs = topk_weights.numel()
    fused_moe_gemm_kernel[(align.max_blocks * triton.cdiv(n, tile.block_n),)](
        a, b, c, topk_weights, align.sorted_ids, align.expert_ids, align.num_post_padded, a_scale, args["scale"],
        a_scale if c_scale is None else c_scale,
        pairs, n, align.max_blocks, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        a_scale.stride(0), args["stride_e"], args["stride_n"], 0 if c_scale is None else c_scale.stride(0),
        args["up_row"],
        K=kk, A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=not gated,
        IEEE=a.dtype == torch.float32 and not fp8_dot, B_FP8=sb is not None, A_FP8=quantize_first, **args["consts"],
        K_SCALES=k_only, A_QUANT=tile.a8, QUANT_OUT=c_scale is not None, ACT_DTYPE=act_dtype, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_args(a.device, "fused_moe_gemm_kernel"),
        bias_ptr=b if bias is None else bias, stride_bias_e=0 if bias is None else bias.stride(0),
        HAS_BIAS=bias is not None, ACT=act, ALPHA=alpha, LIMIT=limit,
    )  # fmt: skip


def moe_workspace_bytes(
    num_tokens: int, top_k: int, num_local_experts: int, intermediate: int, hidden: int, dtype: torch.dtype,
    block_m: int = 128, fp8_group_k: int = 0,
) -> int:  # fmt: skip
    """Bytes one MoE layer's forward of ``num_tokens`` rows allocates (the start-up memory plan reserves them).

    The padding-row mask (built from an int64 arange), the router's fp32 weights and int32 ids,
    the sort at the largest tile the tuner tries
    (block_m 128), the [pairs, I] activation, the [pairs, H] per-pair output and the [T, H] result.
    FP8 weights (``fp8_group_k``: the scale block's K, or the hidden size per channel) add, where the
    W8A8 rule applies, the fp8 copies of x and of the activation with their fp32 group scales.
    """
    es = torch.empty((), dtype=dtype).element_size()
    pairs = num_tokens * top_k
    slots = max_padded_pairs(pairs, num_local_experts, block_m)
    sort = 4 * (slots + slots // block_m + 1 + num_local_experts)
    quantized = 0
    if fp8_group_k and pairs >= W8A8_MIN_ROWS_PER_EXPERT * num_local_experts:
        groups = num_tokens * -(-hidden // fp8_group_k) + pairs * -(-intermediate // fp8_group_k)
        quantized = num_tokens * hidden + pairs * intermediate + 4 * groups
    return 9 * num_tokens + 8 * pairs + sort + quantized + es * (pairs * intermediate + pairs * hidden
                                                                 + num_tokens * hidden)
