"""DeepSeek-V4 on a GPU: no kernel exists yet for its compressed attention or its clamped SwiGLU experts, so the
load is refused by name before any weight is allocated, and the expert kernels refuse the activation, rather than
run a slow or wrong path."""

from __future__ import annotations

import pytest
import torch

from graphserve.config import EngineConfig
from graphserve.errors import ConfigError
from graphserve.models.loader import load_model


def test_loading_on_cuda_is_refused_by_name_before_allocating():
    before = torch.cuda.memory_allocated()
    with pytest.raises(ConfigError, match="CPU reference path only") as e:
        load_model(EngineConfig(model="dummy:deepseek-v4-flash-l6"), torch.device("cuda"))
    assert e.value.param == "device" and torch.cuda.memory_allocated() == before
