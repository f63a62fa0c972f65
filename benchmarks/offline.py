"""Offline throughput on the workload nano-vllm and mini-sglang publish, against HF transformers.

Requests: input and output lengths uniform in [100, 1024], random token ids, EOS ignored. Both sides
run the same ``--num-requests`` of them (the first N of one seeded list; 256 is the published
workload), in the same run, on the same architecture with random weights:

- graphserve: ``LLM.generate`` on all N at once; credited with the tokens it returned.
- Hugging Face ``generate``: left-padded batches of ``--hf-batch`` in list order, greedy, EOS off.
  A batch runs until its longest request is done (HF keeps computing every row to the end), and
  each row is credited with the tokens it generated up to its own output length, read off the
  returned sequences; ``hf_computed_tokens`` is what the padded batches computed.

Throughput is credited tokens over wall time, warm-up excluded. Every number in the result file is
written here.

Run: python3 -m benchmarks.offline [--models dummy:qwen3-0.6b dummy:llama3-8b] [--num-requests 256]
"""

from __future__ import annotations

import argparse
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


def run_graphserve(model: str, reqs: list[Request], **engine_args) -> tuple[float, int, LLM]:
    """(seconds, output tokens returned, the LLM) for all of ``reqs`` in one generate call."""
    llm = LLM(model, **engine_args)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True) for _, out in reqs]
    # Warm-up: the same prompt lengths with other token ids (the measured prompts must not find their
    # prefix cached), a few tokens each, so the kernels the measured prefill chunks and mixed steps
    # need (MoE tiles are chosen per token bucket) compile here and not inside the timed run.
    warm = [{"prompt_token_ids": [7 + i % 3] * len(ids)} for i, (ids, _) in enumerate(reqs)]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.engine.core.block_manager.reset_prefix_cache()  # the timed run starts from an empty cache
    device = llm.engine.core.runner.device
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs), llm


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dummy:qwen3-0.6b", "dummy:llama3-8b"])
    p.add_argument("--num-requests", type=int, default=256, help="the first N requests, run by both sides")
    p.add_argument("--hf-batch", type=int, default=64)
    args = p.parse_args()
    device = torch.device("cuda")
    rows = []
    for m in args.models:
        reqs = workload(256, 0, 32000)[: args.num_requests]
        dt, toks, llm = run_graphserve(m, reqs, max_model_len=2048)
        hf_config = llm.engine.core.hf_config
        del llm
        torch.cuda.empty_cache()
        hf_dt, credited, computed = run_hf(hf_config, reqs, args.hf_batch, device)
        hf_toks = sum(credited)
        ours, theirs = toks / dt, hf_toks / hf_dt
        rows.append({"model": m, "requests": len(reqs), "requested_tokens": sum(out for _, out in reqs),
                     "out_tokens": toks, "seconds": dt, "tok_s": ours, "hf_batch": args.hf_batch,
                     "hf_out_tokens": hf_toks, "hf_computed_tokens": sum(computed), "hf_seconds": hf_dt, "hf_tok_s": theirs, "ratio_vs_hf": ours / theirs})
        print_table(rows[-1:], list(rows[-1].keys()))
        write_result("offline", {"rows": rows})  # after each model: a later one running out of time keeps these
    print_table(rows, ["model", "requests", "tok_s", "hf_tok_s", "ratio_vs_hf"])


if __name__ == "__main__":
    main()
