"""Offline throughput on the workload nano-vllm and mini-sglang publish, against HF transformers.

Requests: input and output lengths uniform in [100, 1024], random token ids, EOS ignored, one seeded
list. Two measurements, in the same run, on the same architecture with random weights:

- graphserve alone on the published workload (``--num-requests``, 256): ``LLM.generate`` on all of
  them at once, credited with the tokens it returned.
- graphserve against Hugging Face ``generate`` on one declared subset, run by both sides: the first
  ``--hf-requests`` requests with their output lengths cut to ``--hf-max-output-len``. HF runs every
  row of a batch until its longest row is done, and its eager decode step costs ~100 ms for Llama-3-8B
  at batch 32 on an H200 (host-bound), so the published lengths (a batch's longest is ~1,000 tokens)
  took 106 s for 32 requests; the cut keeps the HF side near 30 s. HF: left-padded batches of
  ``--hf-batch`` in list order, greedy, EOS off, each row credited with the tokens it generated up to
  its own output length, read off the returned sequences; ``hf_computed_tokens`` is what the padded
  batches computed. graphserve runs the same subset with ``LLM.generate``, credited as above.

Prefix caching is off: the subset's prompts are the first prompts of the full list, and a cache would
hand the second run their prefill. Throughput is credited tokens over wall time, warm-up excluded.
Every number in the result file is written here.

Run: python3 -m benchmarks.offline [--models dummy:qwen3-0.6b dummy:llama3-8b] [--num-requests 256]
     [--hf-requests 32 --hf-max-output-len 256]   (about 3 minutes for both models on an H200)
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from benchmarks.common import print_table, write_result
from graphserve import LLM, SamplingParams

Request = tuple[list[int], int]  # (prompt ids, output length)


def workload(n: int, seed: int, vocab: int) -> list[Request]:
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab - 10) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
            for _ in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_graphserve(llm: LLM, reqs: list[Request]) -> tuple[float, int, list[int]]:
    """(seconds, output tokens returned, per-request tokens returned) for all of ``reqs`` in one generate call."""
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True) for _, out in reqs]
    # Warm-up on the measured prompts' own lengths (other token ids), a few tokens each, so the kernels
    # the measured prefill chunks and mixed steps need (MoE tiles are chosen per token bucket) compile
    # here and not inside the timed run.
    warm = [{"prompt_token_ids": [7 + i % 3] * len(ids)} for i, (ids, _) in enumerate(reqs)]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    device = llm.engine.core.runner.device
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    got = [len(o.token_ids) for o in outs]
    return time.perf_counter() - t0, sum(got), got


def run_hf(hf_config, reqs: list[Request], batch: int, device: torch.device,
           dtype: torch.dtype = torch.bfloat16) -> tuple[float, list[int], list[int]]:
    """(seconds, per-row credited tokens, per-row computed tokens) for HF generate over ``reqs``."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):  # initialise the random weights on the device, not on the host
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # EOS ignored on both sides, as graphserve's ignore_eos
    model.generation_config.pad_token_id = 0

    def generate(model, chunk: list[Request]) -> tuple[list[int], list[int]]:
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(chunk):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        with torch.inference_mode():
            seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                  max_new_tokens=max(out for _, out in chunk), do_sample=False)
        generated = seqs.shape[1] - width  # every row of the batch ran this many steps
        return [min(out, generated) for _, out in chunk], [generated] * len(chunk)

    generate(model, [(ids[:16], 2) for ids, _ in reqs[:2]])  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    credited: list[int] = []
    computed: list[int] = []
    for i in range(0, len(reqs), batch):
        got, ran = generate(model, reqs[i : i + batch])
        credited += got
        computed += ran
    _sync(device)
    dt = time.perf_counter() - t0
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dt, credited, computed


def hf_subset(reqs: list[Request], n: int, max_output_len: int) -> list[Request]:
    """The declared subset both sides run: the first ``n`` requests, outputs cut to ``max_output_len``."""
    if not 1 <= n <= len(reqs):
        raise SystemExit(f"--hf-requests={n} is invalid: must be between 1 and --num-requests={len(reqs)}")
    if max_output_len < 1:
        raise SystemExit(f"--hf-max-output-len={max_output_len} is invalid: must be >= 1")
    return [(ids, min(out, max_output_len)) for ids, out in reqs[:n]]


def free_cuda(device: torch.device) -> float:
    """Collect what the last engine left (its graphs and pools sit in reference cycles); GiB still held."""
    gc.collect()
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device) / 2**30


def measure_model(model: str, reqs: list[Request], subset: list[Request], hf_batch: int,
                  device: torch.device) -> dict:
    """One result row: graphserve on ``reqs``, then both sides on ``subset``."""
    llm = LLM(model, max_model_len=2048, enable_prefix_caching=False)
    dt, toks, _ = run_graphserve(llm, reqs)
    sub_dt, sub_toks, _ = run_graphserve(llm, subset)
    hf_config = llm.engine.core.hf_config
    llm.engine.core.shutdown()
    del llm
    held = free_cuda(device)
    hf_dt, credited, computed = run_hf(hf_config, subset, hf_batch, device)
    free_cuda(device)
    ours, theirs = sub_toks / sub_dt, sum(credited) / hf_dt
    return {"model": model, "requests": len(reqs), "requested_tokens": sum(out for _, out in reqs),
            "out_tokens": toks, "seconds": dt, "tok_s": toks / dt,
            "hf_requests": len(subset), "hf_max_output_len": max(out for _, out in subset),
            "subset_requested_tokens": sum(out for _, out in subset), "subset_out_tokens": sub_toks,
            "subset_seconds": sub_dt, "subset_tok_s": ours, "hf_batch": hf_batch, "hf_out_tokens": sum(credited),
            "hf_computed_tokens": sum(computed), "hf_seconds": hf_dt, "hf_tok_s": theirs,
            "gib_held_after_graphserve": held, "ratio_vs_hf": ours / theirs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dummy:qwen3-0.6b", "dummy:llama3-8b"])
    p.add_argument("--num-requests", type=int, default=256, help="graphserve alone: the first N of the workload")
    p.add_argument("--hf-requests", type=int, default=32, help="the subset both sides run: its first N requests")
    p.add_argument("--hf-max-output-len", type=int, default=256, help="the subset's outputs cut to this length")
    p.add_argument("--hf-batch", type=int, default=None, help="HF rows per generate call (default: the subset)")
    args = p.parse_args()
    device = torch.device("cuda")
    reqs = workload(256, 0, 32000)[: args.num_requests]
    subset = hf_subset(reqs, args.hf_requests, args.hf_max_output_len)
    hf_batch = args.hf_batch or len(subset)
    rows = []
    for m in args.models:
        rows.append(measure_model(m, reqs, subset, hf_batch, device))
        print_table(rows[-1:], list(rows[-1].keys()))
        write_result("offline", {"rows": rows})  # after each model: a later one running out of time keeps these
    print_table(rows, ["model", "requests", "tok_s", "hf_requests", "subset_tok_s", "hf_tok_s", "ratio_vs_hf"])


if __name__ == "__main__":
    main()
