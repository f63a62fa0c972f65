"""`graphserve demo`: the embedded default end to end on CPU.

1. offline: ``LLM.generate`` on a few prompts, with output tok/s: the trained SmolLM2-135M
   (``builtin:smollm2-135m``) where its package is installed, so the generations are real words;
2. online: an in-process OpenAI-compatible server, a short concurrency sweep through it, the
   table and the fitted step_time = a + b·N printed, and the report folder written. The sweep runs
   ``builtin:tiny-llama``: its 172 requests take ~20 s on two cores, the trained model's minutes.
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


TRAINED = "builtin:smollm2-135m"
SWEEP_DEFAULT = "builtin:tiny-llama"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model folder, builtin:<name> or dummy:<preset>, for both parts (default: "
                             f"{TRAINED} offline where installed, else {SWEEP_DEFAULT}; {SWEEP_DEFAULT} for the sweep)")
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


def offline_model() -> str:
    from graphserve.models.trained import trained_available

    if trained_available(TRAINED.removeprefix("builtin:")):
        return TRAINED
    print(f"({TRAINED} is not installed: pip install 'graphserve[trained]' for a trained model's generations)")
    return SWEEP_DEFAULT


def run(args: argparse.Namespace) -> int:
    from graphserve.bench import sweep

    if not args.skip_offline:
        offline(args.model or offline_model(), args.max_tokens)
    sweep_model = args.model or SWEEP_DEFAULT
    parser = argparse.ArgumentParser(prog="graphserve sweep")
    sweep.add_arguments(parser)
    sweep_args = parser.parse_args([
        "--model", sweep_model, "--backend", "openai", "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", "1.0", "--concurrency", args.concurrency, "--output-dir", args.output_dir,
        "--disable-tqdm",
    ])
    print(f"online: in-process server running {sweep_model}, concurrency sweep {args.concurrency} "
          f"({args.input_len} in / {args.output_len} out tokens)")
    return sweep.run(sweep_args)
