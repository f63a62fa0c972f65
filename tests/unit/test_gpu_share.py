"""graphserve/engine/gpu_share.py: an engine's share of a GPU it does not have to itself. No GPU here: the CUDA
calls are replaced by a fake card of 80 GiB, so what is checked is the arithmetic and the refusals."""

from __future__ import annotations

import pytest
import torch

from graphserve.engine import gpu_share
from graphserve.errors import ConfigError

GIB = 1 << 30


@pytest.fixture
def card(monkeypatch):
    state = {"free": 70 * GIB, "total": 80 * GIB, "reserved": 6 * GIB, "fraction": None}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], state["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda frac, device=None: state.update(fraction=(frac, device)))
    monkeypatch.setattr(gpu_share, "_SHARE", {})
    return state


def test_unset_leaves_the_whole_card(card, monkeypatch):
    monkeypatch.delenv("GRAPHSERVE_GPU_MEMORY_FRACTION", raising=False)
    assert gpu_share.apply_memory_share(torch.device("cuda", 0)) is None
    assert card["fraction"] is None
    assert gpu_share.device_memory(torch.device("cuda", 0)) == (70 * GIB, 80 * GIB)


def test_a_share_caps_the_allocator_and_the_plans_total_and_free(card, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_GPU_MEMORY_FRACTION", "0.25")
    assert gpu_share.apply_memory_share(torch.device("cuda", 0)) == 0.25
    assert card["fraction"] == (0.25, 0)
    # the share is 20 GiB, of which this process has reserved 6: 14 free, though the card has 70 free
    assert gpu_share.device_memory(torch.device("cuda", 0)) == (14 * GIB, 20 * GIB)
    # others on the card leave less free than the share has left: the card's free memory is the bound
    card["free"] = 9 * GIB
    assert gpu_share.device_memory(torch.device("cuda", 0)) == (9 * GIB, 20 * GIB)
    card["reserved"] = 25 * GIB  # never negative
    assert gpu_share.device_memory(torch.device("cuda", 0))[0] == 0


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2", "half", "nan"])
def test_a_bad_fraction_is_refused_naming_the_switch_and_value(card, monkeypatch, value):
    monkeypatch.setenv("GRAPHSERVE_GPU_MEMORY_FRACTION", value)
    with pytest.raises(ConfigError, match=rf"GRAPHSERVE_GPU_MEMORY_FRACTION='{value}' is invalid: must be a fraction"):
        gpu_share.apply_memory_share(torch.device("cuda", 0))
    assert card["fraction"] is None


def test_cpu_engines_take_no_share(card, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_GPU_MEMORY_FRACTION", "0.5")
    assert gpu_share.apply_memory_share(torch.device("cpu")) is None and card["fraction"] is None
