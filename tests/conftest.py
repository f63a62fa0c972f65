"""Shared fixtures: keep built-in checkpoints in a per-session temporary cache unless one is configured."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def graphserve_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    if "GRAPHSERVE_CACHE" not in os.environ:
        os.environ["GRAPHSERVE_CACHE"] = str(tmp_path_factory.mktemp("graphserve_cache"))
    return os.environ["GRAPHSERVE_CACHE"]
