"""The GPU attention backend: Triton kernels for the KV write, decode and prefill/extend.

Models with a fused qkv projection skip ``forward`` and hand ``attend`` the projection's output as a
``NewToken``. Prefill and mixed steps run the prologue kernel (kernels/qk_rope_kv.py: q/k norm, rotary, K/V
write) and then attention; decode steps of heads without per-head q/k norms, over a cache of 16 or 32-bit
elements, take the prologue inside the decode kernel (kernels/decode_attention.decode_attention_qkv, one launch a
layer where there were two). Measured on an H200 (benchmarks.decode_prologue, results/decode_prologue*.json, the
two ways captured in one call and replayed in turns, the FP8 matmul releasing the kernel after it as by default):
llama3-8b FP8 at batch 64 4.441 against 4.508 ms and 4.481 against 4.546 in two calls, at batch 1 within 0.2%
(context 512); at context 2048 7.359 against 7.497 at batch 64, 5.136 against 5.158 at batch 8, 21.015 against
21.111 at batch 256. qwen3-30b-a3b FP8, whose heads carry q/k norms, 0.2-0.7% slower inside (batch 1 2.360 against
2.343 ms, batch 64 10.682 against 10.662), so it keeps the launch. Over an fp8 cache the launch is faster
(context 2048: llama3-8b FP8 at batch 64 6.175 against 6.728 ms inside, at batch 256 16.541 against 18.598, at
batch 8 5.023 against 5.051; mixtral-8x7b FP8 at batch 64 17.384 against 17.859; llama3-8b at batch 1, context
512, within 0.2%): the fp8 cache's decode steps widen K and V in registers and are bound by their arithmetic, to
which the prologue inside adds its own.
``decode_prologue(fused)`` decides instead within its scope.

Decode steps take the split-KV decode kernel, whose grid and scratch depend only on static sizes,
so the whole step can be captured in a CUDA graph; prefill and mixed steps take the extend kernel.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import torch

from graphserve.kernels.common import pushed, sm_count
from graphserve.kernels.decode_attention import (
    MAX_QUANT_ROW,
    PROGRAMS_PER_SM,
    NewToken,
    counters_numel,
    decode_attention,
    decode_attention_qkv,
    decode_plan,
    workspace_numel,
)
from graphserve.kernels.extend_attention import extend_attention
from graphserve.kernels.fp8_quant import FP8_DTYPE
from graphserve.kernels.kv_write import kv_write
from graphserve.kernels.qk_rope_kv import qk_norm_rope_kv_write
from graphserve.layers.attention_backend import AttentionBackend

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch

# Sequences a decode step may hold to write its output with one scale per sequence (16 KB of counters a device); a
# larger batch takes the quantization launch
ROW_COUNTERS = 4096

_prologue_scoped: list[bool] = []


def output_scale_groups(num_heads: int, head_dim: int, group_size: int, rows: int) -> int | None:
    """Scales per row of a decode step's attention output written quantized in groups of ``group_size``: one a head
    (``group_size`` = head_dim), or one a row where the row is more than one head, the kernel takes its width
    (``MAX_QUANT_ROW``) and the row counters its rows (``ROW_COUNTERS``); None where the kernel writes no such groups
    (the projection then quantizes its input in a launch of its own)."""
    if group_size == head_dim:
        return num_heads
    if num_heads > 1 and group_size == num_heads * head_dim <= MAX_QUANT_ROW and rows <= ROW_COUNTERS:
        return 1
    return None


def decode_prologue(fused: bool) -> contextlib.AbstractContextManager[None]:
    """Decode steps run (or captured) in this scope take the attention prologue inside the decode kernel
    (``fused``) or as its own launch before it, whatever the heads (benchmarks.decode_prologue times the two)."""
    return pushed(_prologue_scoped, fused)


def prologue_in_decode(new: NewToken, kv_cache: torch.Tensor) -> bool:
    """Whether a decode step takes ``new``'s prologue inside the decode kernel: the scope's answer, else where its
    heads carry no per-head q/k norms and the cache is not fp8 (the module's docstring gives the measurements)."""
    if _prologue_scoped:
        return _prologue_scoped[-1]
    return new.q_norm_weight is None and kv_cache.dtype.itemsize > 1


def run_prologue(new: NewToken, kv_cache: torch.Tensor) -> torch.Tensor:
    """The prologue as its own launch: q [T, H, D] normed and rotated, this step's K/V in the cache."""
    return qk_norm_rope_kv_write(
        new.qkv, new.positions, new.cos, new.sin, kv_cache, new.slot_mapping, new.num_heads, kv_cache.shape[3],
        kv_cache.shape[4], new.q_norm_weight, new.k_norm_weight, new.eps,
    )  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _one_wave(rows: int, num_kv_heads: int, max_context: int, sms: int, fp8_cache: bool) -> bool:
    """Whether the split decode kernel's grid for these static sizes is at most PROGRAMS_PER_SM programs an SM (asked
    per layer and step on the eager path: the answer is cached)."""
    if rows * num_kv_heads > PROGRAMS_PER_SM * sms:  # at least one split each
        return False
    _, splits = decode_plan(rows, num_kv_heads, max_context, sms, fp8_cache)
    return rows * num_kv_heads * splits <= PROGRAMS_PER_SM * sms


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through Triton. One instance serves every layer of a model.

    The decode scratch space (split partials, and the zeroed counters with which the split kernel
    merges its own partials) is allocated once per (device, head layout) and reused by every layer
    and step. It is sized for every batch size at any context length, so it never grows; call
    ``reserve`` before capturing graphs, or let the eager warm-up run that precedes each capture
    allocate it, so that it never lands inside a graph's memory pool. Every decode launch leaves
    the counters at zero, so layers, steps and graph replays share them.
    """

    name = "triton"
    fused_prologue = True  # attend() takes the qkv projection's output (NewToken) and writes K/V itself

    def __init__(self) -> None:
        self._workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._row_counters: dict[torch.device, torch.Tensor] = {}

    def row_counters(self, device: torch.device) -> torch.Tensor:
        """The zeroed counters (one per sequence, ``ROW_COUNTERS``) on which a decode step writing its output with one
        scale per sequence meets its kv heads; allocated once per device, left at zero by every launch."""
        device = torch.device(device)
        if device not in self._row_counters:
            self._row_counters[device] = torch.zeros(ROW_COUNTERS, dtype=torch.int32, device=device)
        return self._row_counters[device]

    def reserve(
        self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
        kv_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate (once) and return the decode scratch and merge counters for this head layout and cache dtype."""
        device = torch.device(device)
        key = (device, num_heads, num_kv_heads, head_dim, kv_dtype)
        reserved = self._workspaces.get(key)
        if reserved is None:
            numel = workspace_numel(num_heads, num_kv_heads, head_dim, sm_count(device), kv_dtype)
            counters = counters_numel(num_kv_heads, sm_count(device), kv_dtype)
            reserved = (
                torch.empty(max(1, numel), dtype=torch.float32, device=device),
                torch.zeros(max(1, counters), dtype=torch.int32, device=device),
            )
            self._workspaces[key] = reserved
        return reserved

    def workspace_bytes(self) -> int:
        return (sum(t.numel() * t.element_size() for pair in self._workspaces.values() for t in pair)
                + sum(t.numel() * t.element_size() for t in self._row_counters.values()))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        batch: ForwardBatch,
        scale: float,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kv_write(k, v, batch.kv_caches[layer_idx], batch.slot_mapping)
        return self.attend(q, layer_idx, batch, scale, window=window, sinks=sinks)

    def attend(
        self, q: torch.Tensor | NewToken, layer_idx: int, batch: ForwardBatch, scale: float, *,
        window: int | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Attention of q [T, H, D] over a cache holding this step's K/V, or of a ``NewToken`` whose K/V this call
        writes (in the decode kernel itself where ``prologue_in_decode``)."""
        kv_cache = batch.kv_caches[layer_idx]
        kind = {"window": window, "sinks": sinks}
        if isinstance(q, NewToken):
            if batch.mode == "decode" and prologue_in_decode(q, kv_cache):
                return self._decode(q, layer_idx, batch, scale, **kind)
            q = run_prologue(q, kv_cache)
        if batch.mode == "decode":
            return self._decode(q, layer_idx, batch, scale, **kind)
        return extend_attention(
            q, kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.max_query_len, scale, **kind,
        )

    def _decode(self, q: torch.Tensor | NewToken, layer_idx: int, batch: ForwardBatch, scale: float,
                **out) -> torch.Tensor:  # fmt: skip
        """The split decode kernel on this layer's cache with the reserved scratch (``out``: its output keywords,
        and the layer's window and sinks); for a ``NewToken``, with the prologue inside it."""
        kv_cache = batch.kv_caches[layer_idx]
        _, _, _, num_kv_heads, head_dim = kv_cache.shape
        heads = q.num_heads if isinstance(q, NewToken) else q.shape[1]
        ws, counters = self.reserve(heads, num_kv_heads, head_dim, kv_cache.device, kv_cache.dtype)
        if isinstance(q, NewToken):
            return decode_attention_qkv(q, kv_cache, batch.block_tables, batch.seq_lens, scale, workspace=ws,
                                        counters=counters, **out)  # fmt: skip
        return decode_attention(q, kv_cache, batch.block_tables, batch.seq_lens, scale, workspace=ws,
                                counters=counters, **out)  # fmt: skip

    def leaves_room(self, batch: ForwardBatch, layer_idx: int) -> bool:
        """A decode step whose split kernel's grid (sequences x kv heads x splits, static sizes only: the same at
        capture and replay) is at most ``PROGRAMS_PER_SM`` programs an SM, the residency its split rule counts on
        (the kernel holds three an SM on an H200: benchmarks.kernel_ptxas)."""
        if batch.mode != "decode":
            return False
        kv_cache = batch.kv_caches[layer_idx]
        _, _, page, num_kv_heads, _ = kv_cache.shape
        rows, width = batch.block_tables.shape
        return _one_wave(rows, num_kv_heads, width * page, sm_count(kv_cache.device), kv_cache.dtype == FP8_DTYPE)

    def quantizes_output(self, batch: ForwardBatch) -> bool:
        return batch.mode == "decode"

    def attend_quantized(
        self, q: torch.Tensor | NewToken, layer_idx: int, batch: ForwardBatch, scale: float, group_size: int,
        pad_rows_to: int, scales_column_major: bool, *, window: int | None = None, sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """Decode steps whose groups are whole heads (``group_size`` = head_dim) or whole rows (``group_size`` =
        heads x head_dim: one scale per token, up to ``ROW_COUNTERS`` rows of at most ``MAX_QUANT_ROW`` values) and whose
        rows need no padding: the split kernel stores each head's output in fp8 with its scale, or the last of a
        sequence's kv heads quantizes its row (kernels/decode_merge.emit_heads). Prefill and mixed steps, other
        groups, and padded layouts (cuBLASLt's rows padded to 4, whose padding rows the quantization launch
        zeroes), return None."""
        kv_cache = batch.kv_caches[layer_idx]
        head_dim = kv_cache.shape[4]
        if isinstance(q, NewToken):
            t, num_heads, device = q.qkv.shape[0], q.num_heads, q.qkv.device
        else:
            (t, num_heads, _), device = q.shape, q.device
        groups = output_scale_groups(num_heads, head_dim, group_size, t)
        if not self.quantizes_output(batch) or groups is None or t % pad_rows_to:
            return None
        per_row = group_size != head_dim
        if isinstance(q, NewToken) and not prologue_in_decode(q, kv_cache):
            q = run_prologue(q, kv_cache)
        out = torch.empty((t, num_heads * head_dim), dtype=FP8_DTYPE, device=device)
        if scales_column_major:
            scales = torch.empty((groups, t), dtype=torch.float32, device=device).t()
        else:
            scales = torch.empty((t, groups), dtype=torch.float32, device=device)
        rows = {"row_counters": self.row_counters(device)} if per_row else {}
        self._decode(q, layer_idx, batch, scale, out=out.view(t, num_heads, head_dim), out_scale=scales, window=window,
                     sinks=sinks, **rows)  # fmt: skip
        return out, scales
