"""`graphserve demo`: the embedded default model, end to end on CPU, with output throughput."""

from __future__ import annotations

import argparse
import time

from graphserve.config import add_engine_args, config_from_args

DEMO_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Serving engines batch requests because",
    "A CUDA graph replays",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin:tiny-llama", help="model folder, builtin:<name> or dummy:<preset>")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 for greedy")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few built-in ones")
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    from graphserve.llm import LLM
    from graphserve.sampling_params import SamplingParams

    config = config_from_args(args, args.model)
    start = time.perf_counter()
    llm = LLM(**vars(config))
    print(f"loaded {config.model} on {llm.engine.core.device} in {time.perf_counter() - start:.2f} s "
          f"({llm.engine.info.num_params / 1e6:.1f} M parameters)")
    prompts = args.prompt or DEMO_PROMPTS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up: first-call costs
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for out in outputs:
        print(f"{out.prompt!r} -> {out.text!r}")
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {generated} output tokens in {elapsed:.2f} s: "
          f"{generated / elapsed:.1f} output tok/s")
    return 0
