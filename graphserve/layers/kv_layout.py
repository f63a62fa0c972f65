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

Sparse attention (DeepSeek-V3.2, GLM-5) adds an indexer key cache to the latent: one key of
``index_head_dim`` per token for each of ``index_layers`` layers (those that own an indexer), paged by
the same block tables, so the prefix cache, preemption and the pool's sizing treat a token's latent and
its index keys as one. ``allocate`` returns the ``num_layers`` attention caches followed by the
``index_layers`` indexer caches ``[num_blocks, block_size, index_head_dim]`` in layer order: every step
already carries that one list (``ForwardBatch.kv_caches``), and a model finds its indexer caches at
``num_layers + i``. Their ``index_dtype`` is the model's, or with ``--kv-cache-dtype fp8_e4m3`` the FP8 form
(``index_dtype`` uint8): per token ``index_head_dim`` e4m3 bytes then one fp32 scale (amax / 448), 132 bytes
for a 128-dim key instead of 256 (kernels/dsa_reference.py writes and reads it). A per-token scale rather than
the latent's fixed 1.0, since the keys are LayerNorm outputs whose range the indexer's ranking depends on.

Compressed attention (DeepSeek-V4) adds one compact page cache per entry of ``compact``: ``[num_blocks, page]``
in ``row_dtype`` (the model's, whatever ``--kv-cache-dtype`` says), after the indexer caches in ``allocate``'s
list. A block's page holds, first, the layer's compressor checkpoint (``state_bytes`` of fp32 accumulators, the
state after the last token written into the block) and then ``max(1, block_size // rate)`` compressed entries of
``entry_width`` (models/deepseek_v4.py, kernels/v4_reference.py): one entry per ``rate`` tokens and one checkpoint
per block, where a row per token (the state of every token, an entry column in every row) cost ~30 KB a token.
A page's size depends on the block size, so ``bytes_per_token`` counts the pages at ``block_size`` (the engine's
``--block-size``, set by ``with_block_size``), rounded up to whole bytes.

Its latents are read only in the last ``latent_window`` positions of a sequence, while its compact pages are read
over the whole context, so the two are paged apart (``latent_window`` set): each layer's latents live in
``[latent_pages, block_size, 1, head_dim]`` and a block's latents in page ``latent_page[block]`` of a device int32 map
``[num_blocks]``, the last tensor of ``allocate``'s list (``latent_map_index``). The block manager gives a block a page
while some sequence's window covers it (engine/kv_cache.py) and writes the map in place, so the tensor a CUDA graph
captured stays the one it reads. Page 0 is the dummy page: a block without a page maps to it, so a stray address
(a padding row, a block past the window) lands there, never out of bounds. ``allocate`` without ``latent_pages``
gives every block its own page (the identity map): benchmarks and harnesses that build their own block tables.

``dtype`` is the model's (``--kv-cache-dtype auto``) or float8_e4m3fn (``fp8_e4m3``), for either kind:
half the bytes per token, so twice the tokens in the same pool and half the KV reads per decode step.
FP8 entries are stored with a per-tensor scale of 1.0 (vLLM's default without calibrated scales): K and
V, or the latent and the rope key, are rounded to the model dtype as without fp8, then cast on the
write, saturating at +-448 (e4m3's largest finite value), and widened to the query's dtype as the
attention kernels load them. The PyTorch writes and the MLA prologue clamp before the cast
(kernels/paged_kv.py's ``to_cache_dtype``): torch's cast saturates on CPU but gives NaN on CUDA, as Triton's interpreter does.
Post-norm, post-rotary K and V and the RMS-normed latent sit far inside that range; what FP8 costs is
e4m3's 3 mantissa bits, a relative rounding of at most 2^-4 per element.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

KVKind = Literal["kv", "latent"]
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}  # --kv-cache-dtype (besides "auto": the model dtype)
INDEX_SCALE_BYTES = 4  # the FP8 index key form's per-token fp32 scale


@dataclass(frozen=True)
class CompactCache:
    """One compressed layer's page: a ``state_bytes`` checkpoint, then one ``entry_width`` row per ``rate`` tokens of
    the block (one row where a block holds fewer than ``rate`` tokens: the block holding a group's last token)."""

    rate: int
    entry_width: int  # elements (row dtype) of one compressed entry
    state_bytes: int  # the block's compressor checkpoint, fp32 accumulators

    def entries_per_block(self, block_size: int) -> int:
        return max(1, block_size // self.rate)

    def page_width(self, block_size: int, itemsize: int) -> int:
        """Elements (row dtype) of one block's page."""
        return self.state_bytes // itemsize + self.entries_per_block(block_size) * self.entry_width


def with_block_size(layout: KVLayout, block_size: int) -> KVLayout:
    """``layout`` counted at ``--block-size`` (only compact pages depend on it)."""
    return dataclasses.replace(layout, block_size=block_size) if layout.compact else layout


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def with_cache_dtype(layout: KVLayout, name: str) -> KVLayout:
    """``layout`` as ``--kv-cache-dtype name`` stores it: the attention caches in that dtype, and the indexer keys
    (if any) in their FP8 form under an fp8 name."""
    if name == "auto":
        return layout
    index = torch.uint8 if layout.index_layers else layout.index_dtype
    return dataclasses.replace(layout, dtype=KV_CACHE_DTYPES[name], index_dtype=index)


@dataclass(frozen=True)
class KVLayout:
    kind: KVKind
    num_layers: int
    num_heads: int  # cached heads per token and layer on this rank (1 for a latent cache)
    head_dim: int  # width of one cached head (K and V for "kv"; latent + rope key for "latent")
    dtype: torch.dtype
    # each layer's attention window (None: full attention); empty: every layer attends in full
    windows: tuple[int | None, ...] = ()
    index_layers: int = 0  # layers with an indexer key cache (sparse attention), 0 for none
    index_head_dim: int = 0
    index_dtype: torch.dtype | None = None  # the model's, or uint8 for the FP8 form; None without indexer
    compact: tuple[CompactCache, ...] = ()  # one page cache per compressed layer (compressed attention)
    row_dtype: torch.dtype | None = None
    block_size: int = 16  # what compact pages are counted at (with_block_size)
    # the positions a query reads the latents of (DeepSeek-V4's sliding window): latents paged apart, through a map
    latent_window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("kv", "latent"):
            raise ValueError(f"KVLayout.kind={self.kind!r}: choose 'kv' or 'latent'")
        if self.kind == "latent" and self.num_heads != 1:
            raise ValueError(f"a latent KV cache has one shared head per token, got num_heads={self.num_heads}")
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(f"KVLayout.windows names {len(self.windows)} layers, the cache has {self.num_layers}")
        if self.index_layers and (self.index_head_dim < 1 or self.index_dtype is None):
            raise ValueError(f"an indexer key cache needs index_head_dim >= 1 and index_dtype, got "
                             f"{self.index_head_dim} / {self.index_dtype}")

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
    def index_row_width(self) -> int:
        """Elements of one cached indexer key: the key, or in the FP8 form its bytes and its scale's."""
        return self.index_head_dim + (INDEX_SCALE_BYTES if self.index_dtype == torch.uint8 else 0)

    @property
    def index_bytes_per_token(self) -> int:
        """Every indexer layer's key for one token (0 without sparse attention)."""
        return self.index_layers * self.index_row_width * self.index_dtype.itemsize if self.index_layers else 0

    @property
    def bytes_per_token(self) -> int:
        """Every layer's cache for one token, indexer keys included: what the KV pool is sized by."""
        return self.num_layers * self.bytes_per_token_per_layer + self.index_bytes_per_token + self.row_bytes_per_token

    def _per_token(self, page_bytes: int) -> int:
        return -(-page_bytes // self.block_size)

    @property
    def row_bytes_per_token(self) -> int:
        """The compact pages' bytes per token at ``block_size``, rounded up."""
        if not self.compact:
            return 0
        b = self.row_dtype.itemsize
        return self._per_token(sum(c.page_width(self.block_size, b) for c in self.compact) * b)

    def row_parts(self) -> tuple[tuple[str, int], ...]:
        if not self.compact:
            return ()
        b, bs = self.row_dtype.itemsize, self.block_size
        return (("compressor state", self._per_token(sum(c.state_bytes for c in self.compact))),
                ("compressed entries", self._per_token(sum(c.entries_per_block(bs) * c.entry_width
                                                           for c in self.compact) * b)))  # fmt: skip

    def parts(self) -> tuple[tuple[str, int], ...]:
        """A token's bytes by cache, where there is more than one (the memory plan's table names them)."""
        if not self.index_layers and not self.compact:
            return ()
        main = (("latent" if self.kind == "latent" else "K/V", self.num_layers * self.bytes_per_token_per_layer),)
        index = (("indexer keys", self.index_bytes_per_token),) if self.index_layers else ()
        return main + index + self.row_parts()

    @property
    def latent_map_index(self) -> int | None:
        """Where ``allocate``'s list holds the block -> latent page map (None: latents paged by block id)."""
        return None if self.latent_window is None else self.num_layers + self.index_layers + len(self.compact)

    def latent_pages_needed(self, block_size: int, chunk: int = 1) -> int:
        """The most latent pages one running sequence holds: its window behind a step's first query, the step's
        ``chunk`` tokens, and a page where each edge falls mid-block."""
        return -(-(self.latent_window - 1 + max(chunk, 1)) // block_size) + 1

    def latent_pages_wanted(self, block_size: int, max_running: int, chunk: int) -> int:
        """The latent pages a pool is given (the dummy page included): what ``max_running`` windows hold at once,
        each one behind a decode token or its share of a step's ``chunk`` prefill tokens (a page more a prefilling
        sequence, where its chunk's edge falls mid-block), twice over, so that as many cached prefixes as running
        requests keep their window's latents for a prefix hit (engine/latent_pages.py)."""
        running = max_running * (-(-(self.latent_window - 1) // block_size) + 2) + -(-chunk // block_size)
        return 2 * running + 1

    @property
    def latent_bytes_per_token(self) -> int:
        """The bytes a token's latents take where they are paged apart (``latent_window``), else 0."""
        return self.num_layers * self.bytes_per_token_per_layer if self.latent_window is not None else 0

    def layer_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        if self.kind == "kv":
            return (2, num_blocks, block_size, self.num_heads, self.head_dim)
        return (num_blocks, block_size, 1, self.head_dim)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device | str,
                 fill: str = "zeros", latent_pages: int | None = None) -> list[torch.Tensor]:
        """One cache tensor per layer, then one per indexer layer, one per compact cache and (``latent_window``) the
        latent page map. ``fill="random"`` draws N(0, 0.5²) (benchmarks: never time on zeros). ``latent_pages``:
        the latents' own page count, the map all dummy page until the block manager fills it; None: one page a
        block, the identity map."""
        pages = num_blocks if latent_pages is None or self.latent_window is None else latent_pages
        if pages < 1:
            raise ValueError(f"latent_pages={pages}: need at least 1 (page 0 is the dummy page)")
        parts = [(self.layer_shape(pages, block_size), self.dtype)] * self.num_layers
        parts += [((num_blocks, block_size, self.index_row_width), self.index_dtype)] * self.index_layers
        b = self.row_dtype.itemsize if self.compact else 1
        parts += [((num_blocks, c.page_width(block_size, b)), self.row_dtype) for c in self.compact]
        if fill != "random":
            return ([torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in parts]
                    + self._latent_map(num_blocks, latent_pages, device))
        caches = []
        for shape, dtype in parts:  # drawn in bf16 where the cache dtype (fp8) has no random generator
            if dtype == torch.uint8:  # FP8 index keys: quantized draws, so every row's scale is a real one
                from graphserve.kernels.dsa_reference import quantize_index_keys

                keys = torch.randn(*shape[:-1], self.index_head_dim, dtype=torch.bfloat16, device=device)
                caches.append(quantize_index_keys(keys.mul_(0.5).flatten(0, 1)).view(shape))
            else:
                caches.append(torch.randn(shape, dtype=dtype if dtype.itemsize > 1 else torch.bfloat16,
                                          device=device).mul_(0.5).to(dtype))
        for c, page in zip(self.compact, caches[len(caches) - len(self.compact):]):
            # random bits are no fp32 accumulator (NaN, inf): zeros are a finite one (a zero-valued token at logit 0),
            # all a benchmark's first step reads
            page[:, :c.state_bytes // b].zero_()
        return caches + self._latent_map(num_blocks, latent_pages, device)

    def _latent_map(self, num_blocks: int, latent_pages: int | None, device: torch.device | str) -> list[torch.Tensor]:
        if self.latent_window is None:
            return []
        if latent_pages is None:
            return [torch.arange(num_blocks, dtype=torch.int32, device=device)]
        return [torch.zeros(num_blocks, dtype=torch.int32, device=device)]
