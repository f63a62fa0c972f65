"""Which rank this process is, and the process groups it talks through.

A process learns its place once, when its ranks start (``init_parallel``), and model families read
it when they build their layers (``get_parallel``): rank and world are facts about the process, not
about a forward pass, so they are not threaded through every constructor. At tp 1 / ep 1 nothing is
initialised, and every collective in ``comm.py`` returns its input untouched.

Ranks and sizes:
- ``world = max(tp, ep)`` processes, one per device; when both are above 1 they must be equal (the
  expert-parallel ranks are the tensor-parallel ranks, as in SGLang's ``--ep-size``).
- attention, dense MLPs, the embedding and the lm_head are split over ``tp`` ranks (replicated when
  ``tp`` is 1, e.g. ``--ep 2`` alone);
- routed experts are split along their intermediate size over ``tp`` ranks, or placed whole over
  ``ep`` ranks; with ``--ep`` the MoE layer is not tensor-parallel.

Two groups over the same ranks: ``device_group`` (NCCL on CUDA, gloo on CPU) carries activations and
runs inside CUDA graphs; ``cpu_group`` (always gloo) carries each step's small header and the few
start-up agreements (KV pool size, oversize mode) without touching the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Workers wait for the next step's header for as long as the server is idle: the control group never
# times out on its own; a dead peer is found by the process watchers (engine/ranks.py) instead.
IDLE_TIMEOUT = timedelta(days=365)
# Collectives on the device group are short; a peer that stops answering for this long is dead.
DEVICE_TIMEOUT = timedelta(minutes=5)

# NVLink multicast (NVLS) stays off: the multi-GPU machines we measure on require it, and one-shot
# peer reads do not need it.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    ep_size: int = 1
    device_group: Any = None
    cpu_group: Any = None
    backend: str = "none"  # "nccl", "gloo" or "none" (one rank)
    custom_all_reduce: Any = None  # distributed/custom_all_reduce.py, CUDA with peer access only

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


_STATE = ParallelState()


def get_parallel() -> ParallelState:
    return _STATE


def world_size_of(tp: int, ep: int) -> int:
    """Processes that ``--tp``/``--ep`` start (validated by EngineConfig: equal when both are above 1)."""
    return max(tp, ep)


def split_evenly(total: int, parts: int, what: str) -> int:
    """``total / parts`` when it divides, else a ValueError naming the field and the values that work."""
    if parts < 1 or total % parts:
        ok = [p for p in range(1, min(total, 64) + 1) if total % p == 0]
        raise ValueError(f"{what}={total} does not split over {parts} ranks: use one of {ok}")
    return total // parts


def init_parallel(rank: int, tp: int, ep: int, init_method: str, device: torch.device, store: Any = None
                  ) -> ParallelState:
    """Join the process group of ``max(tp, ep)`` ranks; NCCL for the device group on CUDA, else gloo.

    ``store``: the rendezvous a node leader already holds (distributed/nodes.py, --nnodes), used instead of
    ``init_method``."""
    global _STATE
    world = world_size_of(tp, ep)
    if world == 1:
        _STATE = ParallelState(tp_size=tp, ep_size=ep)
        return _STATE
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        if device.index is None:  # NCCL binds one device per rank: name it
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    kwargs.update({"store": store} if store is not None else {"init_method": init_method})
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=DEVICE_TIMEOUT if backend == "nccl" else IDLE_TIMEOUT, **kwargs)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(list(range(world)), backend="gloo", timeout=IDLE_TIMEOUT) if backend == "nccl" \
        else device_group
    _STATE = ParallelState(rank, world, tp, ep, device_group, cpu_group, backend)
    return _STATE


def set_custom_all_reduce(impl: Any) -> None:
    _STATE.custom_all_reduce = impl


def destroy_parallel() -> None:
    """Leave the process group. CUDA graphs that captured collectives must be released first, or
    NCCL's teardown waits on them forever."""
    global _STATE
    if _STATE.custom_all_reduce is not None:
        _STATE.custom_all_reduce.close()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer that already died makes teardown raise; we are leaving anyway
            pass
    _STATE = ParallelState()
