"""Host staging of a step's input arrays: one packed buffer, every array back with its dtype and shape."""

from __future__ import annotations

import numpy as np
import torch

from graphserve.engine.staging import HostStaging


def test_upload_packs_mixed_dtypes_at_aligned_offsets_and_returns_them_intact():
    staging = HostStaging(torch.device("cpu"))
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(-5, 5, size=3, dtype=np.int32),  # 12 bytes: the next array must still start aligned
        rng.integers(0, 1 << 40, size=5, dtype=np.int64),
        rng.random((2, 3), dtype=np.float32),
        rng.random(1, dtype=np.float64),
        rng.integers(0, 9, size=(4, 7), dtype=np.int32),
    ]
    tensors = staging.upload(*arrays)
    for a, t in zip(arrays, tensors):
        assert tuple(t.shape) == a.shape and t.numpy().dtype == a.dtype
        assert np.array_equal(t.numpy(), a)
        assert t.data_ptr() % 8 == 0


def test_each_cpu_upload_gets_fresh_memory():
    """On CPU the batch's tensors are views of the staged bytes, so a later step must not overwrite them."""
    staging = HostStaging(torch.device("cpu"))
    (first,) = staging.upload(np.arange(4, dtype=np.int64))
    (second,) = staging.upload(np.arange(4, 8, dtype=np.int64))
    assert first.tolist() == [0, 1, 2, 3] and second.tolist() == [4, 5, 6, 7]
