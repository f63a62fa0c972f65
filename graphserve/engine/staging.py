"""Host->device copies of a step's small input arrays, through a ring of pinned buffers.

A copy from pageable memory may make the driver wait for the stream, which would stall the host
behind the GPU and undo the overlap of step N+1's preparation with step N. So every array a decode
step sends goes through pinned memory, packed into one buffer per call (one copy). Buffers are
reused round-robin; before one is refilled, the host waits for the copy that last read it, which
with a ring of four finished steps ago.
"""

from __future__ import annotations

import numpy as np
import torch

RING = 4
_ALIGN = 8  # every array starts on an 8-byte boundary, so int64/float64 views stay aligned

_TORCH_DTYPE = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


class HostStaging:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor | None] = [None] * RING
        self._events: list[torch.cuda.Event | None] = [None] * RING
        self._next = 0

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Device tensors with the arrays' shapes and dtypes (int32/int64/float32/float64)."""
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        host = self._buffer(max(total, _ALIGN))
        raw = host.numpy()
        for a, off in zip(arrays, offsets):
            raw[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        dev = host
        if self.device.type != "cpu":
            dev = host.to(self.device, non_blocking=True)
            event = self._events[self._slot] or torch.cuda.Event()
            event.record()
            self._events[self._slot] = event
        return [
            dev[off : off + a.nbytes].view(_TORCH_DTYPE[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)
        ]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """The next host buffer of at least ``nbytes``: fresh memory on CPU (the batch's tensors are
        views of it), the next pinned ring slot on CUDA once the copy that last read it has run."""
        if self.device.type == "cpu":
            return torch.empty(nbytes, dtype=torch.uint8)
        self._slot = slot = self._next
        self._next = (slot + 1) % RING
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            grown = max(nbytes, 2 * (0 if buf is None else buf.numel()))
            buf = self._buffers[slot] = torch.empty(grown, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes]
