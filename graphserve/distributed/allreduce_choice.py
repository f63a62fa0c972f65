"""Which all-reduce runs each message size, measured at start-up on the ranks' own links.

The one-shot kernel's switch point to NCCL was measured over NVLink; over PCIe peer-to-peer (the stories'
8-GPU boxes) or with no peer access at all, the fastest path per size differs, and vLLM turns its own
one-shot off on PCIe at 4 and 8 ranks. So every start with ``--tp``/``--ep`` > 1 on CUDA:
- finds the topology: peer access between the node's GPUs (``torch.cuda.can_device_access_peer``) and, when
  ``nvidia-smi`` is present, the link of each pair from ``nvidia-smi topo -m`` (NV# is NVLink; PIX, PXB,
  PHB, NODE and SYS are PCIe paths);
- times NCCL, the one-shot and the two-shot peer all-reduce (custom_all_reduce.py) on every size in
  ``SIZES``, each the slowest rank's mean (every rank must pick the same path, or their kernels would wait
  on different peers), and keeps the fastest per size; a message above the largest size goes to NCCL;
- logs the topology and the table as one block of ``all-reduce`` lines (graphserve doctor reads them).

``GRAPHSERVE_ALLREDUCE=nccl|oneshot|twoshot`` forces one path for every size it can take (A/B runs). Peer
memory needs one host: across nodes (``--nnodes`` > 1) NCCL runs every all-reduce. On CPU the table
measures gloo alone and says so.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from graphserve import env
from graphserve.errors import ConfigError

if TYPE_CHECKING:
    from graphserve.config import EngineConfig
    from graphserve.distributed.state import ParallelState

logger = logging.getLogger("graphserve.distributed")

ENV = "GRAPHSERVE_ALLREDUCE"
PATHS = ("nccl", "oneshot", "twoshot")
# decode's [batch, hidden] messages (a few KB at batch 1) up to large prefill chunks
SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20)
_ITERS = {"cuda": 20, "cpu": 2}
_TOPO_ROW = re.compile(r"^GPU(\d+)\s+(.*)$")
_PCIE_LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS")


def forced_path() -> str | None:
    """The path ``GRAPHSERVE_ALLREDUCE`` forces, None when unset; an unknown value is refused by name."""
    value = (env.get(ENV) or "").strip().lower()
    if not value:
        return None
    if value not in PATHS:
        raise ConfigError(f"{ENV}={value!r} is invalid: choose one of {', '.join(PATHS)} (or leave it unset to "
                          "measure)", param=ENV)
    return value


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


@dataclass
class Topology:
    kind: str  # "nvlink", "pcie-p2p", "pcie-no-p2p", "unknown", "cpu", "across nodes"
    detail: str

    def line(self) -> str:
        return f"all-reduce topology: {self.kind} ({self.detail})"


def parse_topo_matrix(text: str) -> dict[tuple[int, int], str]:
    """``nvidia-smi topo -m``'s GPU-to-GPU links: {(i, j): "NV18" | "PIX" | ...} for i != j."""
    links: dict[tuple[int, int], str] = {}
    header: list[str] = []
    for raw in text.splitlines():
        line = raw.replace("\x1b[4m", "").replace("\x1b[0m", "").strip()
        if not header and line.startswith("GPU0"):
            header = line.split()
            continue
        m = _TOPO_ROW.match(line)
        if not header or not m:
            continue
        i, cells = int(m.group(1)), m.group(2).split()
        for col, cell in zip(header, cells):
            if col.startswith("GPU") and col[3:].isdigit() and int(col[3:]) != i:
                links[(i, int(col[3:]))] = cell
    return links


def classify(links: list[str], peer_access: bool | None, p2p_disabled: bool) -> str:
    if links and all(link.startswith("NV") for link in links):
        kind = "nvlink"
    elif links and all(link in _PCIE_LINKS for link in links):
        kind = "pcie-p2p" if peer_access else "pcie-no-p2p"
    elif peer_access is None:
        kind = "unknown"
    else:
        kind = "peer-access" if peer_access else "no-peer-access"
    # NCCL's own transport then goes through host memory whatever the wires are
    return f"{kind}, NCCL P2P off" if p2p_disabled else kind


def detect_topology(gpus: list[int]) -> Topology:
    pairs = [(a, b) for a in gpus for b in gpus if a != b]
    peer = all(torch.cuda.can_device_access_peer(a, b) for a, b in pairs) if pairs else None
    links: list[str] = []
    source = "nvidia-smi absent"
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10).stdout
            matrix = parse_topo_matrix(out)
            links = [matrix[p] for p in pairs if p in matrix]
            source = "nvidia-smi topo -m: " + (" ".join(f"GPU{a}-GPU{b} {matrix[(a, b)]}" for a, b in pairs
                                                         if a < b and (a, b) in matrix) or "no GPU rows")
        except (OSError, subprocess.SubprocessError) as e:
            source = f"nvidia-smi topo -m failed: {type(e).__name__}"
    p2p_off = os.environ.get("NCCL_P2P_DISABLE", "0") not in ("", "0")
    detail = f"GPUs {gpus}, peer access {'yes' if peer else 'no' if peer is not None else 'n/a'}; {source}"
    if p2p_off:
        detail += "; NCCL_P2P_DISABLE=1"
    return Topology(classify(links, peer, p2p_off), detail)


@dataclass
class PathTable:
    """Mean µs per call of each path at each size (None: the path cannot run it), and the choice per size."""
    sizes: list[int]
    times_us: dict[str, list[float | None]]
    chosen: list[str] = field(default_factory=list)
    note: str = ""

    def choose(self, forced: str | None = None) -> None:
        self.chosen = []
        for i, _ in enumerate(self.sizes):
            avail = {p: t[i] for p, t in self.times_us.items() if t[i] is not None}
            if forced is not None and forced in avail:
                self.chosen.append(forced)
            else:
                self.chosen.append(min(avail, key=lambda p: avail[p]))

    def path_for(self, nbytes: int) -> str:
        for size, path in zip(self.sizes, self.chosen):
            if nbytes <= size:
                return path
        return "nccl"  # above the largest measured size: bandwidth-bound, NCCL's ring or tree

    def lines(self, topology: Topology, header: str) -> list[str]:
        out = [topology.line(), f"all-reduce paths ({header}; mean us per call, slowest rank){self.note}"]
        for i, size in enumerate(self.sizes):
            cells = ", ".join(f"{p} {t[i]:.1f} us" for p, t in self.times_us.items() if t[i] is not None)
            out.append(f"all-reduce {size_label(size):>7}: {cells} -> {self.chosen[i]}")
        return out


class AllReduceRouter:
    """``ParallelState.custom_all_reduce``: the peer-memory path the table chose for a message's size
    (comm.py sends every other message to NCCL)."""

    def __init__(self, impl: Any, table: PathTable, world: int) -> None:
        self.impl, self.table = impl, table
        # the two-shot splits a message into one 16-byte-aligned slice per rank; a message that does not split
        # so (odd decode batches of odd widths) takes the one-shot, which reads whole buffers, when it passed
        # its start-up check, else NCCL
        self._two_shot_align = 16 * world
        self._has_oneshot = "oneshot" in table.times_us

    def accepts(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        path = self.table.path_for(nbytes)
        if path == "twoshot" and nbytes % self._two_shot_align and not self._has_oneshot:
            return False
        return self.impl.accepts(x) and path != "nccl"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        if self.table.path_for(nbytes) == "twoshot" and nbytes % self._two_shot_align == 0:
            return self.impl.two_shot(x)
        return self.impl.all_reduce(x)

    def close(self) -> None:
        self.impl.close()


def _time_us(fn: Any, x: torch.Tensor, group: Any, iters: int) -> float:
    """Mean µs per call on this rank, then the slowest rank's (a MAX over the group)."""
    fn(x.clone())  # warm-up: the first NCCL call of a size sets up its channels
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    dist.barrier(group=group)  # every rank starts its clock together: a late peer would count as slow
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    for _ in range(iters):
        fn(x)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    us = torch.tensor([(time.perf_counter() - start) / iters * 1e6], dtype=torch.float64, device=x.device)
    dist.all_reduce(us, op=dist.ReduceOp.MAX, group=group)
    return float(us.item())


def measure(group: Any, device: torch.device, dtype: torch.dtype, paths: dict[str, Any],
            sizes: tuple[int, ...] = SIZES, accepts: Any = None) -> PathTable:
    """Every rank calls this with the same ``paths`` (name -> fn(x) -> summed x), in the same order;
    ``accepts(x)`` says whether the peer-memory paths take a message (NCCL and gloo take any)."""
    gen = torch.Generator(device=device).manual_seed(7 + dist.get_rank(group))
    times: dict[str, list[float | None]] = {p: [] for p in paths}
    iters = _ITERS["cuda" if device.type == "cuda" else "cpu"]
    for size in sizes:
        x = torch.randn(size // dtype.itemsize, generator=gen, device=device).to(dtype)
        for name, fn in paths.items():
            ok = name in ("nccl", "gloo") or accepts is None or accepts(x)
            times[name].append(_time_us(fn, x, group, iters) if ok else None)
    return PathTable(list(sizes), times)


def _agrees(impl: Any, group: Any, device: torch.device) -> bool:
    """The two-shot result against NCCL's on random data, eager and replayed from a CUDA graph (decode runs it
    inside graphs), on every rank together: each step is agreed before the next, since a rank that replays a
    peer kernel its peers do not would wait for them forever."""
    from graphserve.distributed.custom_all_reduce import _all_ranks

    gen = torch.Generator(device=device).manual_seed(99 + dist.get_rank(group))
    x = torch.randn(64, 1024, generator=gen, device=device).to(impl.dtype)
    expected = x.float()
    dist.all_reduce(expected, group=group)
    tol = 1e-5 if impl.dtype == torch.float32 else 2e-2

    def close(got: torch.Tensor) -> bool:
        return torch.allclose(got.float(), expected, rtol=tol, atol=tol * 4)

    try:
        ok = close(impl.two_shot(x.clone()))
    except Exception:  # noqa: BLE001 - an op this PyTorch lacks or refuses: the two-shot is left out
        logger.exception("the two-shot all-reduce raised at its start-up check")
        ok = False
    if not _all_ranks(ok, group, device):
        return False
    graph, out = torch.cuda.CUDAGraph(), None
    try:  # capture only records: nothing waits on a peer until the replay below
        with torch.cuda.graph(graph):
            out = impl.two_shot(x)
    except Exception:  # noqa: BLE001 - not capturable here: the two-shot would break decode's graphs
        logger.exception("the two-shot all-reduce could not be captured in a CUDA graph")
    if not _all_ranks(out is not None, group, device):
        return False
    graph.replay()
    torch.cuda.synchronize(device)
    assert out is not None
    return _all_ranks(close(out), group, device)


def choose_all_reduce(parallel: ParallelState, config: EngineConfig, device: torch.device, dtype: torch.dtype
                      ) -> PathTable | None:
    """Measure, choose and install the all-reduce path per size; every rank calls it at the same point.
    ``dtype``: the model's activations' (models/parallel_check.model_dtype), which the messages carry."""
    if not parallel.distributed:  # --ep alone all-reduces the experts' outputs over every rank too
        return None
    forced = forced_path()
    group = parallel.device_group
    if device.type != "cuda":
        table = measure(group, device, torch.float32, {"gloo": lambda x: dist.all_reduce(x, group=group)})
        table.choose()
        table.note = ": gloo only (no peer memory on CPU)"
        _log(table, Topology("cpu", f"{parallel.world_size} ranks over gloo/TCP, --nnodes={config.nnodes}"),
             f"tp={config.tp} ep={config.ep}, float32, eager")
        return table
    from graphserve.distributed.custom_all_reduce import SymmMemAllReduce, _agrees_with_nccl, _all_ranks
    from graphserve.distributed.state import set_custom_all_reduce

    per_node = parallel.world_size // config.nnodes
    first = (device.index or 0) - parallel.rank % per_node  # this node's GPUs, from its leader's
    local = list(range(first, first + per_node))
    topology = detect_topology(local) if config.nnodes == 1 else \
        Topology("across nodes", f"--nnodes={config.nnodes}: peer memory needs one host, NCCL runs every all-reduce")
    paths: dict[str, Any] = {"nccl": lambda x: dist.all_reduce(x, group=group)}
    impl, reason = None, ""
    if config.nnodes > 1:
        reason = "across nodes"
    elif config.disable_custom_all_reduce:
        reason = "--disable-custom-all-reduce"
    else:
        try:  # local steps only: every rank learns whether all could, before the collective rendezvous
            impl = SymmMemAllReduce(group, device, dtype, max_bytes=max(SIZES))
        except Exception as e:  # noqa: BLE001 - no symmetric memory here (no peer access, older PyTorch)
            reason = f"{type(e).__name__}: {e}"
        if _all_ranks(impl is not None, group, device):
            assert impl is not None
            impl.rendezvous()
            if _agrees_with_nccl(impl, group, device):
                paths["oneshot"] = impl.all_reduce
            if impl.has_two_shot and _agrees(impl, group, device):
                paths["twoshot"] = impl.two_shot
        else:
            impl, reason = None, reason or "another rank could not map peer memory"
    table = measure(group, device, dtype, paths, accepts=impl.accepts if impl is not None else None)
    table.choose(forced)
    if forced and forced not in paths:
        table.note = f": {ENV}={forced} unavailable here ({reason or 'its start-up check failed'}), measured choice kept"
    elif forced:
        table.note = f": forced by {ENV}={forced}"
    elif reason:
        table.note = f": peer-memory paths off ({reason})"
    if impl is not None and any(p != "nccl" for p in table.chosen):
        set_custom_all_reduce(AllReduceRouter(impl, table, parallel.world_size))
    elif impl is not None:
        impl.close()
    _log(table, topology, f"tp={config.tp} ep={config.ep}, {str(dtype).removeprefix('torch.')}, eager")
    return table


def _log(table: PathTable, topology: Topology, header: str) -> None:
    from graphserve.distributed.state import get_parallel

    if get_parallel().rank == 0:  # one block per engine: every rank measured the same slowest-rank table
        for line in table.lines(topology, header):
            logger.info("%s", line)
