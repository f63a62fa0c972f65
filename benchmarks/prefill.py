"""Prefill throughput and fraction of the measured bf16 matmul peak.

FLOPs counted are the FLOPs computed: 2 · (the decoder layers' linear weights) per prompt token, the
lm_head (2 · vocab · hidden) only for the rows whose logits are computed (one per sequence, as the
engine samples only each sequence's last token), plus causal attention, 2 · 2 · T·(T+1)/2 · heads ·
head_dim per layer for each sequence (QK^T and PV). Ceiling from benchmarks.roofline in the same run.

Run: python3 -m benchmarks.prefill [--model dummy:llama3-8b] [--shapes 1x8192 8x2048]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.roofline import matmul_tflops
from graphserve.config import EngineConfig
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.layers.forward_batch import contiguous_batch
from graphserve.models.loader import load_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:llama3-8b")
    p.add_argument("--shapes", nargs="+", default=["1x8192", "8x2048"])
    args = p.parse_args()
    peak = matmul_tflops()
    device = torch.device("cuda")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    max_len = max(L for _, L in shapes)
    cfg = EngineConfig(model=args.model, device="cuda", max_model_len=max_len)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    tokens = max(n * L for n, L in shapes)
    num_blocks = tokens // cfg.block_size + 2 * len(shapes) + 2
    kv_caches = info.kv.allocate(num_blocks, cfg.block_size, device)
    backend = TritonAttentionBackend()
    head = model.lm_head.weight  # tied or not, it is one [vocab, hidden] matmul per logits row
    skip = {id(head), *(id(p) for p in model.model.embed_tokens.parameters())}
    layer_params = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)
    rows = []
    with torch.inference_mode():
        for n, L in shapes:
            batch = contiguous_batch([L] * n, [L] * n, kv_caches, backend, vocab_size=1000)

            def run(batch=batch):
                hidden = model.forward(batch.input_ids, batch.positions, batch)
                return model.compute_logits(hidden[batch.logits_indices])

            ms = cuda_time_ms(run, warmup=2, iters=5)
            T = n * L
            logit_rows = batch.logits_indices.numel()
            flops = (2 * layer_params * T + 2 * head.numel() * logit_rows
                     + n * 4 * (L * (L + 1) // 2) * info.num_heads * info.head_dim * info.num_layers)
            tflops = flops / (ms / 1e3) / 1e12
            rows.append({"model": args.model, "shape": f"{n}x{L}", "logit_rows": logit_rows, "ms": ms,
                         "tok_s": T / (ms / 1e3),
                         "tflops": tflops, "peak_tflops": peak, "ratio": tflops / peak})
    print_table(rows, ["model", "shape", "ms", "tok_s", "tflops", "peak_tflops", "ratio"])
    write_result("prefill", {"ceilings": {"matmul_tflops": peak}, "rows": rows})


if __name__ == "__main__":
    main()
