"""Shared fixtures: keep built-in checkpoints in a per-session temporary cache unless one is configured."""

from __future__ import annotations

import os

import pytest
import torch

# Kernel tests on a machine without a GPU run Triton's interpreter; it must be chosen before
# anything (transformers, through torch._dynamo) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests write result files into temporary folders from a checkout that may hold work in progress; a real run refuses
# to stamp such a tree (graphserve.tuning.timing.git_commit), tests/test_result_stamp.py checks that on its own repo.
os.environ.setdefault("GRAPHSERVE_ALLOW_DIRTY", "1")


@pytest.fixture(scope="session", autouse=True)
def graphserve_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    if "GRAPHSERVE_CACHE" not in os.environ:
        os.environ["GRAPHSERVE_CACHE"] = str(tmp_path_factory.mktemp("graphserve_cache"))
    return os.environ["GRAPHSERVE_CACHE"]
