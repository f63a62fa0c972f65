"""GPU memory planner: a pure function of numbers, so start-up (measured) and `graphserve plan`
(estimated) share one budget and one refusal message.

Everything the engine owns lives inside the static budget ``total · --mem-fraction-static``:
weights, the activation peak (the larger of the biggest prefill chunk and the biggest decode
batch), the CUDA-graph pool, a reserve for allocator slack, and the KV pool, which gets the rest.

Where a layout pages its latents apart from its blocks (DeepSeek-V4: ``KVLayout.latent_window``), the KV pool is
split: the latent pages that ``max_running`` windows (and as many cached prefixes) hold come first
(``KVLayout.latent_pages_wanted``), and the blocks, at the bytes a token keeps for its whole context (compact pages),
get the rest. A pool too small to hold more blocks than that many pages gives every block a page instead (no split:
``latent_pages`` 0).
Memory outside the budget belongs to the CUDA context, NCCL and other processes; the plan never
counts on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphserve.layers.kv_layout import KVLayout

GiB = 1024**3
# Kept free inside the static budget for cuBLAS/cuDNN workspaces, allocator fragmentation and the CUDA
# context's own growth: one figure for start-up (engine/startup.py) and `graphserve plan`.
RESERVE_BYTES = 1 << 30


def gib(n_bytes: float) -> float:
    return n_bytes / GiB


@dataclass(frozen=True)
class MemoryPlan:
    total_bytes: int
    mem_fraction_static: float
    static_bytes: int
    weights_bytes: int
    activation_bytes: int
    graph_pool_bytes: int
    reserve_bytes: int
    kv_pool_bytes: int  # what is left for KV (may be negative: fixed costs exceed the budget)
    kv_bytes_per_token: int
    block_size: int
    kv_tokens: int  # rounded down to whole blocks
    num_blocks: int
    max_model_len: int
    max_running_requests: int
    max_concurrent_at_max_len: int  # min(kv_tokens // max_model_len, max_running_requests)
    fits: bool
    refusal: str | None
    # parts of the activation peak worth naming (e.g. the MoE layers' routing and expert buffers)
    activation_parts: tuple[tuple[str, int], ...] = ()
    # a token's KV bytes by cache, where a layout has more than one (sparse attention's indexer keys)
    kv_parts: tuple[tuple[str, int], ...] = ()
    # latents paged apart (engine/latent_pages.py): their pages (the dummy page included) and a token's bytes in
    # them; kv_tokens then counts blocks at the bytes a token keeps for its whole context, block_bytes_per_token
    latent_pages: int = 0
    latent_bytes_per_token: int = 0
    latent_window: int = 0

    @property
    def block_bytes_per_token(self) -> int:
        """What a token's block holds for the whole context: every part but the latents paged apart."""
        return self.kv_bytes_per_token - (self.latent_bytes_per_token if self.latent_pages else 0)

    @property
    def latent_pool_bytes(self) -> int:
        return self.latent_pages * self.block_size * self.latent_bytes_per_token

    def lines(self) -> list[tuple[str, int]]:
        return [
            ("static budget", self.static_bytes),
            ("weights", self.weights_bytes),
            ("activations", self.activation_bytes),
            ("cuda graph pool", self.graph_pool_bytes),
            ("reserve", self.reserve_bytes),
            ("kv pool", self.kv_pool_bytes),
        ]

    def table(self) -> str:
        head = (f"memory plan: {gib(self.total_bytes):.2f} GiB per GPU × --mem-fraction-static "
                f"{self.mem_fraction_static:g}")
        rows = [head]
        for name, v in self.lines():
            rows.append(f"  {name:<16} {gib(v):>9.2f} GiB")
            if name == "activations":
                rows += [f"    {part:<14} {gib(b):>9.2f} GiB" for part, b in self.activation_parts]
        if self.latent_pages:
            rows.append(f"  {'kv tokens':<16} {self.kv_tokens:>9d}   ({self.num_blocks} blocks of {self.block_size}, "
                        f"{self.block_bytes_per_token} B/token for the whole context; {self.kv_bytes_per_token} "
                        f"B/token with the latent)")
            rows += [f"    {part:<14} {b:>9d} B/token" for part, b in self.kv_parts if part != "latent"]
            rows.append(f"  {'latent pages':<16} {self.latent_pages:>9d}   ({gib(self.latent_pool_bytes):.2f} GiB, "
                        f"{self.latent_bytes_per_token} B/token, pages of {self.block_size}: running windows of "
                        f"{self.latent_window} tokens and as many cached)")
        else:
            rows.append(f"  {'kv tokens':<16} {self.kv_tokens:>9d}   ({self.num_blocks} blocks of {self.block_size}, "
                        f"{self.kv_bytes_per_token} B/token)")
            rows += [f"    {part:<14} {b:>9d} B/token" for part, b in self.kv_parts]
        rows.append(f"  {'max concurrent':<16} {self.max_concurrent_at_max_len:>9d}   requests of "
                    f"--max-model-len {self.max_model_len}")
        if self.refusal:
            rows.append(f"  refused: {self.refusal}")
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["gib"] = {name: round(gib(v), 4) for name, v in self.lines()}
        return d


@dataclass(frozen=True)
class KVSplit:
    """A KV byte budget as blocks and, where a layout pages its latents apart, the latent pages beside them."""

    num_blocks: int  # the dummy block not counted
    latent_pages: int  # the dummy page included; 0: no split, every block keeps its own page
    block_bytes_per_token: int  # a block's bytes a token: without the latent where split


def split_kv_bytes(pool_bytes: int, kv_bytes_per_token: int, block_size: int, latent_bytes_per_token: int = 0,
                   latent_pages: int = 0) -> KVSplit:
    """``pool_bytes`` as blocks of ``block_size`` at ``kv_bytes_per_token`` (which counts the latent too) and, where
    ``latent_bytes_per_token`` is paged apart, ``latent_pages`` (wanted, the dummy page included) first (module
    docstring). The one place a byte budget turns into blocks: the plan, start-up's cut to free memory,
    --kv-cache-gb and the CPU pool all come here, so a budget gives the same blocks and pages whichever path sizes it."""
    if pool_bytes <= 0 or kv_bytes_per_token <= 0:
        return KVSplit(0, 0, kv_bytes_per_token)
    split = kv_bytes_per_token - latent_bytes_per_token
    if latent_bytes_per_token and split > 0:  # (nothing but latents: nothing to split them from)
        blocks = (pool_bytes - latent_pages * block_size * latent_bytes_per_token) // (split * block_size)
        # fewer blocks than the pages wanted: no split, every block gets a page (engine/latent_pages.latent_page_count)
        if blocks + 1 > latent_pages:
            return KVSplit(int(blocks), latent_pages, split)
    return KVSplit(int(pool_bytes // kv_bytes_per_token // block_size), 0, kv_bytes_per_token)


def wanted_latent_pages(layout: KVLayout, block_size: int, max_running: int, chunk: int) -> int:
    """The latent pages a layout's pool is given first (``KVLayout.latent_pages_wanted``); 0 where its latents are
    paged with its blocks."""
    return layout.latent_pages_wanted(block_size, max_running, chunk) if layout.latent_window is not None else 0


def split_layout_bytes(pool_bytes: int, layout: KVLayout, block_size: int, max_running: int, chunk: int) -> KVSplit:
    """``split_kv_bytes`` for ``layout`` (counted at ``block_size``) with the pages ``max_running`` windows want."""
    return split_kv_bytes(pool_bytes, layout.bytes_per_token, block_size, layout.latent_bytes_per_token,
                          wanted_latent_pages(layout, block_size, max_running, chunk))


def _refusal(total: int, frac: float, fixed: int, kv_pool: int, kv_tokens: int, need_tokens: int,
             kv_bytes_per_token: int, weights: int, graph_pool: int, max_model_len: int, tp: int,
             windowed: bool = False) -> str:
    need_kv = need_tokens * kv_bytes_per_token
    short = need_kv - kv_pool
    fixes = []
    frac_needed = (fixed + need_kv) / total
    if frac_needed < 0.99:
        fixes.append(f"raise --mem-fraction-static from {frac:g} to at least {math.ceil(frac_needed * 100) / 100:.2f}")
    else:
        fixes.append(f"--mem-fraction-static cannot fix it alone (it would need {frac_needed:.2f} of the GPU)")
    if windowed:  # a request holds its window and the chunk it computes, whatever its length
        fixes.append("lower --chunked-prefill-size (a windowed request holds its window and one prefill chunk)")
    elif kv_tokens > 0:
        fixes.append(f"lower --max-model-len from {max_model_len} to at most {kv_tokens}")
    if graph_pool > 0 and short <= graph_pool:
        fixes.append(f"lower --cuda-graph-max-bs so the graph pool shrinks by {gib(short):.2f} GiB "
                     f"of its {gib(graph_pool):.2f} GiB")
    for new_tp in (2 * tp, 4 * tp, 8 * tp):
        # Weights and KV per GPU shrink with TP; activations and graphs are kept as they are (conservative).
        if frac * total - (fixed - weights + weights * tp / new_tp) >= need_kv * tp / new_tp:
            fixes.append(f"raise --tp from {tp} to {new_tp}")
            break
    return (f"the KV pool ({gib(kv_pool):.2f} GiB, {kv_tokens} tokens) cannot hold one request of "
            f"--max-model-len {max_model_len} ({need_tokens} tokens, {gib(need_kv):.2f} GiB; "
            f"{gib(short):.2f} GiB short): " + "; or ".join(fixes))


def plan_memory(total_bytes: int, mem_fraction_static: float, weights_bytes: int, activation_bytes: int | Sequence[int],
                graph_pool_bytes: int, reserve_bytes: int, kv_bytes_per_token: int, block_size: int,
                max_model_len: int, max_running_requests: int, tp: int = 1,
                activation_parts: Sequence[tuple[str, int]] = (), request_tokens: int | None = None,
                kv_parts: Sequence[tuple[str, int]] = (), latent_bytes_per_token: int = 0, latent_pages: int = 0,
                latent_window: int = 0) -> MemoryPlan:
    """Size the KV pool from what the static budget leaves (see module docstring).

    ``activation_bytes`` is the activation peak, or several peaks (prefill chunk, decode batch):
    they never run at once, so the budget reserves their maximum.
    ``request_tokens``: the KV tokens one request of ``max_model_len`` holds at once, counted per layer type
    (layers/kv_layout.KVLayout.held_tokens: a model whose every layer is windowed holds its window, not its
    length); None: ``max_model_len``.
    ``latent_bytes_per_token`` and ``latent_pages`` (wanted, the dummy page included): the latents paged apart
    (module docstring); ``kv_bytes_per_token`` counts them too.
    """
    act = max(activation_bytes) if isinstance(activation_bytes, Sequence) else activation_bytes
    static = int(total_bytes * mem_fraction_static)
    fixed = weights_bytes + act + graph_pool_bytes + reserve_bytes
    kv_pool = static - fixed
    pool = split_kv_bytes(kv_pool, kv_bytes_per_token, block_size, latent_bytes_per_token, latent_pages)
    pages, block_bytes, kv_tokens = pool.latent_pages, pool.block_bytes_per_token, pool.num_blocks * block_size
    held = max_model_len if request_tokens is None else min(request_tokens, max_model_len)
    need_tokens = math.ceil(held / block_size) * block_size
    fits = kv_tokens >= need_tokens
    refusal = None
    if not fits:
        # the latent pages come before the blocks, as fixed as the weights for what a longer request needs
        latents = pages * block_size * latent_bytes_per_token
        refusal = _refusal(total_bytes, mem_fraction_static, fixed + latents, kv_pool, kv_tokens, need_tokens,
                           block_bytes, weights_bytes, graph_pool_bytes, max_model_len, tp, held < max_model_len)
    return MemoryPlan(
        total_bytes=int(total_bytes), mem_fraction_static=mem_fraction_static, static_bytes=static,
        weights_bytes=int(weights_bytes), activation_bytes=int(act), graph_pool_bytes=int(graph_pool_bytes),
        reserve_bytes=int(reserve_bytes), kv_pool_bytes=int(kv_pool), kv_bytes_per_token=int(kv_bytes_per_token),
        block_size=block_size, kv_tokens=int(kv_tokens), num_blocks=int(kv_tokens // block_size),
        max_model_len=max_model_len, max_running_requests=max_running_requests,
        max_concurrent_at_max_len=int(min(kv_tokens // need_tokens, max_running_requests)),
        fits=fits, refusal=refusal, activation_parts=tuple((n, int(b)) for n, b in activation_parts),
        kv_parts=tuple((n, int(b)) for n, b in kv_parts), latent_pages=int(pages),
        latent_bytes_per_token=int(latent_bytes_per_token if pages else 0), latent_window=int(latent_window),
    )
