"""Collectives of the forward pass, and their tally.

Every one is a no-op returning its input when the model runs on one rank, so the same model code
runs at tp 1 with no communication. On CUDA they are issued on the current stream, which is the
capture stream while a CUDA graph is recorded: NCCL kernels (and the one-shot peer-memory kernel)
are captured with the rest of the step and replayed with it.

``all_reduce`` hands a message to the peer-memory path (one-shot or two-shot, custom_all_reduce.py) that the
start-up measurement chose for its size (allreduce_choice.py) when the device group has one, NCCL otherwise.

The tally counts collectives and their bytes as Python issues them: eager steps count themselves;
a CUDA graph's tally is taken while it is captured and added by the runner on every replay
(engine/runner.py), so step telemetry reports both alike.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphserve.distributed.state import get_parallel


@dataclass
class CommTally:
    count: int = 0
    bytes: int = 0

    def add(self, count: int, nbytes: int) -> None:
        self.count += count
        self.bytes += nbytes

    def snapshot(self) -> tuple[int, int]:
        return self.count, self.bytes


TALLY = CommTally()
# all_gather_into_tensor was renamed all_gather_single (PyTorch 2.13); 2.11 has only the old name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SKIP = False  # benchmarks only: run the same step without communicating, to time compute alone


@contextmanager
def skip_communication():
    """Collectives return their input unchanged inside this block (results are wrong across ranks).

    benchmarks/tp.py times a step with and without it: the difference is what communication costs the
    step, overlap and launch gaps included, which timing each collective alone would not show."""
    global _SKIP
    _SKIP, before = True, _SKIP
    try:
        yield
    finally:
        _SKIP = before


def all_reduce(x: torch.Tensor, over: str = "tp") -> torch.Tensor:
    """Sum ``x`` over the ranks (in place when NCCL runs it); returns the summed tensor.

    ``over="tp"``: the ranks that split attention and dense layers — none when ``--tp`` is 1, even if
    ``--ep`` runs several ranks (those layers are then replicated, and summing copies would multiply
    them). ``over="experts"``: every rank, which with ``--tp`` or ``--ep`` each hold part of a MoE
    layer's experts."""
    ps = get_parallel()
    if not ps.distributed or _SKIP or (over == "tp" and ps.tp_size == 1):
        return x
    TALLY.add(1, x.numel() * x.element_size())
    custom = ps.custom_all_reduce
    if custom is not None and custom.accepts(x):
        return custom.all_reduce(x)
    dist.all_reduce(x, group=ps.device_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` per rank -> ``[..., world * n]`` in rank order (vocab-parallel logits)."""
    ps = get_parallel()
    if not ps.distributed or _SKIP:
        return x if not _SKIP else torch.cat([x] * ps.world_size, dim=-1)
    TALLY.add(1, x.numel() * x.element_size() * ps.world_size)
    x = x.contiguous()
    # ranks' tensors concatenated along dim 0 (the layout both gloo and NCCL accept), then interleaved
    out = torch.empty((ps.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=ps.device_group)
    out = out.view(ps.world_size, *x.shape)
    return torch.movedim(out, 0, -2).reshape(*x.shape[:-1], ps.world_size * x.shape[-1])


def broadcast(x: torch.Tensor, cpu: bool = False) -> torch.Tensor:
    """``x`` from rank 0 to every rank, in place (step inputs; not a forward collective, so untallied)."""
    ps = get_parallel()
    if ps.distributed:
        dist.broadcast(x, src=0, group=ps.cpu_group if cpu else ps.device_group)
    return x


def agree(value: int, op: str = "min") -> int:
    """One integer every rank ends up with: the minimum (``op="min"``) or rank 0's (``op="first"``).

    Start-up decisions that each rank measures for itself (KV blocks that fit its free memory, the
    faster oversize mode) must come out the same on every rank, or their forwards would diverge."""
    ps = get_parallel()
    if not ps.distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if op == "min":
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ps.cpu_group)
    elif op == "first":
        dist.broadcast(t, src=0, group=ps.cpu_group)
    else:
        raise ValueError(f"agree(op={op!r}): choose 'min' or 'first'")
    return int(t.item())
