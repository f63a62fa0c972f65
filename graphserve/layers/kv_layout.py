"""What one token leaves in the KV cache of one layer, and how the paged pool stores it.

A model family describes its cache with a ``KVLayout``; the block pool, the memory plan,
``graphserve plan`` and the benchmarks' floors read it instead of assuming one shape:

- ``kind="kv"`` (MHA / GQA): K and V per KV head, one tensor per layer
  ``[2, num_blocks, block_size, num_heads, head_dim]``;
- ``kind="latent"`` (multi-head latent attention): one shared "head" per token holding the
  compressed KV and the rope part of the key, ``[num_blocks, block_size, 1, head_dim]``; the
  values are read back out of the latent, so nothing else is cached.

Either way a token's *slot* is ``block_id * block_size + offset`` and block 0 is the dummy block
(layers/forward_batch.py).

Layers come in types by their attention window (``windows``, one per layer: None for full attention). A block
id indexes every layer's cache at once, so what one sequence holds is the most any of its layer types needs: the
memory plan counts per layer type (``held_tokens``). Where every layer is windowed (Mistral-7B v0.1), blocks
wholly outside the window of a running sequence go back to the pool (engine/kv_cache.py); where only some are
(gpt-oss alternates), a full-attention layer still needs every block, so they are kept and the windowed layers
merely skip them.

``dtype`` is the model's (``--kv-cache-dtype auto``) or float8_e4m3fn (``fp8_e4m3``), for either kind:
half the bytes per token, so twice the tokens in the same pool and half the KV reads per decode step.
FP8 entries are stored with a per-tensor scale of 1.0 (vLLM's default without calibrated scales): K and
V, or the latent and the rope key, are rounded to the model dtype as without fp8, then cast on the
write, saturating at +-448 (e4m3's largest finite value), and widened to the query's dtype as the
attention kernels load them. The PyTorch writes and the MLA prologue clamp before the cast
(``to_cache_dtype``): torch's cast saturates on CPU but gives NaN on CUDA, as Triton's interpreter does.
Post-norm, post-rotary K and V and the RMS-normed latent sit far inside that range; what FP8 costs is
e4m3's 3 mantissa bits, a relative rounding of at most 2^-4 per element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KVKind = Literal["kv", "latent"]
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}  # --kv-cache-dtype (besides "auto": the model dtype)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: into fp8 (scale 1.0) clamped to the format's largest finite value first."""
    if dtype.itemsize == 1:
        x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    return x.to(dtype)


@dataclass(frozen=True)
class KVLayout:
    kind: KVKind
    num_layers: int
    num_heads: int  # cached heads per token and layer on this rank (1 for a latent cache)
    head_dim: int  # width of one cached head (K and V for "kv"; latent + rope key for "latent")
    dtype: torch.dtype
    # each layer's attention window (None: full attention); empty: every layer attends in full
    windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("kv", "latent"):
            raise ValueError(f"KVLayout.kind={self.kind!r}: choose 'kv' or 'latent'")
        if self.kind == "latent" and self.num_heads != 1:
            raise ValueError(f"a latent KV cache has one shared head per token, got num_heads={self.num_heads}")
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(f"KVLayout.windows names {len(self.windows)} layers, the cache has {self.num_layers}")

    @property
    def release_window(self) -> int | None:
        """The window outside which a running sequence's blocks can go back to the pool: the largest, where every
        layer is windowed; None where some layer attends in full (it reads every block)."""
        if not self.windows or any(w is None for w in self.windows):
            return None
        return max(self.windows)

    def held_tokens(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """The most KV tokens (whole blocks) one sequence of ``num_tokens`` holds at once, computing at most
        ``chunk`` tokens a step, counted per layer type: a full-attention type holds every token; a windowed one
        (all layers windowed, blocks released) its window, the chunk, and a block where each edge falls mid-block.
        The types share block ids, so the largest count is what the pool must give."""
        full = -(-num_tokens // block_size) * block_size
        window = self.release_window
        if window is None:
            return full
        return min(full, (-(-(window + max(chunk, 1) - 1) // block_size) + 1) * block_size)

    @property
    def entries(self) -> int:
        """Cached vectors per head: K and V, or the one latent."""
        return 2 if self.kind == "kv" else 1

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.entries * self.num_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Every layer's cache for one token: what the KV pool is sized by."""
        return self.num_layers * self.bytes_per_token_per_layer

    def layer_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        if self.kind == "kv":
            return (2, num_blocks, block_size, self.num_heads, self.head_dim)
        return (num_blocks, block_size, 1, self.head_dim)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device | str,
                 fill: str = "zeros") -> list[torch.Tensor]:
        """One cache tensor per layer. ``fill="random"`` draws N(0, 0.5²) (benchmarks: never time on zeros)."""
        shape = self.layer_shape(num_blocks, block_size)
        if fill == "random":  # drawn in bf16 where the cache dtype (fp8) has no random generator
            draw = self.dtype if self.dtype.itemsize > 1 else torch.bfloat16
            return [torch.randn(shape, dtype=draw, device=device).mul_(0.5).to(self.dtype)
                    for _ in range(self.num_layers)]
        return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]
