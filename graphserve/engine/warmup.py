"""Warm-up before ready: run every step shape the scheduler can produce, so no request after /health says
200 pays for a kernel compilation or a first-use allocation.

Triton compiles a kernel per specialization of its arguments (an integer that is 1, or divisible by 16,
is a different kernel), the sampler takes a different path per knob, and a prefill chunk, a mixed step
and a decode batch are different launches. A server that answered 200 before they had all run once
made its first requests wait for the compiler (TTFT p99 430-460 ms against a steady 40 ms). So the engine
process drives the core through synthetic requests that cover:

- prefill lengths at and around every specialization boundary, up to and past the chunk size (chunked);
- steps of every power of two of tokens up to the chunk size (several prompts at once where one would pass
  the longest prompt): kernels that pick their tiles by the step's token count from a table of doubling
  buckets (the MoE GEMMs) meet every bucket, since each bucket's token range holds a power of two;
- prefix-cache hits: a prompt sent again whole (the cache gives all but its last block's tokens) and sent
  again with more tokens after it, alone and beside a prompt with no hit: an extend over cached KV;
- prefill arriving while others decode (mixed steps);
- decode at every captured batch size (requests that finish one per step walk the batch down);
- sampling with every knob: greedy, temperature with top-p/top-k/min-p and a seed, penalties, logprobs;
- launches the model's layers ask for (``warmup_work``) beside the steps: kernels whose tile a card's measured
  rule picks from sizes the steps above do not all reach. MLA's decode tile follows the step's batch and
  block-table width (kernels/mla_config.py), and the steps above meet a few (batch, width) pairs of the many a
  server sees (an H100's rule gave a 64-token tile at batch 4 and 1k context, first compiled in service), so
  the layer launches every tile the rule may pick, once each, written directly and merged.
  The rules that pick by a step's row or pair count need none: they are measured at doubling counts
  (graphserve/tuning), so the gemv and fp4 routes switch where the prefill lengths and the ladder pass on both
  sides, and every fp8 route and MoE bucket holds a power of two the ladder runs (tests/kernels/test_mla_warm_tiles.py).

Afterwards the core's counters are reset: the warm-up is not served traffic.

Integers that follow the batch (token and pair counts, a block table's width) are left unspecialized in the
kernels that see them eagerly (``do_not_specialize``), so one compile serves every batch; what the warm-up
covers is what remains specialized. engine/compile_watch.py checks it in service, and
tests/gpu/test_warmup_gpu.py drives served traffic after the warm-up and expects no compile.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from graphserve.engine.request import EngineRequest
from graphserve.layers.warmup_work import run_warmup_work
from graphserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARMUP_PREFIX = "warmup-"
# CPU runs plain PyTorch: no graphs, no JIT to pay for. A short pass runs each code path once (prefill,
# mixed, decode, every sampler knob) without slowing the tests that start servers.
_CPU_DECODE_SIZES = (1, 2)
_CPU_PREFILL_LENGTHS = (3, 17)


def sampling_variants(max_tokens: int = 4) -> list[SamplingParams]:
    """One SamplingParams per sampler path; each knob is on in at least one of them."""
    base = {"ignore_eos": True, "max_tokens": max_tokens}
    return [
        SamplingParams(temperature=0.0, **base),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=1, **base),
        SamplingParams(temperature=1.0, seed=2, **base),
        SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                       **base),
        SamplingParams(temperature=0.0, logprobs=5, **base),
        SamplingParams(temperature=0.9, top_p=0.95, logprobs=2, seed=3, n=2, **base),
    ]


def prefill_lengths(chunk: int, block_size: int, max_prompt: int) -> list[int]:
    """Prompt lengths that reach each kernel specialization: 1, small odd sizes, multiples of 16 and
    their neighbours, a block, the chunk and past it (so a chunked prefill runs)."""
    cands = {1, 2, 3, 7, 15, 16, 17, 31, 32, 33, block_size - 1, block_size, block_size + 1, 100,
             chunk // 2 + 3, chunk - 1, chunk, chunk + 1, chunk + block_size + 5}
    return sorted(n for n in cands if 1 <= n <= max_prompt)


def token_ladder(chunk: int) -> list[int]:
    """Every power of two of tokens up to the step's token budget."""
    return [1 << i for i in range(chunk.bit_length()) if 1 << i <= chunk]


def split_prompts(tokens: int, max_prompt: int) -> list[int]:
    """Prompt lengths, none above ``max_prompt``, that add up to ``tokens``: one step's worth."""
    full, rest = divmod(tokens, max_prompt)
    return [max_prompt] * full + ([rest] if rest else [])


def decode_sizes(core: Any) -> list[int]:
    graphs = getattr(core.runner, "graphs", None)
    if graphs is not None:
        return list(graphs.sizes)
    return list(_CPU_DECODE_SIZES)


class _Driver:
    def __init__(self, core: Any):
        self.core = core
        self.vocab = core.info.vocab_size
        self.rng = random.Random(0)
        self.count = 0
        self.steps = 0

    def ids(self, n: int) -> list[int]:
        # Random ids from the middle of the vocabulary: no special tokens, and no prefix-cache hit that would
        # turn a prefill length into a shorter one.
        lo, hi = min(10, self.vocab - 1), max(11, self.vocab - 10)
        return [self.rng.randrange(lo, hi) for _ in range(n)]

    def add(self, prompt_len: int, params: SamplingParams) -> None:
        self.add_ids(self.ids(prompt_len), params)

    def add_ids(self, ids: list[int], params: SamplingParams) -> None:
        self.core.add_request(EngineRequest(f"{WARMUP_PREFIX}{self.count}", ids, params, time.monotonic()))
        self.count += 1

    def step(self) -> None:
        for out in self.core.step():
            if out.error is not None:
                raise RuntimeError(f"warm-up request {out.request_id} failed: {out.error}")
        self.steps += 1

    def drain(self, limit: int = 100_000) -> None:
        while self.core.has_unfinished_requests() and limit:
            self.step()
            limit -= 1


def warm_up(core: Any) -> dict[str, float]:
    """Run the warm-up on ``core`` (idle, just built); returns what it ran, for the ready log line."""
    t0 = time.perf_counter()
    core.stop_checker.prepare()  # the token table of the stop-string check: built now, not in a serving step
    launches = kernel_warmups(core)
    d = _Driver(core)
    cfg = core.config
    max_prompt = core.max_model_len - 8
    full = core.device.type == "cuda"
    if full:
        lengths = prefill_lengths(cfg.chunked_prefill_size, cfg.block_size, max_prompt)
        variants = sampling_variants()
    else:
        lengths = [n for n in _CPU_PREFILL_LENGTHS if n <= max_prompt]
        variants = sampling_variants(max_tokens=2)
    # Prefill shapes, one at a time (each length is its own launch), each with a sampler variant.
    for i, n in enumerate(lengths):
        d.add(n, variants[i % len(variants)])
        d.drain()
    if full:
        for tokens in token_ladder(cfg.chunked_prefill_size):
            for n in split_prompts(tokens, max_prompt):
                d.add(n, variants[0])
            d.drain()
    # Every sampler path in one batch, then mixed steps: new prompts arrive while those decode.
    for p in variants:
        d.add(24, p)
    d.step()
    for i, p in enumerate(variants if full else []):
        d.add(lengths[min(i, len(lengths) - 1)] + 1 if lengths else 2, p)
        d.step()
    d.drain()
    if cfg.enable_prefix_caching:
        prefix_hits(d, cfg.block_size, max_prompt, full)
    # Decode at every captured size: B requests of which one finishes per step walk the batch down B..1.
    sizes = decode_sizes(core)
    cap = getattr(core.scheduler, "max_running", None) or max(sizes)
    largest = min(max(sizes), cap)
    for i in range(largest):
        d.add(8, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2 + i))
    d.drain()
    hit_tokens = core.block_manager.hit_tokens
    _reset_counters(core)
    seconds = time.perf_counter() - t0
    return {"requests": d.count, "steps": d.steps, "seconds": seconds, "prefill_lengths": len(lengths),
            "decode_sizes": largest, "prefix_hit_tokens": hit_tokens, "kernel_warmups": launches}


def kernel_warmups(core: Any) -> int:
    """Run the launches the model's layers ask for before serving (layers/warmup_work.py), on this process's
    runner (the other ranks run theirs as they start); returns how many ran."""
    runner = core.runner
    return run_warmup_work(getattr(runner, "model", None), getattr(runner, "attn_backend", None),
                           getattr(runner, "kv_caches", []), core.max_model_len)  # fmt: skip


def prefix_lengths(block_size: int, max_prompt: int) -> list[int]:
    """Prompt lengths whose repeats leave each kind of remainder after the cached blocks: one token, a
    whole block, a few, and several blocks' worth of prefix."""
    cands = {2 * block_size + 1, 2 * block_size, 4 * block_size + 7, 100}
    return sorted(n for n in cands if block_size < n <= max_prompt - block_size - 3)


def prefix_hits(d: _Driver, block_size: int, max_prompt: int, full: bool) -> None:
    """Each prompt: sent, sent again (a hit on all its whole blocks), then again with new tokens after it
    (a hit, then a prefill of more than a block); the last round beside a fresh prompt in the same step."""
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2)
    lengths = prefix_lengths(block_size, max_prompt)
    for n in lengths if full else lengths[:1]:
        prompt = d.ids(n)
        d.add_ids(prompt, greedy)
        d.drain()
        d.add_ids(prompt, greedy)
        d.drain()
        d.add_ids(prompt + d.ids(3), greedy)
        d.add_ids(prompt + d.ids(block_size + 3), greedy)
        d.add(n, greedy)
        d.drain()


def _reset_counters(core: Any) -> None:
    core.prompt_tokens_total = 0
    core.generation_tokens_total = 0
    core.scheduler.num_preemptions = core.scheduler.num_preemptions_for_pages = 0
    bm = core.block_manager
    bm.hit_tokens = bm.queried_tokens = 0
