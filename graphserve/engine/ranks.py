"""Ranks as processes: the driver (rank 0, where the scheduler runs) starts one process per other rank,
watches them, and they watch it.

A rank is started with ``subprocess`` rather than ``multiprocessing``: the server's engine process is
itself a daemonic child, which multiprocessing forbids from having children. Its start-up arguments (the
rank, the EngineConfig, the rendezvous address) travel pickled through its stdin once; the pipe then
stays open, and its end-of-file is how a rank learns that the driver died: it exits at once, so no rank
outlives its driver (no orphans, whatever killed the driver).

The driver watches its ranks on a thread. A rank that exits unasked ends the engine: the other ranks
are killed (a collective would otherwise wait for the dead one forever), and then
- in a process that only runs the engine (the server's engine process), the process exits with
  ``RANK_FAILURE_EXIT``: the server fails the in-flight requests and /health turns 503, as for any
  engine death;
- in the user's own process (``LLM``, ``--engine-in-process``), the engine is marked dead and every
  later step raises ``RankFailure`` (the step in flight raises too: its peers are gone).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import socket
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from graphserve.config import EngineConfig

logger = logging.getLogger("graphserve.ranks")

RANK_FAILURE_EXIT = 75
# The server's engine process (engine/process_client.py names it so): a process that only runs the engine.
ENGINE_PROCESS_NAME = "graphserve-engine"
_STOP_TIMEOUT_S = 20.0


class RankFailure(RuntimeError):
    """A rank died: the engine cannot run another step."""


def free_tcp_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r runs on the r-th GPU after the driver's (CPU ranks share the host)."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


class RankPool:
    """A node leader's handle on its node's other ranks: 1..world-1 on one host; with --nnodes, ``ranks``
    (this node's after its leader, ``first + 1 ..``), meeting at ``init_method`` (--dist-init-addr)."""

    def __init__(self, config: EngineConfig, world_size: int, device: torch.device, ranks: range | None = None,
                 init_method: str | None = None) -> None:
        self.init_method = init_method or free_tcp_address()
        ranks = ranks if ranks is not None else range(1, world_size)
        self.ranks = list(ranks)
        self.failure: str | None = None
        # a process that only runs ranks exits on a failure; the user's own process (LLM) marks the engine dead
        self.exit_on_failure = multiprocessing.current_process().name == ENGINE_PROCESS_NAME
        self.node_watch: Any = None  # distributed/nodes.py NodeWatch with --nnodes > 1
        self.restore_threads = torch.get_num_threads()  # the driver's intra-op threads before the ranks shared the host
        self._stopping = False
        self._lock = threading.Lock()
        self._failed = threading.Event()  # set with ``failure``: what ``settle`` waits on
        self.procs: list[subprocess.Popen] = []
        level = logging.getLogger().getEffectiveLevel()
        for rank in ranks:
            proc = subprocess.Popen([sys.executable, "-m", "graphserve.engine.rank_main"], stdin=subprocess.PIPE)
            assert proc.stdin is not None
            local_device = rank_device(device, rank - ranks.start + 1)  # the node's GPUs, from its leader's
            proc.stdin.write(pickle.dumps((rank, config, self.init_method, str(local_device), level)))
            proc.stdin.flush()
            self.procs.append(proc)
            logger.info("tp/ep rank %d started: pid %d", rank, proc.pid)
        for rank, proc in zip(self.ranks, self.procs):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"graphserve-rank{rank}-watch",
                             daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self.fail(f"rank {rank} (pid {proc.pid}) exited with code {code}")

    def fail(self, reason: str) -> None:
        """A rank or a node is lost: stop this node's ranks, then exit or mark the engine dead (once)."""
        with self._lock:
            if self._stopping or self.failure is not None:
                return
            self.failure = reason
            self._failed.set()
        logger.error("%s: the engine cannot continue; stopping the other ranks", self.failure)
        self._kill_all()
        if self.exit_on_failure:
            os._exit(RANK_FAILURE_EXIT)  # the server's engine process: the server reports the death
        from graphserve.distributed.state import get_parallel

        group = get_parallel().device_group
        if get_parallel().backend == "nccl" and group is not None:
            try:  # unblock a collective waiting on the dead rank
                group._get_backend(torch.device("cuda")).abort()
            except Exception:  # noqa: BLE001 - best effort: the step raises on its own once peers are gone
                logger.exception("aborting the NCCL communicator failed")

    def settle(self, timeout: float) -> None:
        """After a failed step: a peer's death reaches the survivors' collective (a closed connection) before its
        watcher sees the exit code, so wait up to ``timeout`` s for the watcher; a lost rank then ends the engine
        (``fail``) or raises RankFailure, naming the rank, rather than leave the collective's error as the cause."""
        self._failed.wait(timeout)  # (Popen.poll cannot tell: the watcher thread holds the wait)
        self.check()

    def check(self) -> None:
        if self.failure is not None:
            raise RankFailure(f"a tensor-parallel rank died ({self.failure}); restart the engine")

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def expect_exit(self) -> None:
        """The shutdown header is out: the ranks' exits from here on are no failure."""
        with self._lock:
            self._stopping = True

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """After the shutdown header was sent: wait for the ranks to leave, kill those that do not."""
        self.expect_exit()
        for proc in self.procs:
            if timeout <= 0:
                proc.kill()
            try:
                proc.wait(timeout if timeout > 0 else 10.0)
            except subprocess.TimeoutExpired:
                logger.warning("rank pid %d did not stop within %.0f s: killing it", proc.pid, timeout)
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()


def cpu_threads_per_rank(world: int) -> None:
    """CPU ranks share the host's cores: without a split each would start one thread per core, and the
    ranks' collectives would wait on threads the OS has descheduled."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
