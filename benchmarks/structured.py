"""Structured output's cost: batch 64, every request constrained by one JSON schema of moderate size,
against the same requests unconstrained, in the same run; then 64 requests with 64 distinct schemas,
their compiles included in the time.

The unconstrained run replays each constrained request's output length (max_tokens = that length,
ignore_eos), so both runs have the same batch size at every step and the same tokens: the ratio is the
price of the grammar (mask filling on the host, the mask on the device, the step-N-ids wait), not a
difference in workload. Both sample at the same temperature, so both take the sampler's full path.

Run: python3 -m benchmarks.structured [--models dummy:qwen3-0.6b dummy:llama3-8b] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time

import torch

from benchmarks.common import print_table, write_result
from graphserve import LLM, SamplingParams
from graphserve import structured as so

# An order with line items: nested object, array of objects, enums, bounded strings and integers.
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "maxLength": 16},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 32},
            "email": {"type": "string", "maxLength": 40},
            "tier": {"enum": ["free", "pro", "enterprise"]},
        }, "required": ["name", "email", "tier"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 6, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
            "note": {"type": "string", "maxLength": 48},
        }, "required": ["sku", "quantity", "note"]}},
        "priority": {"enum": ["low", "normal", "high"]},
        "gift": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "items", "priority", "gift"],
}


def distinct_schema(i: int) -> dict:
    """SCHEMA with renamed fields and a different enum: a new grammar to compile, of the same size."""
    s = copy.deepcopy(SCHEMA)
    s["properties"] = {f"{k}_{i}": v for k, v in s["properties"].items()}
    s["required"] = [f"{k}_{i}" for k in s["required"]]
    s["properties"][f"priority_{i}"] = {"enum": [f"p{i}_{j}" for j in range(3)]}
    return s


def prompts(n: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(300, vocab - 300) for _ in range(128)]} for _ in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(llm: LLM, reqs: list[dict], params: list[SamplingParams]):
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    sync()
    return time.perf_counter() - t0, outs


def json_objects(outs) -> int:
    """Outputs that ended by their grammar and parse as a JSON object."""
    n = 0
    for o in outs:
        try:
            n += o.finish_reason == "stop" and isinstance(json.loads(o.text), dict)
        except json.JSONDecodeError:
            pass
    return n


def run_model(model: str, batch: int, max_tokens: int, temperature: float) -> dict:
    llm = LLM(model, max_model_len=1024, **({} if torch.cuda.is_available() else {"num_kv_tokens": 16384}))
    vocab = llm.engine.core.info.vocab_size
    compiler = llm.engine.core.structured.compiler
    # each run gets prompts of its own (same lengths), so none finds another run's prefix in the cache
    warm, reqs_con, reqs_free, reqs_mix = (prompts(batch, vocab, seed) for seed in range(4))
    schema = so.json_schema(SCHEMA, "guided_json")
    # warm-up: kernels, graphs and the grammar compiler's tokenizer table (about a second at 150k tokens)
    llm.generate(warm[:4], SamplingParams(max_tokens=32, temperature=temperature, structured=schema), use_tqdm=False)
    llm.generate(warm[4:8], SamplingParams(max_tokens=32, temperature=temperature, ignore_eos=True), use_tqdm=False)

    con_params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, structured=schema)
                  for i in range(batch)]
    con_s, con_outs = timed(llm, reqs_con, con_params)
    lengths = [len(o.token_ids) for o in con_outs]
    valid = json_objects(con_outs)

    free_params = [SamplingParams(max_tokens=n, temperature=temperature, seed=i, ignore_eos=True)
                   for i, n in enumerate(lengths)]
    free_s, free_outs = timed(llm, reqs_free, free_params)
    assert [len(o.token_ids) for o in free_outs] == lengths

    compiles0, compile_s0 = compiler.num_compiles, compiler.compile_seconds
    mixed = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                            structured=so.json_schema(distinct_schema(i), "guided_json")) for i in range(batch)]
    mix_s, mix_outs = timed(llm, reqs_mix, mixed)
    mix_tokens = sum(len(o.token_ids) for o in mix_outs)
    mix_valid = json_objects(mix_outs)
    tokens = sum(lengths)
    row = {
        "model": model, "batch": batch, "temperature": temperature, "out_tokens": tokens,
        "mean_len": tokens / batch, "valid_json": f"{valid}/{batch}",
        "unconstrained_tok_s": tokens / free_s, "constrained_tok_s": tokens / con_s,
        "ratio": free_s / con_s,
        "distinct_schemas_tok_s": mix_tokens / mix_s, "distinct_valid": f"{mix_valid}/{batch}",
        "distinct_compiles": compiler.num_compiles - compiles0,
        "compile_ms_mean": 1e3 * (compiler.compile_seconds - compile_s0) / max(1, compiler.num_compiles - compiles0),
        "distinct_ratio": (mix_tokens / mix_s) / (tokens / free_s),
    }
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dummy:qwen3-0.6b", "dummy:llama3-8b"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--quick", action="store_true", help="first model only, max_tokens 256")
    args = p.parse_args()
    models = args.models[:1] if args.quick else args.models
    max_tokens = 256 if args.quick else args.max_tokens
    rows = []
    for m in models:
        rows.append(run_model(m, args.batch, max_tokens, args.temperature))
        print_table(rows[-1:], list(rows[-1].keys()))
    print_table(rows, ["model", "mean_len", "valid_json", "unconstrained_tok_s", "constrained_tok_s",
                       "distinct_schemas_tok_s", "compile_ms_mean", "ratio"])
    write_result("structured", {"rows": rows})


if __name__ == "__main__":
    main()
