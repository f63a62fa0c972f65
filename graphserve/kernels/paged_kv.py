"""Two conventions of the paged KV cache that the kernels, the attention layers and the block pool share.

Block 0 is the dummy block: the block pool never hands it out, and padding rows (CUDA-graph padding) point
their slots and block tables at it, so they can never touch a real request's KV. A value enters the cache
through ``to_cache_dtype`` (the PyTorch writes) or its Triton twin ``kv_write.cache_value``: saturated
before an fp8 cast, since torch's cast saturates on CPU but gives NaN on CUDA (layers/kv_layout.py)."""

from __future__ import annotations

import torch

DUMMY_BLOCK = 0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: into fp8 (scale 1.0) clamped to the format's largest finite value first."""
    if dtype.itemsize == 1:
        x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    return x.to(dtype)
