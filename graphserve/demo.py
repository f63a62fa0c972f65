"""`graphserve demo`: the embedded default end to end on CPU.

1. offline: ``LLM.generate`` on a few prompts, with output tok/s;
2. online: an in-process OpenAI-compatible server, a short concurrency sweep through it, the
   table and the fitted step_time = a + b·N printed, and the report folder written.
"""

from __future__ import annotations

import argparse
import time

DEMO_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Serving engines batch requests because",
    "A CUDA graph replays",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin:tiny-llama", help="model folder, builtin:<name> or dummy:<preset>")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per offline prompt")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="sweep levels")
    parser.add_argument("--input-len", type=int, default=128, help="sweep prompt length (tokens)")
    parser.add_argument("--output-len", type=int, default=64, help="sweep output length (tokens)")
    parser.add_argument("--output-dir", default="graphserve-demo", help="report folder")
    parser.add_argument("--skip-offline", action="store_true", help="only the server sweep")


def offline(model: str, max_tokens: int) -> None:
    from graphserve.llm import LLM
    from graphserve.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(model)
    print(f"loaded {model} on {llm.engine.core.device} in {time.perf_counter() - start:.2f} s "
          f"({llm.engine.info.num_params / 1e6:.1f} M parameters)")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(DEMO_PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up: first-call costs
    start = time.perf_counter()
    outputs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for out in outputs:
        print(f"  {out.prompt!r} -> {out.text!r}")
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"offline: {len(outputs)} requests, {generated} output tokens in {elapsed:.2f} s: "
          f"{generated / elapsed:.1f} output tok/s\n")


def run(args: argparse.Namespace) -> int:
    from graphserve.bench import sweep

    if not args.skip_offline:
        offline(args.model, args.max_tokens)
    parser = argparse.ArgumentParser(prog="graphserve sweep")
    sweep.add_arguments(parser)
    sweep_args = parser.parse_args([
        "--model", args.model, "--backend", "openai", "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", "1.0", "--concurrency", args.concurrency, "--output-dir", args.output_dir,
        "--disable-tqdm",
    ])
    print(f"online: in-process server, concurrency sweep {args.concurrency} "
          f"({args.input_len} in / {args.output_len} out tokens)")
    return sweep.run(sweep_args)
