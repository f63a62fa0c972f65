"""The attention prologue inside decode attention, or as its own launch, each with and without the FP8 streaming
matmul releasing the kernel after it: the same decode step captured four ways, timed in turns.

Per model, context and batch size: one model load and KV cache, four CUDA-graph captures of the decode step,
replayed alternately for ``--rounds`` rounds (benchmarks/pdl.timed_captures), each one's time the median of
its rounds:
- the prologue (q/k norm, rotary, K/V write) in kernels/qk_rope_kv.py's launch before decode attention, or
  inside the decode kernel (kernels/decode_attention.decode_attention_qkv; layers/attention_triton.decode_prologue);
- the FP8 streaming matmul, launched without PDL, releasing the kernel after it once its programs have
  streamed their weights, or not (kernels/pdl.pdl_release_left_out): a decode kernel right after the qkv
  projection then launches during the projection's tail instead of after it.
The floor is the bytes the step must read over the best read bandwidth measured in this run
(benchmarks/roofline.py). ``same_tokens``: whether every capture's greedy tokens agree (the new token's score is
summed in another order inside the decode kernel, so a near tie may not).

Run: python3 -m benchmarks.decode_prologue [--models dummy:llama3-8b] [--fp8-models dummy:llama3-8b
     dummy:qwen3-30b-a3b] [--bs 1 64] [--ctx 512 2048] [--kv-cache-dtype fp8_e4m3]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from benchmarks.pdl import compare_captures
from graphserve.kernels.pdl import pdl_release_left_out
from graphserve.layers.attention_triton import decode_prologue

COLS = ["model", "quantization", "kv_cache_dtype", "bs", "ctx", "launch_ms", "in_decode_ms", "launch_release_ms",
        "in_decode_release_ms", "floor_ms", "ratio_launch", "ratio_best", "best", "same_tokens"]
# label: (prologue inside decode attention, a left-out streaming matmul releases the kernel after it)
VARIANTS = {"launch": (False, False), "in decode": (True, False), "launch, release": (False, True),
            "in decode, release": (True, True)}
KEYS = {label: label.replace(",", "").replace(" ", "_") + "_ms" for label in VARIANTS}  # "in decode" -> in_decode_ms


@contextlib.contextmanager
def variant(in_decode: bool, release: bool) -> Iterator[None]:
    with decode_prologue(in_decode), pdl_release_left_out(release):
        yield


def main() -> None:
    scopes = {label: (lambda f=fused, r=release: variant(f, r)) for label, (fused, release) in VARIANTS.items()}
    _, rows, finish = compare_captures(__doc__, scopes, result_name="decode_prologue", models=["dummy:llama3-8b"],
                                       fp8_models=["dummy:llama3-8b", "dummy:qwen3-30b-a3b"], bs=[1, 64])  # fmt: skip
    for r in rows:
        r.update({KEYS[label]: ms for label, ms in r["variants_ms"].items()})
        r["best"] = min(r["variants_ms"], key=r["variants_ms"].get)
        r["ratio_launch"] = r["launch_ms"] / r["floor_ms"]
        r["ratio_best"] = r["variants_ms"][r["best"]] / r["floor_ms"]
    finish(COLS)


if __name__ == "__main__":
    main()
