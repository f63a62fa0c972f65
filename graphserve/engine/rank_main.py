"""The process of a rank other than the driver (``python -m graphserve.engine.rank_main``, started by
ranks.py's RankPool): read the start-up arguments from stdin, exit when the driver goes, run RankWorker.
Nothing imports this module: it is only ever ``__main__``."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading

import torch

from graphserve.engine.rank_worker import RankWorker


def _exit_when_driver_dies() -> None:
    sys.stdin.buffer.read()  # returns at end-of-file: the driver closed the pipe or died
    os._exit(0)


def worker_main() -> None:
    """A rank other than the driver: join the group, load its shard, then run the driver's steps."""
    # Ctrl-C reaches the whole process group: the driver decides what happens, then stops its ranks
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank, config, init_method, device_name, level = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_exit_when_driver_dies, name="graphserve-driver-watch", daemon=True).start()
    logging.basicConfig(level=level, format=f"[%(asctime)s rank{rank}] %(message)s", force=True)
    code = 0
    try:
        RankWorker(rank, config, init_method, torch.device(device_name)).serve()
    except BaseException:  # noqa: BLE001 - logged; the driver sees the exit code and fails the engine
        logging.getLogger("graphserve.ranks").exception("rank %d failed", rank)
        code = 1
    logging.shutdown()
    # skip interpreter teardown: it would wait on the thread reading stdin, CUDA or gloo threads
    os._exit(code)


if __name__ == "__main__":
    worker_main()
