"""Shared fixtures: keep built-in checkpoints in a per-session temporary cache unless one is configured."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Test modules import the helpers in tests/support/ and each other by bare module name (`from model_utils import
# ...`, `from test_deepseek import _TINY`), across folders and from tests/gpu/: every folder is on the path, helpers
# first, so a module moves between folders without an import changing. Module names stay unique across tests/.
TESTS = Path(__file__).resolve().parent
for _folder in reversed(("support", "unit", "kernels", "models", "server", "lab")):
    if str(TESTS / _folder) not in sys.path:
        sys.path.insert(0, str(TESTS / _folder))

# Kernel tests on a machine without a GPU run Triton's interpreter; it must be chosen before
# anything (transformers, through torch._dynamo) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests write result files into temporary folders from a checkout that may hold work in progress; a real run refuses
# to stamp such a tree (graphserve.tuning.timing.git_commit), tests/lab/test_result_stamp.py checks that on its own repo.
os.environ.setdefault("GRAPHSERVE_ALLOW_DIRTY", "1")

# Under pytest-xdist (`make test` runs -n 2) each worker gets its share of the cores: two workers whose intra-op
# threads each spread over every core wait on each other (on 2 cores, test_server_api.py with test_deepseek.py took
# 36-39 s uncapped against 29 s capped). OMP_NUM_THREADS carries the share into the servers and engine processes the tests
# start, since their torch reads it at import.
if "PYTEST_XDIST_WORKER" in os.environ:
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_share)
    os.environ["OMP_NUM_THREADS"] = str(_share)


@pytest.fixture(scope="session", autouse=True)
def graphserve_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    if "GRAPHSERVE_CACHE" not in os.environ:
        os.environ["GRAPHSERVE_CACHE"] = str(tmp_path_factory.mktemp("graphserve_cache"))
    # tuned tables: a test that tunes without naming a folder must not write into (or read) the user's cache
    if "GRAPHSERVE_CACHE_DIR" not in os.environ:
        os.environ["GRAPHSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("graphserve_tables"))
    return os.environ["GRAPHSERVE_CACHE"]


def _runs_the_interpreter(module: object) -> bool:
    return any(getattr(v, "__module__", None) == "interp_setup" or getattr(v, "__name__", None) == "interp_setup"
               for v in vars(module).values())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Triton's interpreter runs a kernel one program at a time in Python: these modules hold most of the CPU suite's
    # time, and `make test-fast` (-m "not slow") leaves them out. A module is one by what it imports (interp_setup),
    # so a new kernel test is marked without anyone remembering to.
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and _runs_the_interpreter(module):
            item.add_marker(pytest.mark.slow)
