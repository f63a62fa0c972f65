"""DeepSeek sparse attention on the GPU: the functions of kernels/dsa_reference.py, same signatures, as Triton
kernels (kernels/dsa_indexer.py, kernels/dsa_topk.py, kernels/sparse_mla.py).

Every call takes static shapes and reads no value back to the host, so a decode or extend step that calls them
captures in a CUDA graph; padding rows (``token_rows`` points them at the last sequence, position 0) read
one key and one latent row that exist and write outputs nobody reads.

``token_rows`` is the reference's: a handful of elementwise ops and one ``searchsorted`` on ``[T]`` ints,
already on the device and capturable.

``topk_indices`` picks, from the static shape, the Triton radix select or ``torch.topk`` over tie-exact int64
keys, whichever the measured cost models of kernels/dsa_topk.py say is faster (``TOPK_METHOD`` or the ``method``
argument force one); benchmarks/dsa_kernels.py times both. Both return the same set.
"""

from __future__ import annotations

import torch

from graphserve.kernels.common import sm_count
from graphserve.kernels.dsa_indexer import indexer_scores, write_index_cache
from graphserve.kernels.dsa_reference import index_cache_shape, token_rows
from graphserve.kernels.dsa_topk import TOPK_METHODS, choose_topk_method, topk_indices_torch, topk_indices_triton
from graphserve.kernels.sparse_mla import sparse_mla

__all__ = ["index_cache_shape", "indexer_scores", "indexer_topk", "sparse_mla", "token_rows", "topk_indices",
           "write_index_cache"]  # fmt: skip

TOPK_METHOD = "auto"


def topk_indices(scores: torch.Tensor, row_pos: torch.Tensor, k: int, method: str | None = None) -> torch.Tensor:
    """``[T, k]`` int32 positions of each row's ``k`` largest scores among ``0..row_pos[t]`` (ties: the lower
    position), ``-1`` where a row has fewer than ``k``."""
    method = method or TOPK_METHOD
    if method not in TOPK_METHODS:
        raise ValueError(f"top-k method {method!r}: one of {TOPK_METHODS}")
    if k < 1:
        raise ValueError(f"top-k k={k}: must be >= 1")
    if method == "auto":
        method = choose_topk_method(scores.shape[0], scores.shape[1], sm_count(scores.device))
    if method == "torch":
        return topk_indices_torch(scores, row_pos, k)
    return topk_indices_triton(scores, row_pos, k)


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_tables: torch.Tensor,
    row_seq: torch.Tensor, row_pos: torch.Tensor, max_len: int, k: int, method: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """``topk_indices(indexer_scores(...), row_pos, k)``: the scores go through one ``[T, max_len]`` fp32
    buffer between the two kernels."""
    scores = indexer_scores(q, weights, index_cache, block_tables, row_seq, row_pos, max_len)
    return topk_indices(scores, row_pos, k, method)
