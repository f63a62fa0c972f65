"""Offline throughput on the workload nano-vllm and mini-sglang publish, against HF transformers.

256 requests, input and output lengths uniform in [100, 1024], ignore_eos, random token ids.
graphserve runs all of them through ``LLM.generate``; Hugging Face ``generate`` runs the first
``--hf-requests`` of them (left-padded batches, ``min_new_tokens == max_new_tokens`` so none stops
early) on the same weights' shapes in the same run. Both count only the requested output tokens.

Run: python3 -m benchmarks.offline [--models dummy:qwen3-0.6b dummy:llama3-8b]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import print_table, write_result
from graphserve import LLM, SamplingParams


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab - 10) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
            for _ in range(n)]


def run_graphserve(model: str, reqs, **engine_args) -> tuple[float, int, LLM]:
    llm = LLM(model, **engine_args)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True) for _, out in reqs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up: compile kernels
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.token_ids) for o in outs), llm


def run_hf(hf_config, reqs, batch: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):  # initialise the random weights on the GPU, not on the host
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    tokens = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(ids) for ids, _ in chunk)
        new = max(out for _, out in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(chunk):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)
        tokens += sum(out for _, out in chunk)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return dt, tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dummy:qwen3-0.6b", "dummy:llama3-8b"])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--hf-requests", type=int, default=64)
    p.add_argument("--hf-batch", type=int, default=64)
    args = p.parse_args()
    rows = []
    for m in args.models:
        dt, toks, llm = run_graphserve(m, workload(args.num_requests, 0, 32000), max_model_len=2048)
        hf_config = llm.engine.core.hf_config
        del llm
        torch.cuda.empty_cache()
        hf_dt, hf_toks = run_hf(hf_config, workload(args.num_requests, 0, 32000)[: args.hf_requests], args.hf_batch)
        ours, theirs = toks / dt, hf_toks / hf_dt
        rows.append({"model": m, "requests": args.num_requests, "out_tokens": toks, "seconds": dt,
                     "tok_s": ours, "hf_requests": args.hf_requests, "hf_tok_s": theirs, "ratio_vs_hf": ours / theirs})
        print_table(rows[-1:], list(rows[-1].keys()))
    print_table(rows, ["model", "tok_s", "hf_tok_s", "ratio_vs_hf"])
    write_result("offline", {"rows": rows})


if __name__ == "__main__":
    main()
