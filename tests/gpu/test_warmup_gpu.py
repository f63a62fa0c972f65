"""Ready means warm: after the server's warm-up, served traffic compiles no Triton kernel.

The traffic is what a server sees and the warm-up does not replay: prompts of lengths it never used,
prompts sent again (prefix-cache hits, whole and extended), prompts arriving while others decode, and
decode at batch sizes between the captured ones. Each kernel specialized after the warm-up is named. The
sparse-attention presets are here since their sweeps logged compiles in service (block-table alignment and width,
the top-k step, the MoE row mask: results/breakdown_*/cfg0-server.log)."""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch

from graphserve.config import EngineConfig
from graphserve.engine.compile_watch import CompileWatch
from graphserve.engine.core import EngineCore
from graphserve.engine.request import EngineRequest
from graphserve.engine.warmup import warm_up
from graphserve.sampling_params import SamplingParams


def _traffic(core: EngineCore, seed: int) -> int:
    rng = random.Random(seed)
    vocab = core.info.vocab_size
    count = 0

    def add(ids: list[int], max_tokens: int, **knobs) -> None:
        nonlocal count
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **knobs)
        core.add_request(EngineRequest(f"t{count}", ids, params, time.monotonic()))
        count += 1

    def drain() -> None:
        while core.has_unfinished_requests():
            for out in core.step():
                assert out.error is None, out.error

    prompts = [[rng.randrange(10, vocab - 10) for _ in range(n)] for n in (5, 48, 200, 255, 256, 257, 700, 1500)]
    for p in prompts:  # alone, each length once
        add(p, 3, temperature=0.0)
        drain()
    for p in prompts:  # again: a prefix-cache hit on every whole block
        add(p, 2, temperature=0.7, top_p=0.9, seed=1)
        drain()
    for i, p in enumerate(prompts):  # extended, a few at a time, while earlier ones decode
        add(p + [rng.randrange(10, vocab - 10) for _ in range(1 + 9 * i)], 6 + i, temperature=0.0)
        if i % 3 == 2:
            core.step()
    drain()
    for n in (3, 5, 11, 24, 37):  # decode batches between the captured sizes
        for _ in range(n):
            add([rng.randrange(10, vocab - 10) for _ in range(rng.randrange(8, 64))], 4, temperature=0.0)
        drain()
    return count


# the sparse-attention presets hold most of a card (glm-5-l5: ~45 GB of bf16 weights): a larger share for them
MEMORY = {"dummy:glm-5-l5": 0.9, "dummy:deepseek-v4-flash-l6": 0.9}


@pytest.mark.parametrize("model", ["dummy:qwen3-0.6b", "dummy:olmoe-1b-7b", "dummy:deepseek-v2-lite",
                                   "dummy:glm-5-l5", "dummy:deepseek-v4-flash-l6"])
def test_traffic_after_the_warm_up_compiles_nothing(model):
    late: list[str] = []
    watch = CompileWatch(lambda name, diff: late.append(f"{name} ({diff})"))
    core = None
    try:
        core = EngineCore(EngineConfig(model=model, device="cuda", max_model_len=4096, cuda_graph_max_bs=64,
                                       mem_fraction_static=MEMORY.get(model, 0.6)))
        warm_up(core)
        watch.ready()
        assert _traffic(core, seed=3) > 0
    finally:
        watch.close()
        del core
        gc.collect()
        torch.cuda.empty_cache()  # the next model needs the memory
    assert late == [], f"{len(late)} kernels compiled after the warm-up:\n" + "\n".join(late)
