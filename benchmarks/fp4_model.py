"""FP4 weights at the model level: decode steps and prefill against their floors, beside bf16 and FP8 in the same run.

- decode: ``dummy:llama3-8b --quantization nvfp4`` CUDA-graph steps at (bs 1, ctx 512) and (bs 64, ctx 2048), beside
  the bf16 and ``--quantization fp8`` models (same seed) at the same cases; ``--quantization mxfp4`` too. The floor
  is the bytes the step must read as the model description counts them (layers/quant/fp4_config.fp4_description:
  half a byte a weight plus the group scales, bf16 embedding rows and head, the KV in context) over the best read rate
  of this run (benchmarks.roofline's probes before and after the work, and every step's own rate), or the step's
  FLOPs over the bf16 matmul peak where that is larger (Hopper has no FP4 tensor cores: FP4 weights are widened to
  bf16 for the dot).
- ``dummy:gpt-oss-120b`` as published (MXFP4 routed experts, everything else bf16) on one GPU at (bs 1, ctx 512): its
  floor counts the experts the step's router chose. Its tok/s is printed beside SGLang's published 318.5 tok/s at
  bs 1 on 8 x H100: a figure from elsewhere on eight GPUs, for scale only, not measured here.
- prefill 8 x 2048 tokens of llama3-8b with NVFP4 weights: tok/s against the FP8 prefill of the same run; and again
  with every GEMM past 64 rows on the "dequant_fp8" variant whatever the card's table says (``[dequant_fp8]``: the
  weight converted to e4m3 per call, then cuBLASLt FP8; kernels/fp4_dequant_fp8.py), with its accuracy row.
- ``--quantization nvfp4 --fp4-load-as fp8`` (layers/quant/fp4_to_fp8.py): the same NVFP4 llama3-8b converted to FP8
  at load, decode at both cases and the 8 x 2048 prefill, beside FP4 and FP8: its floor counts the FP8 bytes it
  holds (twice FP4's), ``vs_nvfp4`` its step over the FP4 model's, and its accuracy row the FP4 rounding plus e4m3's.
- accuracy: top-1 agreement and mean KL(bf16 || quantized) over 4 x 256 tokens of the NVFP4, MXFP4 and FP8 models
  against the bf16 model with the same random weights. Random weights, not a trained model: these say the
  quantized models compute the same function within FP4's rounding, not how a trained model's quality changes.

Rows go to benchmarks/results/fp4_decode.json (``--result-name``), each with its card, its same-run floor and
ceilings, the issue's target and ``meets_target`` (decided on unrounded numbers; None where no target is set).

``--widenings W ...`` runs the NVFP4 llama3-8b decode again with each of the streaming kernels' other widenings as
the default (kernels/fp4_layout.DEFAULT_WIDEN; kernels/fp4_words.py), rows labelled ``[widen=W]`` with the same
targets: the model-level measurement that decides the default.

``--only gpt-oss`` runs the gpt-oss-120b rows alone (bs 1 and 8 at ctx 512): the probes, the model, its rows
against the same run's floor, merged into the result file beside the llama3-8b rows of earlier runs (whose prefill
and accuracy tables it keeps), with SGLang's figure recorded as ``measured_here: False``. About 2 minutes on an H100
by estimate, 3 at most: CUDA and Triton start-up ~15 s, the probes ~10 s, 117e9 random weights drawn and their
experts quantized to MXFP4 on the GPU ~30 s, the reference logits' prefill and the graph captures at bs 1 and 8
with their kernels compiled on a bare machine ~60 s, the timed replays and the probes again ~15 s.

Run: python3 -m benchmarks.fp4_model [--quick] [--skip-gpt-oss | --only gpt-oss] [--widenings word e4m3_ptx]
(--quick: under ~4 minutes on an H100; no MXFP4 llama3-8b; gpt-oss-120b at bs 1 only; each extra widening adds a
load, ~30 s)
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from benchmarks.common import merge_rows, print_table
from benchmarks.decode_setup import release_gpu_memory
from benchmarks.fp8 import (
    BF16_PROBE,
    FP8_PROBE,
    MatmulPeak,
    agreement,
    fp8_matmul_tflops,
    meets_target,
    run_model,
    settle_ceilings,
)
from benchmarks.roofline import ReadBandwidth, matmul_tflops, measured_read_bw
from graphserve.kernels import fp4_gemm, fp4_layout
from graphserve.kernels.common import sm_count
from graphserve.kernels.fp4_gemm_config import DEQUANT_ABOVE_ROWS, Fp4GemmTile, default_config

LLAMA = "dummy:llama3-8b"
GPT_OSS = "dummy:gpt-oss-120b"
PREFILL = (8, 2048)
# the targets: (model label, bs, ctx) -> bounds on the row's own fields (``_max``: at most, ``_min``: at least)
DECODE_TARGETS = {(f"{LLAMA} --quantization nvfp4", 1, 512): {"ratio_max": 1.5, "vs_bf16_max": 0.45},
                  (f"{LLAMA} --quantization nvfp4", 64, 2048): {"ratio_max": 1.3},
                  (f"{GPT_OSS} (mxfp4 experts as published)", 1, 512): {"ratio_max": 1.5}}
PREFILL_TARGET = {"vs_fp8_min": 0.5}  # NVFP4 prefill tok/s over FP8's, same run
AS_FP8 = "nvfp4 --fp4-load-as fp8"  # the NVFP4 model converted to FP8 at load: its label after "--quantization "
DEQUANT_FP8 = "nvfp4 [dequant_fp8]"  # the NVFP4 model with its prefill GEMMs on the dequant_fp8 variant
# SGLang's published gpt-oss-120b decode at batch 1 on 8 x H100: a reference figure, never measured by this benchmark
SGLANG_GPT_OSS_120B = {"tok_s": 318.5, "bs": 1, "gpus": "8 x H100", "source": "SGLang's published gpt-oss-120b figure"}


def decode_rows(label: str, run: dict, cases: list[tuple[int, int]], card: str, bf16: dict | None = None,
                fp8: dict | None = None, nvfp4: dict | None = None) -> list[dict]:
    """One row a case of ``run`` (benchmarks.fp8.run_model's result), with the same case's bf16, FP8 (and for the
    converted model, NVFP4) steps where those models ran it."""
    rows = []
    for bs, ctx in cases:
        s = run["steps"][(bs, ctx)]
        row = {"model": label, "card": card, "bs": bs, "ctx": ctx, "step_ms": s["step_ms"],
               "tok_s": bs / s["step_ms"] * 1e3, "read_bytes": s["read_bytes"], "flops": s["flops"]}
        for name, other in (("bf16", bf16), ("fp8", fp8), ("nvfp4", nvfp4)):
            if other is not None and (bs, ctx) in other["steps"]:
                row[f"{name}_step_ms"] = other["steps"][(bs, ctx)]["step_ms"]
                row[f"{name}_read_bytes"] = other["steps"][(bs, ctx)]["read_bytes"]
        rows.append(row)
    return rows


def add_ratios(decode: list[dict], prefill: list[dict], bw: ReadBandwidth, bf16: MatmulPeak, fp8: MatmulPeak) -> None:
    """Each row over its floor at the settled ceilings, with its target and ``meets_target``. FP4 and bf16 rows take
    the bf16 matmul peak as their compute ceiling (the FP4 kernels' dots run on bf16 tensor cores), FP8 rows the FP8
    peak."""
    for r in decode:
        peak = fp8 if "--quantization fp8" in r["model"] or "--fp4-load-as fp8" in r["model"] else bf16
        got = bw.ratios(r["step_ms"], r["read_bytes"], r["flops"], peak.tflops)
        r.update(floor_ms=got["floor_ms"], ratio=got["ratio"], floor_gbs=bw.best_gbs, floor_method=bw.best_method,
                 peak_tflops=peak.tflops, peak_method=peak.method,
                 floor_bound="read" if bw.floor_ms(r["read_bytes"]) >= got["floor_ms"] else "compute")
        for name in ("bf16", "fp8", "nvfp4"):
            if f"{name}_step_ms" in r:
                r[f"vs_{name}"] = r["step_ms"] / r[f"{name}_step_ms"]
                r[f"{name}_floor_ms"] = bw.floor_ms(r[f"{name}_read_bytes"])
        r["target"] = DECODE_TARGETS.get((r["model"].split(" [widen=")[0], r["bs"], r["ctx"]))
        r["meets_target"] = meets_target(r, r["target"])
    for r in prefill:
        r["target"] = PREFILL_TARGET if r["model"].endswith(("nvfp4", DEQUANT_FP8)) else None
        r["meets_target"] = meets_target(r, r["target"])


def prefill_rows(runs: dict[str, dict], card: str) -> list[dict]:
    """tok/s of each model's 8 x 2048 prefill, and its ratio to the FP8 prefill of the same run."""
    tokens = PREFILL[0] * PREFILL[1]
    fp8_tok_s = tokens / runs["fp8"]["prefill_ms"] * 1e3
    rows = []
    for quant, run in runs.items():
        tok_s = tokens / run["prefill_ms"] * 1e3
        rows.append({"model": f"{LLAMA} --quantization {quant}", "card": card, "shape": f"{PREFILL[0]}x{PREFILL[1]}",
                     "ms": run["prefill_ms"], "tok_s": tok_s, "tflops": run["prefill_tflops"], "fp8_tok_s": fp8_tok_s,
                     "vs_fp8": tok_s / fp8_tok_s})
    return rows


@contextlib.contextmanager
def dequant_fp8_prefill():
    """Every dense FP4 GEMM past DEQUANT_ABOVE_ROWS rows on "dequant_fp8" at its default tile, whatever the card's
    table lists (decode rows as the table says): the variant measured before a tune puts it in the table."""
    table_tile = fp4_gemm.gemm_tile

    def tile(fmt, n, k, m, device, variant):
        if m <= DEQUANT_ABOVE_ROWS:
            return table_tile(fmt, n, k, m, device, variant)
        return Fp4GemmTile("dequant_fp8", default_config("dequant_fp8", m, n, k, fp4_layout.GROUP[fmt], sm_count(device)))

    fp4_gemm.gemm_tile = tile
    try:
        yield
    finally:
        fp4_gemm.gemm_tile = table_tile


def run_gpt_oss(cases: list[tuple[int, int]], bw: ReadBandwidth) -> tuple[dict | None, str | None]:
    """gpt-oss-120b as published on this one GPU, or None and why (a card too small for its ~65 GB)."""
    try:
        return run_model(GPT_OSS, "none", cases, bw, None), None
    except torch.OutOfMemoryError as e:
        release_gpu_memory()
        return None, f"out of memory on {torch.cuda.get_device_name(0)}: {str(e).splitlines()[0]}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="no MXFP4 llama3-8b; gpt-oss-120b at bs 1 only")
    p.add_argument("--skip-gpt-oss", action="store_true", help="no gpt-oss-120b rows (a card under ~80 GB)")
    p.add_argument("--only", choices=("gpt-oss",), default=None,
                   help="gpt-oss: the gpt-oss-120b rows alone (probes, the model, its rows against the same-run "
                        "floor), no llama3-8b model")
    p.add_argument("--widenings", nargs="*", default=[], choices=[w for w in fp4_layout.WIDENINGS if w != "byte"],
                   help="NVFP4 llama3-8b decode again with each of these streaming widenings as the default")
    p.add_argument("--result-name", default="fp4_decode",
                   help="benchmarks/results/NAME.json (rows merge into the file's, per model and case)")
    args = p.parse_args(argv)
    if args.only == "gpt-oss" and args.skip_gpt_oss:
        p.error("--only gpt-oss and --skip-gpt-oss leave nothing to run: give one of them")
    if args.only == "gpt-oss" and args.widenings:
        p.error(f"--widenings {' '.join(args.widenings)} are llama3-8b rows, which --only gpt-oss leaves out")
    return args


def probes() -> tuple[str, ReadBandwidth, MatmulPeak, MatmulPeak]:
    """(card, read bandwidth, bf16 and FP8 matmul peaks), each probed before the work."""
    card = torch.cuda.get_device_name(0)
    bw, bf16_peak, fp8_peak = measured_read_bw(), MatmulPeak(), MatmulPeak()
    bf16_peak.observe(BF16_PROBE + ", before the work", matmul_tflops())
    fp8_peak.observe(FP8_PROBE + ", before the work", fp8_matmul_tflops())
    print(f"{card}; probes: {bw.describe()}; matmul peak bf16 {bf16_peak.tflops:.0f}, fp8 {fp8_peak.tflops:.0f} "
          "TFLOP/s", flush=True)
    return card, bw, bf16_peak, fp8_peak


def llama_rows(args: argparse.Namespace, cases: list[tuple[int, int]], card: str, bw: ReadBandwidth,
               bf16_peak: MatmulPeak, fp8_peak: MatmulPeak) -> tuple[list[dict], list[dict], list[dict]]:
    """(decode, prefill, accuracy) rows of the llama3-8b models: bf16, FP8, NVFP4, NVFP4 loaded as FP8, MXFP4 (not
    with --quick) and each of ``args.widenings``. Their prefills' rates go to the matmul peaks."""
    runs = {q: run_model(LLAMA, q, cases, bw, PREFILL) for q in ("none", "fp8", "nvfp4")}
    runs[AS_FP8] = run_model(LLAMA, "nvfp4", cases, bw, PREFILL, fp4_load_as="fp8")
    with dequant_fp8_prefill():  # one short decode case: the run's prefill and reference logits are what it is for
        runs[DEQUANT_FP8] = run_model(LLAMA, "nvfp4", cases[:1], bw, PREFILL)
    # --quick leaves MXFP4 llama3-8b out: the converted model's load takes its place in the time
    mxfp4 = None if args.quick else run_model(LLAMA, "mxfp4", cases, bw, None)
    decode = []
    for quant, run in (("nvfp4", runs["nvfp4"]), (AS_FP8, runs[AS_FP8]), ("mxfp4", mxfp4), ("fp8", runs["fp8"]),
                       ("none", runs["none"])):  # fmt: skip
        if run is None:
            continue
        label = f"{LLAMA} --quantization {quant}"
        decode += decode_rows(label, run, cases, card, runs["none"] if quant != "none" else None,
                              runs["fp8"] if quant in ("nvfp4", "mxfp4", AS_FP8) else None,
                              runs["nvfp4"] if quant == AS_FP8 else None)
    accuracy = [{"model": f"{LLAMA} --quantization {quant}", "card": card, "weights": "random (dummy:, seed 0)",
                 **agreement(runs["none"]["logits"], run["logits"])}
                for quant, run in (("nvfp4", runs["nvfp4"]), (DEQUANT_FP8, runs[DEQUANT_FP8]), (AS_FP8, runs[AS_FP8]),
                                   ("mxfp4", mxfp4), ("fp8", runs["fp8"])) if run is not None]
    prefill = prefill_rows({q: runs[q] for q in ("nvfp4", DEQUANT_FP8, AS_FP8, "fp8", "none")}, card)
    # the bf16 and FP8 prefills are matmuls of this run: one faster than its probe raises that peak (not NVFP4's,
    # whose GEMM may run on the bf16 tensor cores, on the FP8 ones with x quantized, or dequantized through cuBLAS:
    # kernels/fp4_rule.json and fp4_gemm_tiles.json)
    by_quant = {r["model"].removeprefix(f"{LLAMA} --quantization "): r for r in prefill}
    bf16_peak.observe(f"{LLAMA} bf16 prefill", by_quant["none"]["tflops"])
    fp8_peak.observe(f"{LLAMA} fp8 prefill", by_quant["fp8"]["tflops"])
    del runs, mxfp4
    default = fp4_layout.DEFAULT_WIDEN
    for widen in args.widenings:  # the layers' kernels read the default at each call, so at capture
        fp4_layout.DEFAULT_WIDEN = widen
        try:
            run = run_model(LLAMA, "nvfp4", cases, bw, None)
        finally:
            fp4_layout.DEFAULT_WIDEN = default
        rows = decode_rows(f"{LLAMA} --quantization nvfp4 [widen={widen}]", run, cases, card)
        for r in rows:  # beside the same run's bf16 and FP8 steps
            base = next(d for d in decode if d["model"] == f"{LLAMA} --quantization nvfp4" and d["bs"] == r["bs"]
                        and d["ctx"] == r["ctx"])  # fmt: skip
            r.update({key: base[key] for key in ("bf16_step_ms", "bf16_read_bytes", "fp8_step_ms", "fp8_read_bytes")})
        decode += rows
        del run
    return decode, prefill, accuracy


def gpt_oss_rows(cases: list[tuple[int, int]], card: str, bw: ReadBandwidth) -> tuple[list[dict], list[str]]:
    """(decode rows, errors) of gpt-oss-120b as published: no rows and the reason where the card cannot hold it."""
    oss, why = run_gpt_oss(cases, bw)
    if oss is None:
        print(f"no row for {GPT_OSS}: {why}")
        return [], [f"{GPT_OSS}: {why}"]
    return decode_rows(f"{GPT_OSS} (mxfp4 experts as published)", oss, cases, card), []


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    card, bw, bf16_peak, fp8_peak = probes()
    cases = [(1, 512), (64, 2048)]
    decode, prefill, accuracy = ([], [], []) if args.only == "gpt-oss" else \
        llama_rows(args, cases, card, bw, bf16_peak, fp8_peak)
    errors = []
    if not args.skip_gpt_oss:
        rows, errors = gpt_oss_rows([(1, 512)] if args.quick else [(1, 512), (8, 512)], card, bw)
        decode += rows
    release_gpu_memory()

    # ratios last: the best read rate and matmul peaks of the whole run are the denominators
    settle_ceilings(bw, fp8_peak, bf16_peak)
    add_ratios(decode, prefill, bw, bf16_peak, fp8_peak)
    print(f"\n{card}; floor: {bw.describe()}; matmul peak bf16 {bf16_peak.tflops:.0f} ({bf16_peak.method}), "
          f"fp8 {fp8_peak.tflops:.0f} TFLOP/s ({fp8_peak.method})")
    print_table(decode, ["model", "bs", "ctx", "step_ms", "tok_s", "floor_ms", "vs_bf16", "vs_fp8", "vs_nvfp4",
                         "meets_target", "ratio"])
    if prefill:
        print_table(prefill, ["model", "shape", "ms", "tok_s", "vs_fp8", "meets_target"])
    for r in decode:
        if r["model"].startswith(GPT_OSS) and r["bs"] == 1:
            print(reference_line(r, card))
    if accuracy:
        print("\naccuracy against bf16 on the SAME RANDOM WEIGHTS (dummy: models, not a trained checkpoint):")
        print_table(accuracy, ["model", "top1_agreement", "mean_kl", "rows"])
    # --only gpt-oss passes no prefill or accuracy rows: merge_rows keeps the file's
    merge_rows(args.result_name, decode,
               ceilings={"read": bw.summary(), "bf16_matmul_tflops": bf16_peak.tflops,
                         "fp8_matmul_tflops": fp8_peak.tflops, "bf16_matmul": bf16_peak.summary(),
                         "fp8_matmul": fp8_peak.summary()},
               prefill=prefill, accuracy=accuracy, card=card,
               reference={"gpt-oss-120b": {**SGLANG_GPT_OSS_120B, "measured_here": False}},
               errors="; ".join(errors) or None)


def reference_line(row: dict, card: str) -> str:
    """A gpt-oss-120b bs-1 row beside SGLang's published figure, which this run did not measure."""
    ref = SGLANG_GPT_OSS_120B
    return (f"gpt-oss-120b bs 1 ctx {row['ctx']}: {row['tok_s']:.1f} tok/s on one {card} (this run), "
            f"{row['ratio']:.2f} x its floor (target {row['target']}, met: {row['meets_target']}); "
            f"for scale, NOT from this run: {ref['source']}, {ref['tok_s']} tok/s at bs {ref['bs']} on {ref['gpus']}")


if __name__ == "__main__":
    main()
