"""What several GPU test files share: the MoE presets' expert shapes, the relative error they
compare by, the warm-up-then-capture every CUDA-graph replay test starts with, and a dummy model with a KV
pool and the engine's graph runner for decode steps over a fixed context."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

# name: (experts, hidden, intermediate per expert, top_k, renormalise)
MOE_MODELS = {
    "qwen3-30b-a3b": (128, 2048, 768, 8, True),
    "mixtral-8x7b": (8, 4096, 14336, 2, True),
    "olmoe-1b-7b": (64, 2048, 1024, 8, False),
    "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4, False),
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def capture(step: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """(graph, what the captured call returned) of ``step`` run once on a side stream first, so
    Triton compiles and autotunes outside the capture, then captured there."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = step()
    return graph, out


def decode_model(name: str, ctx: int, rows: int, **engine_args):
    """(config, loaded model, KV caches) of the dummy model ``name`` on the GPU, with a random KV pool that holds
    ``rows`` sequences of ``ctx + 1`` tokens; ``engine_args`` go to EngineConfig (max_model_len ctx + 64 unless
    given)."""
    from graphserve.config import EngineConfig
    from graphserve.models.loader import load_model

    device = torch.device("cuda")
    cfg = EngineConfig(model=name, device="cuda", **{"max_model_len": ctx + 64, **engine_args})
    loaded = load_model(cfg, device)
    bsz = cfg.block_size
    return cfg, loaded, loaded.info.kv.allocate(rows * (-(-(ctx + 1) // bsz)) + 2, bsz, device, fill="random")


def graph_runner(cfg, model, backend, kv_caches, sizes: list[int], ctx: int):
    """The engine's CUDA-graph runner for decode batches of ``sizes`` over contexts up to ``ctx + 64``, not yet
    captured."""
    from graphserve.engine.graphs import GraphRunner

    return GraphRunner(model, backend, kv_caches, sizes, (ctx + 64) // cfg.block_size + 1, cfg.max_model_len,
                       torch.device("cuda"))


def greedy_with_and_without_graphs(folder, prompts: list[list[int]], new_tokens: int, check: Callable | None = None,
                                   **engine_args) -> dict[bool, list[list[int]]]:  # fmt: skip
    """The fp32 engine's greedy tokens for ``prompts`` (16-token blocks and chunks) with CUDA graphs (up to 4 rows,
    so 3 prompts replay with a padding row) and without: {graphs: tokens}. After each run ``check(core)`` where
    given, no block leaks, and with graphs some decode step replayed one; each engine is gone before the next.
    model_utils is tests/support/model_utils.py, on the path through tests/conftest.py."""
    import gc

    from model_utils import engine_greedy

    from graphserve import LLM

    runs = {}
    for graphs in (True, False):
        llm = LLM(str(folder), device="cuda", dtype="float32", block_size=16, chunked_prefill_size=16,
                  cuda_graph_max_bs=4, disable_cuda_graph=not graphs, **engine_args)  # fmt: skip
        runs[graphs] = engine_greedy(llm, prompts, new_tokens)
        core = llm.engine.core
        if check is not None:
            check(core)
        core.block_manager.check_no_leak()
        if graphs:
            decode = [r for r in core.telemetry.records() if r.kind == "decode"]
            assert decode and any(r.graph for r in decode)
        del llm, core
        gc.collect()
        torch.cuda.empty_cache()
    return runs


def generate_on_graphs(model: str, prompts, params, cuda_graph_max_bs: int, **kw) -> tuple[list[list[int]], list]:  # noqa: ANN001
    """Greedy tokens of ``LLM(model, **kw)`` on the prompts and its decode records, each of which must have replayed a
    CUDA graph; the engine is shut down (graphs before the process group, so --tp does not hang) and its memory
    released before the next one plans."""
    import gc

    from graphserve import LLM

    llm = LLM(model, device="cuda", cuda_graph_max_bs=cuda_graph_max_bs, mem_fraction_static=0.5, **kw)
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        records = [r for r in llm.engine.core.telemetry.records() if r.kind == "decode"]
    finally:
        llm.engine.core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert records and all(r.graph for r in records), "decode steps should replay CUDA graphs"
    return tokens, records
