"""FP8 weights on the decode and prefill paths, against their floors and against bf16 in the same run.

- decode: ``dummy:llama3-8b --quantization fp8`` (per-channel scales on dense projections, x per token; routed
  experts in 128x128 blocks) CUDA-graph steps at
  (bs 1, ctx 512), (bs 64, ctx 2048), (bs 256, ctx 2048); the floor is the bytes the step must read
  (ModelDescription.decode_read_bytes: FP8 projections plus their scales, bf16 embedding rows and
  head, the KV in context) over the best read bandwidth of this run (benchmarks.roofline probes, before and after
  the work, the steps themselves and the GEMMs below), or FLOPs over the FP8 matmul peak where that is larger. The bf16
  model with the same seed runs the same steps, and so does ``--quantization fp8-block`` (128x128 block
  scales throughout, as the shipped FP8 checkpoints store them) at batch 1 and 64: the measurement that
  chose ``fp8``'s layout.
- prefill 8x2048 with FP8 weights: FLOPs computed (as benchmarks/prefill.py counts them) over the
  FP8 matmul peak: the best of ``torch._scaled_mm`` on 8192^3 (per-tensor scales, bf16 out) before and after the
  work and of every FP8 matmul rate the run reached (the GEMMs below, the prefill itself; ``MatmulPeak``); the bf16
  prefill likewise over the bf16 peak.
- GEMMs: per Llama-3-8B projection and row count (1 to 16384), per-channel scales, each path as the FP8 layer
  runs it (the streaming kernel; per-token activation quantization + ``torch._scaled_mm``'s rowwise GEMM) and
  bf16 cuBLAS, graph-timed on cold weights
  (benchmarks/fp8_route.py's measurement; that module also sweeps tiles and writes the routing table).
- accuracy: top-1 agreement and mean KL(bf16 || fp8) of the two models' logits over 4x256 tokens.
- the same decode steps with ``--kv-cache-dtype fp8_e4m3`` as well (its floor counts one byte per
  cached element), with its own accuracy row.

Decode rows go to benchmarks/results/fp8_decode.json as {"model","bs","ctx","step_ms","floor_ms",
"ratio","bf16_step_ms",...}; the other tables ride along in the same file. Every row names the run that measured it
(``measured_at.run_id``) and the denominators it was divided by (``floor_gbs``, ``floor_method``, the peak and what
reached it); the file keeps each run's ceilings (``ceilings``, one entry a run: common.merge_rows). A row of the
issue's table carries its target and ``meets_target``, decided on the unrounded numbers (``DECODE_TARGETS``,
``PREFILL_TARGET``); other rows None.

Run: python3 -m benchmarks.fp8 [--quick] [--models dummy:llama3-8b dummy:qwen3-30b-a3b] [--result-name fp8_decode]
(after python3 -m benchmarks.fp8_route, which writes the routing table the FP8 layers read; without
it they take kernels/fp8_config.py's defaults, and the run says so)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from benchmarks.common import cuda_time_ms, merge_rows, print_table
from benchmarks.decode import make_batch, step_cost
from benchmarks.decode_setup import captured_graphs, release_gpu_memory
from benchmarks.fp8_route import COLS as GEMM_COLS
from benchmarks.fp8_route import SHAPES, measure, observe_rows, stream_ratios
from benchmarks.moe import experts_touched, moe_layers
from benchmarks.roofline import ReadBandwidth, matmul_tflops, measured_read_bw
from graphserve.config import EngineConfig
from graphserve.errors import ConfigError, ModelLoadError
from graphserve.kernels.argmax import greedy_argmax
from graphserve.kernels.common import sm_count
from graphserve.kernels.fp8_config import rule_for
from graphserve.kernels.fp8_gemm import blockwise_scaled_mm_available
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.layers.forward_batch import contiguous_batch
from graphserve.models.loader import load_model

# the targets, for rows of ``--quantization fp8`` (per-channel weights, bf16 KV): (model, bs, ctx) -> bounds on
# the row's own fields (``_max``: at most, ``_min``: at least)
DECODE_TARGETS = {("llama3-8b", 1, 512): {"ratio_max": 1.3, "vs_bf16_max": 0.6},
                  ("llama3-8b", 64, 2048): {"ratio_max": 1.3}, ("llama3-8b", 256, 2048): {"ratio_max": 1.3},
                  ("qwen3-30b-a3b", 64, 2048): {"ratio_max": 1.35}}
PREFILL_TARGET = {"ratio_min": 0.45}  # the FP8 prefill's TFLOP/s over the FP8 matmul peak of the same run
# the matmul probes, each run before and after the work (``MatmulPeak``'s labels)
FP8_PROBE = "torch._scaled_mm 8192^3 (per-tensor scales)"
BF16_PROBE = "bf16 matmul 8192^3"
REFERENCE_SEQS, REFERENCE_LEN = 4, 256  # the sequences whose logits the accuracy rows compare


def decode_target(row: dict) -> dict | None:
    """The issue's bounds for a decode row, or None where it sets none (other variants, models and cases)."""
    name, _, variant = row["model"].partition(" ")
    if variant != "--quantization fp8":
        return None
    return DECODE_TARGETS.get((name.split(":")[-1], row["bs"], row["ctx"]))


def meets_target(row: dict, target: dict | None) -> bool | None:
    """Whether the row's unrounded fields keep within ``target`` (``decode_target``, ``PREFILL_TARGET``); None
    without one."""
    if target is None:
        return None
    return all(row[key[:-4]] <= bound if key.endswith("_max") else row[key[:-4]] >= bound
               for key, bound in target.items())


@dataclass
class MatmulPeak:
    """A run's matmul peak (TFLOP/s), the best rate it measured: its probe before and after the work and every
    rate its own matmuls reached (``observe``). A matmul that beats the probe proves the probe was not the peak."""

    rates: dict[str, float] = field(default_factory=dict)

    def observe(self, label: str, tflops: float | None) -> None:
        if tflops:
            self.rates[label] = max(self.rates.get(label, 0.0), tflops)

    @property
    def tflops(self) -> float:
        return max(self.rates.values())

    @property
    def method(self) -> str:
        return max(self.rates, key=self.rates.get)

    def summary(self) -> dict:
        return {"tflops": self.tflops, "method": self.method, "rates": dict(self.rates)}


def observe_gemm_peaks(rows: list[dict], fp8: MatmulPeak, bf16: MatmulPeak) -> None:
    """The GEMM rows' rates (2 m n k FLOPs a call) offered to the peaks: the FP8 paths' to ``fp8``, cuBLAS bf16's to
    ``bf16``."""
    for r in rows:
        flops = 2 * r["m"] * r["n"] * r["k"]
        for path, peak in (("stream", fp8), ("w8a8", fp8), ("scaled_mm", fp8), ("bf16", bf16)):
            if r.get(f"{path}_us"):
                peak.observe(f"{r['shape']} m={r['m']} {path}", flops / r[f"{path}_us"] / 1e6)


def fp8_matmul_tflops(n: int = 8192) -> float:
    """``torch._scaled_mm`` on n^3 with per-tensor scales: the FP8 tensor-core rate prefill is held to."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = cuda_time_ms(lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                      warmup=5, iters=20)
    return 2 * n**3 / (ms / 1e3) / 1e12


def gemm_rows(batches: list[int], bw: ReadBandwidth, fp8: MatmulPeak, bf16: MatmulPeak) -> list[dict]:
    """Per Llama-3-8B projection and row count, with per-channel scales as ``--quantization fp8`` stores dense
    projections: the streaming kernel (<= 64 rows, default tiles), the W8A8 path and bf16 cuBLAS, graph-timed
    on cold weights (benchmarks/fp8_route.py, which also sweeps the stream tiles and writes the routing table).
    Their read rates go to ``bw`` and their matmul rates to the peaks: a GEMM faster than a probe raises it."""
    sms = sm_count(torch.device("cuda"))
    scaled_mm_ok = blockwise_scaled_mm_available(torch.device("cuda"))
    rows = [r for name in SHAPES if name.startswith("llama3-8b")
            for r in measure(name, batches, False, scaled_mm_ok, sms, channel=True)]
    observe_rows(bw, rows)
    observe_gemm_peaks(rows, fp8, bf16)
    return rows


def prefill_tflops(model, info, kv_caches, n: int, length: int) -> tuple[float, float]:
    """(ms, TFLOP/s computed) of one prefill of ``n`` sequences of ``length`` tokens."""
    batch = contiguous_batch([length] * n, [length] * n, kv_caches, TritonAttentionBackend(), vocab_size=1000)
    head = model.lm_head.weight
    skip = {id(head), *(id(p) for p in model.model.embed_tokens.parameters())}
    layer_params = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)

    def run():
        hidden = model.forward(batch.input_ids, batch.positions, batch)
        return model.compute_logits(hidden[batch.logits_indices])

    ms = cuda_time_ms(run, warmup=2, iters=5)
    tokens = n * length
    flops = (2 * layer_params * tokens + 2 * head.numel() * n
             + n * 4 * (length * (length + 1) // 2) * info.num_heads * info.head_dim * info.num_layers)
    return ms, flops / (ms / 1e3) / 1e12


def reference_logits(model, kv_caches, seqs: int = REFERENCE_SEQS, length: int = REFERENCE_LEN) -> torch.Tensor:
    torch.manual_seed(0)  # contiguous_batch draws the token ids from torch's global generator
    batch = contiguous_batch([length] * seqs, [length] * seqs, kv_caches, TritonAttentionBackend(), vocab_size=1000)
    return model.compute_logits(model.forward(batch.input_ids, batch.positions, batch)).float()


def run_model(name: str, quantization: str, cases: list[tuple[int, int]], bw: ReadBandwidth,
              prefill: tuple[int, int] | None, kv_cache_dtype: str = "auto", fp4_load_as: str = "none") -> dict:
    device = torch.device("cuda")
    max_ctx = max(c for _, c in cases)
    cfg = EngineConfig(model=name, device="cuda", quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                       max_model_len=max(max_ctx, 2048) + 64, fp4_load_as=fp4_load_as)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    routed = moe_layers(model)  # the model's own router; [] for a dense model
    bsz = cfg.block_size
    sizes = sorted({bs for bs, _ in cases})
    # the KV slots of the widest work: a decode case, the prefill, or the reference logits' sequences
    tokens = max(max(bs * (c + 2 * bsz) for bs, c in cases), prefill[0] * prefill[1] if prefill else 0,
                 REFERENCE_SEQS * (REFERENCE_LEN + bsz))
    kv_caches = info.kv.allocate(tokens // bsz + 2, bsz, device, fill="random")
    backend = TritonAttentionBackend()
    out = {"steps": {}}
    with torch.inference_mode():
        out["logits"] = reference_logits(model, kv_caches)
        graphs = captured_graphs(model, backend, kv_caches, sizes, max_ctx, cfg, device)
        for bs, ctx in cases:
            batch = make_batch(bs, ctx, kv_caches, backend)
            ms = cuda_time_ms(lambda g=graphs, b=batch: greedy_argmax(g.replay(b)), warmup=3, iters=20)
            # a MoE step reads the experts its router chose: the counts of the last replay, this batch's
            read, flops = step_cost(info, bs, ctx, experts_touched(routed))
            bw.observe(f"{name} {quantization}{_as(fp4_load_as)} decode bs={bs} ctx={ctx}", read, ms)
            out["steps"][(bs, ctx)] = {"step_ms": ms, "read_bytes": read, "flops": flops}
            print(f"{name} quantization={quantization}{_as(fp4_load_as)} kv={kv_cache_dtype} bs={bs} ctx={ctx}: {ms:.3f} ms, "
                  f"{read / 1e9:.2f} GB to read")
        del graphs
        if prefill:
            out["prefill_ms"], out["prefill_tflops"] = prefill_tflops(model, info, kv_caches, *prefill)
    del model, loaded, kv_caches
    release_gpu_memory()
    return out


def _as(fp4_load_as: str) -> str:
    return "" if fp4_load_as == "none" else f" fp4-load-as={fp4_load_as}"


def agreement(ref: torch.Tensor, test: torch.Tensor) -> dict:
    top1 = (ref.argmax(-1) == test.argmax(-1)).float().mean().item()
    kl = F.kl_div(test.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return {"top1_agreement": top1, "mean_kl": kl.mean().item(), "rows": ref.shape[0]}


def settle_ceilings(bw: ReadBandwidth, fp8: MatmulPeak, bf16: MatmulPeak, matmul_probes=None) -> None:
    """The run's ceilings once its work is done, before any ratio: the read probes again (each method's best of both
    rounds, beside the rates the work reached) and the matmul probes again (``matmul_probes``: a function giving the
    FP8 and bf16 rates, by default ``fp8_matmul_tflops`` and ``roofline.matmul_tflops``): a GPU still clocking up at
    the first probes would otherwise leave every floor of the run generous."""
    bw.probe_again()
    fp8_now, bf16_now = matmul_probes() if matmul_probes else (fp8_matmul_tflops(), matmul_tflops())
    fp8.observe(FP8_PROBE + ", after the work", fp8_now)
    bf16.observe(BF16_PROBE + ", after the work", bf16_now)


def add_ratios(decode: list[dict], prefill: list[dict], bw: ReadBandwidth, fp8: MatmulPeak, bf16: MatmulPeak) -> None:
    """Each row over its floor at the settled ceilings (``settle_ceilings``), naming the floor (rate and what reached
    it, and for prefill the peak), with the issue's target and ``meets_target`` where it sets one."""
    for r in decode:
        got = bw.ratios(r["step_ms"], r["read_bytes"], r["flops"], fp8.tflops)
        r.update(floor_ms=got["floor_ms"], ratio=got["ratio"], vs_bf16=r["step_ms"] / r["bf16_step_ms"],
                 bf16_floor_ms=bw.floor_ms(r["bf16_read_bytes"]), floor_gbs=bw.best_gbs, floor_method=bw.best_method,
                 fp8_peak_tflops=fp8.tflops, fp8_peak_method=fp8.method,
                 floor_bound="read" if bw.floor_ms(r["read_bytes"]) >= got["floor_ms"] else "compute")
        r["target"] = decode_target(r)
        r["meets_target"] = meets_target(r, r["target"])
    for r in prefill:
        r.update(fp8_peak_tflops=fp8.tflops, fp8_peak_method=fp8.method, ratio=r["fp8_tflops"] / fp8.tflops,
                 bf16_peak_tflops=bf16.tflops, bf16_peak_method=bf16.method, bf16_ratio=r["bf16_tflops"] / bf16.tflops,
                 target=PREFILL_TARGET)
        r["meets_target"] = meets_target(r, PREFILL_TARGET)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dummy:llama3-8b"])
    p.add_argument("--quick", action="store_true", help="bs 1 ctx 512 and bs 64 ctx 2048 only; no bs 256")
    p.add_argument("--result-name", default="fp8_decode",
                   help="benchmarks/results/NAME.json (rows merge into the file's, per model and case)")
    args = p.parse_args()
    cases = [(1, 512), (64, 2048)] + ([] if args.quick else [(256, 2048)])
    bw, bf16_peak, fp8_peak = measured_read_bw(), MatmulPeak(), MatmulPeak()
    bf16_peak.observe(BF16_PROBE + ", before the work", matmul_tflops())
    fp8_peak.observe(FP8_PROBE + ", before the work", fp8_matmul_tflops())
    print(f"probes: {bw.describe()}; matmul peak bf16 {bf16_peak.tflops:.0f}, fp8 {fp8_peak.tflops:.0f} TFLOP/s")
    rule = rule_for(torch.device("cuda"))
    print(f"fp8 routing: {'table measured on ' + rule.device if rule.shapes else 'code defaults (no table for this card)'}")
    small = gemm_rows([1, 2, 4, 8, 16, 32, 64, 256, 2048, 16384], bw, fp8_peak, bf16_peak)
    print_table(small, GEMM_COLS[:7])

    decode, prefill, accuracy = [], [], []
    for name in args.models:
        dense = "llama" in name
        bf16 = run_model(name, "none", cases, bw, (8, 2048) if dense else None)
        fp8 = run_model(name, "fp8", cases, bw, (8, 2048) if dense else None)
        runs = [(f"{name} --quantization fp8", fp8, cases)]
        # and with the KV cache in fp8 too: the reads that dominate at long context halve as well; and the other
        # layout, at the batches where it was closest. A model the setting does not fit is refused at load
        # (128x128 blocks need projections of whole blocks) and its row is left out, saying why.
        block_cases = [c for c in cases if c[0] in (1, 64)]
        for label, quantization, kv, measured in (
                (f"{name} --quantization fp8 --kv-cache-dtype fp8_e4m3", "fp8", "fp8_e4m3", cases),
                (f"{name} --quantization fp8-block", "fp8-block", "auto", block_cases)):  # fmt: skip
            try:
                runs.append((label, run_model(name, quantization, measured, bw, None, kv_cache_dtype=kv), measured))
            except (ConfigError, ModelLoadError) as e:
                print(f"no row for {label}: {e}")
                release_gpu_memory()  # what the refused load had allocated (run_model releases its own)
        for label, run, measured in runs:
            accuracy.append({"model": label, **agreement(bf16["logits"], run["logits"])})
            for bs, ctx in measured:
                s, b = run["steps"][(bs, ctx)], bf16["steps"][(bs, ctx)]
                decode.append({"model": label, "bs": bs, "ctx": ctx, "step_ms": s["step_ms"],
                               "read_bytes": s["read_bytes"], "flops": s["flops"], "bf16_step_ms": b["step_ms"],
                               "bf16_read_bytes": b["read_bytes"]})
        if dense:
            # the prefills are matmuls of this run too: one faster than the probe raises its peak
            fp8_peak.observe(f"{name} fp8 prefill 8x2048", fp8["prefill_tflops"])
            bf16_peak.observe(f"{name} bf16 prefill 8x2048", bf16["prefill_tflops"])
            prefill.append({"model": name, "shape": "8x2048", "fp8_ms": fp8["prefill_ms"], "bf16_ms": bf16["prefill_ms"],
                            "fp8_tflops": fp8["prefill_tflops"], "bf16_tflops": bf16["prefill_tflops"]})
    # ratios last: the best read rate and matmul peaks of the whole run (both rounds of probes, every step, GEMM
    # and prefill) are the denominators
    settle_ceilings(bw, fp8_peak, bf16_peak)
    add_ratios(decode, prefill, bw, fp8_peak, bf16_peak)
    stream_ratios(small, bw)
    print(f"\nfloor: {bw.describe()}; matmul peak bf16 {bf16_peak.tflops:.0f} ({bf16_peak.method}), "
          f"fp8 {fp8_peak.tflops:.0f} TFLOP/s ({fp8_peak.method})")
    print_table(decode, ["model", "bs", "ctx", "step_ms", "floor_ms", "ratio", "bf16_step_ms", "vs_bf16",
                         "meets_target"])
    print_table(prefill, ["model", "shape", "fp8_ms", "bf16_ms", "fp8_tflops", "fp8_peak_tflops", "ratio",
                          "meets_target"])
    print_table(accuracy, ["model", "top1_agreement", "mean_kl", "rows"])
    # the rows of models this run did not measure (benchmarks.moe_fp8's) stay, each naming its own run, and the
    # file keeps the ceilings of every run a row of it came from
    merge_rows(args.result_name, decode,
               ceilings={"read": bw.summary(), "bf16_matmul_tflops": bf16_peak.tflops,
                         "fp8_matmul_tflops": fp8_peak.tflops, "bf16_matmul": bf16_peak.summary(),
                         "fp8_matmul": fp8_peak.summary()},
               prefill=prefill, accuracy=accuracy, small_batch=small)


if __name__ == "__main__":
    main()
