"""GPU tests: collected only through ``pytest tests/gpu`` on a CUDA machine (CI runs without a GPU).

Without CUDA every test here is skipped with one stated reason; on a GPU every test is marked
``gpu``. Kernels must be compiled here, so a run with Triton's interpreter switched on is refused.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
NO_CUDA = "needs a CUDA GPU: torch.cuda.is_available() is False on this machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(autouse=True)
def _compiled_kernels() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.fail("tests/gpu must run compiled: unset TRITON_INTERPRET and run `pytest tests/gpu` on its own")


@pytest.fixture
def release_engines():
    """Engines and models take most of the GPU: make sure a test's are gone before the next one plans."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def gen() -> torch.Generator:
    """A fresh seeded CUDA generator per test, so every test draws new but repeatable inputs."""
    return torch.Generator(device="cuda").manual_seed(1234)
