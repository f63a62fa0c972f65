"""The output projection after decode attention launched with PDL, or not: the same decode step captured both
ways, timed in turns.

Where decode attention's grid runs in one wave with room beside it (a decode step at small batch), the output
projection that follows it launches with PDL although its kernel (the FP8 streaming matmul) is left out by
default: its programs are placed while attention runs and wait there (kernels/pdl.pdl_joined,
models/llama.AFTER_DECODE_ATTENTION, layers/attention_triton.leaves_room). ``pdl_joins`` turns it off for the
comparison. At larger batches attention fills the GPU and the two captures are the same step.

Per model, context and batch size: one model load and KV cache, two CUDA-graph captures of the decode step,
replayed alternately for ``--rounds`` rounds (benchmarks/pdl.timed_captures), each one's time the median of its
rounds. The floor is the bytes the step must read over the best read bandwidth measured in this run
(benchmarks/roofline.py). ``same_tokens``: whether every capture's greedy tokens agree.

Run: python3 -m benchmarks.pdl_join [--fp8-models dummy:llama3-8b dummy:qwen3-30b-a3b] [--bs 1 8 64] [--ctx 512]
"""

from __future__ import annotations

from benchmarks.pdl import compare_captures
from graphserve.kernels.pdl import pdl_joins

COLS = ["model", "quantization", "kv_cache_dtype", "bs", "ctx", "apart_ms", "joined_ms", "floor_ms", "ratio_apart",
        "ratio_joined", "joined_vs_apart", "same_tokens"]


def main() -> None:
    scopes = {"apart": lambda: pdl_joins(False), "joined": lambda: pdl_joins(True)}
    _, rows, finish = compare_captures(__doc__, scopes, result_name="pdl_join", models=[],
                                       fp8_models=["dummy:llama3-8b", "dummy:qwen3-30b-a3b"], bs=[1, 8, 64])  # fmt: skip
    for r in rows:
        r["apart_ms"], r["joined_ms"] = r["variants_ms"]["apart"], r["variants_ms"]["joined"]
        r["ratio_apart"], r["ratio_joined"] = r["apart_ms"] / r["floor_ms"], r["joined_ms"] / r["floor_ms"]
        r["joined_vs_apart"] = r["joined_ms"] / r["apart_ms"]
    finish(COLS)


if __name__ == "__main__":
    main()
