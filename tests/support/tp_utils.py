"""Shared by the --tp / --ep tests: an engine's greedy tokens with its collectives checked, and the
refusal of a split that does not divide."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from graphserve import LLM, SamplingParams
from graphserve.config import add_engine_args, config_from_args
from graphserve.errors import ConfigError
from graphserve.models.parallel_check import check_parallel

# (layers, MoE layers) of a built model: where they are counted differs by architecture
LayerCounts = Callable[[object], tuple[int, int]]


def generate_on_ranks(folder: Path, prompts: list[str], params: SamplingParams, layer_counts: LayerCounts,
                      **engine_kw) -> list[list[int]]:
    """The tokens of ``prompts`` from a float32 engine built with ``engine_kw`` (tp / ep among them).
    Every decode step's collectives are checked, and no rank may outlive the engine's shutdown."""
    llm = LLM(str(folder), dtype="float32", **engine_kw)
    core = llm.engine.core
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        check_collectives(core, engine_kw.get("tp", 1), engine_kw.get("ep", 1), *layer_counts(core.runner.model))
    finally:
        core.shutdown()
    assert core.ranks is None or all(p.poll() is not None for p in core.ranks.procs), "ranks outlived shutdown"
    return tokens


def check_collectives(core, tp: int, ep: int, layers: int, moe_layers: int) -> None:  # noqa: ANN001
    """A decode step's collectives: at --tp N one all-reduce after attention and one after the MLP or MoE
    block per layer, plus the embedding's all-reduce and the logits' gather; at --ep N alone, one per
    MoE layer (attention and dense MLPs are replicated, so they must not be summed over ranks)."""
    expected = 2 * layers + 2 if tp > 1 else moe_layers if ep > 1 else 0
    decode = [r for r in core.telemetry.records() if r.kind == "decode"]
    assert decode
    hidden, vocab_rows = core.info.hidden_size, -(-core.info.vocab_size // tp) * tp
    for r in decode:
        assert r.comm_ops == expected, (r.comm_ops, expected)
        reduced = expected - 1 if tp > 1 else expected  # every collective but the logits' gather is [B, hidden]
        gathered = vocab_rows if tp > 1 else 0
        assert r.comm_bytes == r.batch_size * 4 * (hidden * reduced + gathered)  # float32


def refusal(folder: Path, *flags: str) -> ConfigError:
    """The ConfigError that the command-line ``flags`` get for the checkpoint in ``folder``."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(ConfigError) as e:
        check_parallel(config_from_args(parser.parse_args(list(flags)), str(folder)))
    return e.value
