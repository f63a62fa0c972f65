"""A bounds checker for Triton's interpreter: every access a lane makes lies inside a launch's tensors.

The interpreter reads and writes raw host addresses without checking them, so a pointer past a
tensor quietly reads a neighbour where the GPU raises an illegal memory access (or, worse, reads a
neighbour there too). Inside ``bounds_checked()`` each interpreted launch records the byte range of
every tensor argument, and every masked-in lane of a load, store or atomic must fall inside one of
them, else IndexError names the kernel, the access and how many lanes strayed.

The range of a tensor argument is its view's extent (its first to its last element), not the whole
storage: a graph's static block table is handed to a kernel as ``table[:padded_size]``, and a read of
the row after the last one lands in real memory on the GPU yet reads another step's row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def view_extent(t: torch.Tensor, base: int) -> tuple[int, int]:
    """[lo, hi) bytes of the elements of ``t`` when its storage starts at address ``base``."""
    if t.numel() == 0:
        return base, base
    first = base + t.storage_offset() * t.element_size()
    lo = first + sum(min(0, (n - 1) * s) for n, s in zip(t.shape, t.stride())) * t.element_size()
    hi = first + (sum(max(0, (n - 1) * s) for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
    return lo, hi


@contextlib.contextmanager
def bounds_checked() -> Iterator[list[str]]:
    """Check every interpreted launch in the block; yields the names of the kernels it saw launched."""
    from triton.runtime import interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    saved = {name: getattr(cls, name) for cls, name in [
        (executor, "_init_args_hst"), (executor, "__call__"), (builder, "create_masked_load"),
        (builder, "create_masked_store"), (builder, "create_atomic_rmw"), (builder, "create_atomic_cas"),
    ]}  # fmt: skip
    ranges: list[tuple[int, int]] = []
    launched: list[str] = []

    def check(ptrs, mask, itemsize: int, what: str) -> None:
        lanes = ptrs.data[mask.data] if mask is not None else ptrs.data.ravel()
        inside = np.zeros(lanes.shape, dtype=bool)
        for lo, hi in ranges:
            inside |= (lanes >= lo) & (lanes + itemsize <= hi)
        if not inside.all():
            bad = lanes[~inside]
            raise IndexError(f"{launched[-1] if launched else '?'}: {what} out of bounds in {bad.size} of "
                             f"{lanes.size} lanes (first address {int(bad[0]):#x}, tensors {ranges})")

    def itemsize_of(ptrs) -> int:
        return np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize

    def init_args(self, args, kwargs):
        host_args, host_kwargs = saved["_init_args_hst"](self, args, kwargs)
        ranges.clear()
        for a in [*host_args, *host_kwargs.values()]:
            if isinstance(a, torch.Tensor):
                ranges.append(view_extent(a, a.untyped_storage().data_ptr()))
        return host_args, host_kwargs

    def call(self, *args, **kwargs):
        launched.append(getattr(self.fn, "__name__", str(self.fn)))
        return saved["__call__"](self, *args, **kwargs)

    def masked_load(self, ptrs, mask, other, *rest):
        check(ptrs, mask, itemsize_of(ptrs), "load")
        return saved["create_masked_load"](self, ptrs, mask, other, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, itemsize_of(ptrs), "store")
        return saved["create_masked_store"](self, ptrs, value, mask, *rest)

    def atomic_rmw(self, op, ptrs, val, mask, *rest):
        check(ptrs, mask, itemsize_of(ptrs), "atomic")
        return saved["create_atomic_rmw"](self, op, ptrs, val, mask, *rest)

    def atomic_cas(self, ptrs, cmp, val, *rest):
        check(ptrs, None, itemsize_of(ptrs), "atomic_cas")
        return saved["create_atomic_cas"](self, ptrs, cmp, val, *rest)

    executor._init_args_hst, executor.__call__ = init_args, call
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    try:
        yield launched
    finally:
        for cls, name in [(executor, "_init_args_hst"), (executor, "__call__")]:
            setattr(cls, name, saved[name])
        for name in ["create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas"]:
            setattr(builder, name, saved[name])
