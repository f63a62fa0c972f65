"""Ranks across machines: where each node's ranks sit, the rendezvous at ``--dist-init-addr``, the check that
every node was started with the same flags, and the watch that ends every node when one is lost.

``world = max(tp, ep)`` ranks are split evenly: node R runs global ranks ``R*per_node .. (R+1)*per_node-1``,
one per local GPU (or CPU process). Each node's first rank is its *leader*, the process the user started:
node 0's is the engine's driver (rank 0, scheduler and HTTP server), the others' run engine/node.py.

The leaders meet in a TCPStore that node 0's driver serves at ``--dist-init-addr``. Before any process
group exists each leader writes the flags that must agree and compares them with every other node's: a
mismatch there would otherwise surface as a hang in ``init_process_group`` (different world sizes) or as
silently wrong tokens (different models, dtypes, block sizes).

Then each leader other than node 0's holds a TCP connection to node 0's watcher: a process that dies has
its sockets closed by the kernel, so either end learns of the other's death at once, even while no
collective runs (an idle server). A heartbeat counter per node in the store covers a node that hangs
alive: silent for ``NODE_LOST_S``, it is lost. Either way the watcher's callback ends the process, as a
dead local rank does (engine/ranks.py).
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from graphserve.errors import ConfigError

if TYPE_CHECKING:
    from graphserve.config import EngineConfig

logger = logging.getLogger("graphserve.nodes")

# The flags whose values must be the same on every node: the model and its split set the world and each
# rank's shard; dtype and block size the tensors every collective and step header carry.
SHARED_FLAGS = ("model", "tp", "ep", "dp", "nnodes", "block_size", "dtype", "quantization", "kv_cache_dtype")
HEARTBEAT_S = 0.5
# A node's heartbeat silent this long is lost. Above the longest GIL hold of a loaded host (a step's Python
# work, a model load's tensor copies), far under the 10 s within which the other nodes must end.
NODE_LOST_S = 4.0
_KEY = "graphserve/"


@dataclass(frozen=True)
class NodeLayout:
    nnodes: int
    node_rank: int
    world: int

    @property
    def per_node(self) -> int:
        return self.world // self.nnodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.per_node

    @property
    def local_ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.per_node)


def node_layout(config: EngineConfig) -> NodeLayout:
    return NodeLayout(config.nnodes, config.node_rank, max(config.tp, config.ep))


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def connect_store(config: EngineConfig, world: int, master: bool) -> Any:
    """Node 0's driver serves the store at ``--dist-init-addr``; every other leader connects to it, trying for
    ``--dist-timeout`` seconds before refusing to start."""
    import torch.distributed as dist

    host, port = split_addr(str(config.dist_init_addr))
    try:
        return dist.TCPStore(host, port, world_size=world, is_master=master, wait_for_workers=False,
                             timeout=timedelta(seconds=config.dist_timeout), multi_tenant=master)
    except Exception as e:  # noqa: BLE001 - DistNetworkError, DistStoreError, RuntimeError: one refusal
        verb = "could not listen on" if master else "could not reach"
        raise ConfigError(f"node {config.node_rank} {verb} --dist-init-addr={config.dist_init_addr} within "
                          f"--dist-timeout={config.dist_timeout:g} s ({type(e).__name__}: {str(e).splitlines()[0]})",
                          param="dist_init_addr") from e


def shared_flags(config: EngineConfig) -> dict[str, Any]:
    return {name: getattr(config, name, None) for name in SHARED_FLAGS}


def flag_mismatches(mine: dict[str, Any], my_node: int, theirs: dict[str, Any], their_node: int) -> list[str]:
    """One phrase per flag that differs, naming the flag and both nodes' values."""
    out = []
    for name in SHARED_FLAGS:
        a, b = mine.get(name), theirs.get(name)
        if a != b:
            out.append(f"--{name.replace('_', '-')}={a} on node {my_node} but --{name.replace('_', '-')}={b} "
                       f"on node {their_node}")
    return out


def exchange_flags(store: Any, config: EngineConfig) -> None:
    """Every leader publishes its flags and compares them with every other node's; each node refuses the same
    mismatch, so none is left waiting for a process group that will never form."""
    me = config.node_rank
    if store.add(f"{_KEY}joined/{me}", 1) > 1:
        raise ConfigError(f"--node-rank={me} is taken: another node joined --dist-init-addr="
                          f"{config.dist_init_addr} with the same --node-rank", param="node_rank")
    mine = shared_flags(config)
    store.set(f"{_KEY}flags/{me}", json.dumps(mine))
    others = [n for n in range(config.nnodes) if n != me]
    try:
        store.wait([f"{_KEY}flags/{n}" for n in others], timedelta(seconds=config.dist_timeout))
    except Exception as e:  # noqa: BLE001 - the store's timeout error: the missing nodes named below
        missing = [n for n in others if not store.check([f"{_KEY}flags/{n}"])]
        raise ConfigError(f"node(s) {missing} did not join --dist-init-addr={config.dist_init_addr} within "
                          f"--dist-timeout={config.dist_timeout:g} s (--nnodes={config.nnodes})",
                          param="dist_timeout") from e
    problems = []
    for n in others:
        problems += flag_mismatches(mine, me, json.loads(store.get(f"{_KEY}flags/{n}")), n)
    store.add(f"{_KEY}checked", 1)
    if me == 0:  # node 0 serves the store: it stays until every node has read the flags, to refuse them itself
        deadline = time.monotonic() + min(5.0, config.dist_timeout)
        while store.add(f"{_KEY}checked", 0) < config.nnodes and time.monotonic() < deadline:
            time.sleep(0.02)
    if problems:
        first = problems[0].split("=", 1)[0].lstrip("-").replace("-", "_")
        raise ConfigError("the nodes were started with different flags: " + "; ".join(problems), param=first)
    logger.info("node %d of %d: flags agree with every node at %s", me, config.nnodes, config.dist_init_addr)


class NodeWatch:
    """A thread that beats this node's heartbeat and, on node 0, watches every other node's.

    ``on_lost(reason)`` runs once, on the watch thread, when a node is lost (or the store is gone: node 0
    died); ``stop()`` before a clean shutdown keeps a departure from reading as a loss."""

    def __init__(self, config: EngineConfig, on_lost: Callable[[str], None]) -> None:
        self.node = config.node_rank
        self.nnodes = config.nnodes
        self.addr = str(config.dist_init_addr)
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._lost_once = threading.Lock()
        # a client of its own: the process group's store is not shared with a second thread; and this one is
        # used by the heartbeat thread and the shutdown path, one call at a time (a TCPStore client is not
        # thread-safe: two calls at once can leave both waiting forever)
        self._store = connect_store(config, max(config.tp, config.ep), master=False)
        self._store_lock = threading.Lock()
        if self.node == 0:
            self._listener = socket.create_server(("", 0))
            self._store.set(f"{_KEY}watch_port", str(self._listener.getsockname()[1]))
            target = self._watch_connections
        else:
            port = int(self._store.get(f"{_KEY}watch_port"))
            self._conn = socket.create_connection((split_addr(self.addr)[0], port), timeout=config.dist_timeout)
            self._conn.sendall(bytes([self.node % 256]))
            target = self._watch_node0
        threading.Thread(target=self._run, name="graphserve-node-heartbeat", daemon=True).start()
        threading.Thread(target=target, name="graphserve-node-watch", daemon=True).start()

    def _watch_connections(self) -> None:
        """Node 0: accept every other leader's connection, then wait for one to close."""
        conns: dict[socket.socket, int] = {}
        self._listener.settimeout(1.0)
        while len(conns) < self.nnodes - 1 and not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            first = conn.recv(1)  # the node's rank, for the log line
            conns[conn] = first[0] if first else -1
        while conns and not self._stop.is_set():
            ready, _, _ = select.select(list(conns), [], [], 0.5)
            for conn in ready:
                try:
                    data = conn.recv(64)
                except OSError:
                    data = b""
                if not data and not self._stop.is_set():
                    self._lost(f"node {conns[conn]}'s connection closed (its process ended)")
                    return

    def _watch_node0(self) -> None:
        try:
            data = self._conn.recv(64)  # node 0 never writes: this returns when it goes away
        except OSError:
            data = b""
        if not data and not self._stop.is_set():
            self._lost("node 0's connection closed (its process ended)")

    def _run(self) -> None:
        seen: dict[int, tuple[int, float]] = {}
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._add(f"{_KEY}heartbeat/{self.node}", 1)
                if self.node != 0:
                    continue
                now = time.monotonic()
                for n in range(1, self.nnodes):
                    beat = self._add(f"{_KEY}heartbeat/{n}", 0)
                    last = seen.get(n)
                    if last is None or beat != last[0]:
                        seen[n] = (beat, now)
                    elif now - last[1] > NODE_LOST_S and not self._stop.is_set():
                        self._lost(f"node {n} stopped answering for {now - last[1]:.1f} s (heartbeat at {self.addr})")
                        return
            except Exception as e:  # noqa: BLE001 - node 0 serves the store: if it stops answering, node 0 is gone
                if not self._stop.wait(1.0):  # a clean shutdown stops the watch before node 0 leaves
                    self._lost(f"node 0's store at {self.addr} stopped answering ({type(e).__name__})")
                return

    def _add(self, key: str, value: int) -> int:
        with self._store_lock:
            return self._store.add(key, value)

    def _lost(self, reason: str) -> None:
        if not self._lost_once.acquire(blocking=False):
            return
        logger.error("node %d: %s: ending this node", self.node, reason)
        self.on_lost(reason)

    def mark_left(self) -> None:
        """A node whose ranks left cleanly says so, so node 0 can wait for it before closing the store."""
        self.stop()
        try:
            self._add(f"{_KEY}left", 1)
        except Exception:  # noqa: BLE001 - node 0 already gone: nothing is waiting for this
            pass

    def wait_for_others(self, timeout: float = 10.0) -> None:
        """Node 0, after its shutdown header: the store must outlive the other nodes' clean exit."""
        self.stop()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self._add(f"{_KEY}left", 0) >= self.nnodes - 1:
                    return
            except Exception:  # noqa: BLE001
                return
            time.sleep(0.05)
        logger.warning("node 0: not every node reported leaving within %.0f s", timeout)

    def stop(self) -> None:
        self._stop.set()
