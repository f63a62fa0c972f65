"""A CPU model too large for this machine is refused before a byte of its weights is allocated, naming both
numbers: by LLM(...) (and so `profile --model`, through EngineCore) and by `serve` before it spawns the engine.
dummy:mixtral-8x7b is 174 GiB of float32 weights on CPU, more than any CI machine has free."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from graphserve.errors import ConfigError
from graphserve.llm import LLM
from graphserve.models.host_memory import GIB, available_bytes, weight_bytes

TOO_BIG = "dummy:mixtral-8x7b"


def test_llm_refuses_a_model_larger_than_memory_within_a_second():
    from graphserve.config import EngineConfig
    from graphserve.models.loader import meta_model

    meta_model(EngineConfig(model="builtin:tiny-llama"))  # imports done: the timing below is the check alone
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        LLM(TOO_BIG, device="cpu")
    assert time.perf_counter() - start < 1.0
    need, have = (float(x) for x in re.findall(r"([\d.]+) GiB", info.value.message))
    assert need == pytest.approx(weight_bytes(EngineConfig(model=TOO_BIG))[0] / GIB, abs=0.05)
    assert need > 150 and 0 < have <= available_bytes() / GIB * 1.2 + 0.1
    assert "float32" in info.value.message and info.value.param == "model"


def test_a_model_that_fits_is_let_through():
    from graphserve.config import EngineConfig
    from graphserve.models.host_memory import check_host_memory

    need, _ = weight_bytes(EngineConfig(model="builtin:tiny-llama"))
    assert 0 < need < 64 * 2**20
    import torch

    check_host_memory(EngineConfig(model="builtin:tiny-llama"), torch.device("cpu"))


def test_serve_refuses_before_spawning_the_engine(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "graphserve.cli", "serve", TOO_BIG, "--device", "cpu", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert re.search(r"needs [\d.]+ GiB for its weights on CPU \(float32\), more than the [\d.]+ GiB", proc.stderr)
    assert "spawn" not in proc.stderr and "warm-up" not in proc.stderr
    assert time.monotonic() - start < 60
