"""One-shot all-reduce over peer memory, for the small messages of decode (CUDA, tp > 1).

A decode step at tp 2 all-reduces ``[batch, hidden]`` twice per layer: 8-512 KB messages for which NCCL
costs ~20 µs inside a CUDA graph on an H200 pair (issue 10's measurement), mostly protocol latency. Here
each rank copies its input into a buffer every rank has mapped (PyTorch's symmetric memory, rendezvoused
once at start-up), and one kernel on each rank reads all ranks' buffers and writes the sum: one launch,
one barrier through signal pads, no proxy thread. It is an ordinary kernel, so CUDA graphs capture it.

The engine measures per message size which of NCCL, one-shot and two-shot runs it (allreduce_choice.py).
``maybe_enable_custom_all_reduce`` (benchmarks/tp.py) keeps the fixed rule: messages above
``CUSTOM_ALL_REDUCE_MAX_BYTES`` (bandwidth-bound: reading every peer's whole buffer loses to NCCL's
ring/tree) go to NCCL. The limit is the switch point benchmarks/tp.py measures on a 2-GPU
machine (its ``allreduce`` table); NVLink multicast is never used (state.py sets it off).

The two-shot variant (``SymmMemAllReduce.two_shot``) splits the message in one slice per rank: each rank
sums its slice over every peer's buffer (a reduce-scatter) and then reads every rank's summed slice (an
all-gather). Each rank reads 2·(W−1)/W of the message instead of (W−1) messages, which wins where peer
reads are slow or the message large (PCIe, 4 and 8 ranks); ``two_shot_reference`` is the same arithmetic in
plain PyTorch. Which of NCCL, one-shot and two-shot runs each message size is measured at start-up
(allreduce_choice.py).

At start-up the kernel's result is checked against NCCL on random data; a mismatch, a missing op (older
PyTorch) or peers that cannot map each other's memory leave NCCL alone in charge, with a log line.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from graphserve.config import EngineConfig
    from graphserve.distributed.state import ParallelState

logger = logging.getLogger("graphserve.distributed")

# Switch point to NCCL; set from benchmarks/tp.py's allreduce sweep on 2×H200 (custom vs NCCL in graphs).
CUSTOM_ALL_REDUCE_MAX_BYTES = 2 * 1024 * 1024  # 2xH200 at 8103434: one-shot 22.1 us vs NCCL 30.2 us in a graph at 2 MiB, loses at 8 MiB
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class SymmMemAllReduce:
    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype,
                 max_bytes: int = CUSTOM_ALL_REDUCE_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype} is not one of {_DTYPES}")
        self.group_name = group.group_name
        if self.group_name in getattr(symm_mem, "_group_name_to_store", {}):
            # registered for an earlier process group of the same name (this process left and rejoined):
            # its store is gone, and a rendezvous through it would wait forever
            raise RuntimeError(f"peer memory is already registered for a process group named {self.group_name!r}")
        self.dtype, self.max_bytes = dtype, max_bytes
        self._op = torch.ops.symm_mem.one_shot_all_reduce_copy_out  # missing in older PyTorch: raises here
        self._two_shot_op = getattr(torch.ops.symm_mem, "two_shot_all_reduce_out", None)
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        # one buffer in the model's dtype: the op reads a prefix of it, starting at the mapped base
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)

    def rendezvous(self) -> None:
        """Map every rank's buffer (a collective: call it on every rank, only once all could allocate)."""
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.rendezvous(self.buffer, self.group_name)

    def accepts(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.is_cuda and x.dtype == self.dtype and x.is_contiguous() and 0 < nbytes <= self.max_bytes \
            and nbytes % 16 == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        out = torch.empty_like(flat)
        self._op(self.buffer[: flat.numel()], flat, "sum", self.group_name, out)
        return out.view(x.shape)

    @property
    def has_two_shot(self) -> bool:
        return self._two_shot_op is not None

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        """Reduce-scatter then all-gather through the mapped buffers (the op overwrites its symmetric input,
        so the message is staged into the buffer first)."""
        flat = x.view(-1)
        staged = self.buffer[: flat.numel()]
        staged.copy_(flat)
        out = torch.empty_like(flat)
        self._two_shot_op(staged, "sum", self.group_name, out)
        return out.view(x.shape)

    def close(self) -> None:
        self.buffer = None


def two_shot_reference(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What ``two_shot`` computes, rank by rank: ``inputs[r]`` is rank r's message; each rank sums its own
    slice of every rank's message (slices of ceil(n / W) elements, the last one short), then gathers every
    rank's summed slice. Returns each rank's output (all equal to the sum, in the slices' summation order)."""
    world = len(inputs)
    flat = [x.reshape(-1) for x in inputs]
    n = flat[0].numel()
    step = -(-n // world)
    reduced = []
    for r in range(world):  # the reduce-scatter: rank r owns elements [r*step, (r+1)*step)
        lo, hi = min(r * step, n), min((r + 1) * step, n)
        acc = flat[0][lo:hi].float().clone()
        for peer in range(1, world):
            acc += flat[peer][lo:hi].float()
        reduced.append(acc.to(flat[0].dtype))
    gathered = torch.cat(reduced)  # the all-gather: every rank reads every owner's slice
    return [gathered.view(inputs[0].shape).clone() for _ in range(world)]


def _agrees_with_nccl(impl: SymmMemAllReduce, group: Any, device: torch.device) -> bool:
    gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank(group))
    inputs = [torch.randn(rows, 1024, generator=gen, device=device).to(impl.dtype) for rows in (1, 7, 64)]
    inputs = [x for x in inputs if impl.accepts(x)]
    expected = [x.float() for x in inputs]
    for e in expected:
        dist.all_reduce(e, group=group)
    tol = 1e-5 if impl.dtype == torch.float32 else 2e-2
    try:
        # every call on every rank, whatever the comparisons say: the kernel waits for its peers
        got = [impl.all_reduce(x.clone()).float() for x in inputs]
        ok = bool(inputs) and all(torch.allclose(g, e, rtol=tol, atol=tol * 4) for g, e in zip(got, expected))
    except Exception:  # noqa: BLE001 - an op this PyTorch lacks or refuses: NCCL it is, on every rank
        logger.exception("the one-shot all-reduce raised at its start-up check")
        ok = False
    return _all_ranks(ok, group, device)  # every rank keeps or drops it together


def _all_ranks(ok: bool, group: Any, device: torch.device) -> bool:
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def maybe_enable_custom_all_reduce(parallel: ParallelState, config: EngineConfig, device: torch.device,
                                   dtype: torch.dtype) -> None:
    """Install the one-shot all-reduce for this rank's device group, or leave NCCL alone (said in the log).
    ``dtype``: the model's activations' (models/parallel_check.model_dtype), which its buffer holds.

    Every rank calls it at the same point of start-up: the rendezvous and the check are collectives."""
    from graphserve.distributed.state import set_custom_all_reduce

    if not parallel.distributed or parallel.backend != "nccl" or config.disable_custom_all_reduce:
        return
    group = parallel.device_group
    impl: SymmMemAllReduce | None = None
    reason = ""
    try:  # local steps only: every rank learns whether all could, before the collective rendezvous
        impl = SymmMemAllReduce(group, device, dtype)
    except Exception as e:  # noqa: BLE001 - no symmetric memory here: NCCL does every all-reduce
        reason = f"{type(e).__name__}: {e}"
    if _all_ranks(impl is not None, group, device):
        assert impl is not None
        impl.rendezvous()
        if _agrees_with_nccl(impl, group, device):
            set_custom_all_reduce(impl)
            logger.info("one-shot all-reduce over peer memory for %s messages up to %d KiB; NCCL above",
                        impl.dtype, impl.max_bytes // 1024)
            return
        reason = "its result disagreed with NCCL's (or raised)"
    logger.warning("one-shot all-reduce unavailable (%s): NCCL runs every all-reduce",
                   reason or "another rank could not set it up")
