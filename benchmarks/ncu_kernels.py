"""The decode step's FP8 projections and attention under Nsight Compute, beside bare reads of the same bytes.

Timing says how far a kernel is from its floor; the hardware counters say why. Each case below is one launch of
one kernel as the engine runs it at that row count (the routing table's tiles, kernels/fp8_rule.json, per-channel
scales as ``--quantization fp8`` stores dense projections; decode attention with the engine's launch shape and
split count over a bf16 paged cache), and each projection's weight is also read bare by the read probe's kernel
(kernels/stream_read.py on one program a block): what the same bytes cost with nothing computed. ncu replays each
launch with the caches flushed first, so every weight comes from device memory, as it does in a decode step; its
``Duration`` is the kernel alone, without the launch.

Per case the results keep the duration, DRAM throughput (% of peak and GB/s), the grid and its waves, registers,
shared memory, theoretical and achieved occupancy, and the three most sampled warp stall reasons as shares of all
samples (None where ncu sampled none).

Run (on the GPU; ncu from the CUDA toolkit, found on PATH or under /usr/local/cuda/bin):
    python3 -m benchmarks.ncu_kernels                 # profiles itself under ncu, then writes the results
    python3 -m benchmarks.ncu_kernels --cases         # only launches the cases (what ncu runs)
(writes benchmarks/results/ncu_kernels.json)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import print_table, write_result

LLAMA = ["llama3-8b qkv", "llama3-8b o_proj", "llama3-8b gate_up", "llama3-8b down"]
ROWS = (1, 64)
# decode attention cases: (label, q heads, kv heads, batch, context)
ATTENTION = (("llama3-8b", 32, 8, 64, 2048), ("qwen3-30b-a3b", 32, 4, 64, 2048), ("llama3-8b", 32, 8, 1, 512))
KERNELS = "regex:^(_fp8_gemv_kernel|_stream_read_kernel|_decode_split_kernel)$"
METRICS = {  # details-page metric name -> result key
    "Duration": "duration_us", "DRAM Throughput": "dram_pct", "Grid Size": "grid", "Waves Per SM": "waves",
    "Registers Per Thread": "registers", "Dynamic Shared Memory Per Block": "smem_bytes",
    "Theoretical Occupancy": "theoretical_occupancy_pct", "Achieved Occupancy": "achieved_occupancy_pct",
    "Block Limit Registers": "blocks_by_registers", "Block Limit Shared Mem": "blocks_by_smem",
}
STALL = "smsp__pcsamp_warps_issue_stalled_"
# ncu's units -> the results' (microseconds, bytes, megabytes)
SCALE = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "byte/block": 1.0, "Kbyte/block": 1e3, "Mbyte/block": 1e6,
         "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}


def cases() -> list[tuple[str, object]]:
    """(label, a function making one launch of the case's kernel), in launch order."""
    from benchmarks.fp8_route import SHAPES, bare_read, prologue
    from graphserve.kernels.common import sm_count
    from graphserve.kernels.decode_attention import counters_numel, decode_attention, workspace_numel
    from graphserve.kernels.fp8_config import choose_route
    from graphserve.kernels.fp8_gemv import fp8_gemv, fp8_gemv_a8, fp8_norm_gemv, fp8_silu_mul_gemv
    from graphserve.kernels.fp8_quant import per_token_group_quant, quantize_weight_channels

    dev = torch.device("cuda")
    sms = sm_count(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for name in LLAMA:
        n, k = SHAPES[name]
        wq, ws = quantize_weight_channels(torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02)
        ws = ws.view(n, 1)
        for m in ROWS:
            cfg = choose_route(m, n, k, 1, k, False, dev, sms).config
            if cfg is None:
                continue  # a row count the table routes to cuBLAS: not this harness's kernels
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            label = f"{name} m{m}"
            kind = prologue(name, m)  # what the layer fuses into the kernel's loads at m rows
            if cfg.a8:  # x quantized per token by the launch before (layers/quant/fp8.py)
                fn = partial(fp8_gemv_a8, *per_token_group_quant(x, k), wq, ws, 1, k, torch.bfloat16, config=cfg)
            elif kind == "norm":  # the residual add + RMSNorm in the loads
                norm = torch.randn(k, device=dev, dtype=torch.bfloat16, generator=gen)
                fn = partial(fp8_norm_gemv, x, norm, 1e-6, wq, ws, 1, k, residual=torch.randn_like(x), config=cfg)
                label += " +norm"
            elif kind == "silu":  # SiLU·mul in the loads
                gate_up = torch.randn(m, 2 * k, device=dev, dtype=torch.bfloat16, generator=gen)
                fn = partial(fp8_silu_mul_gemv, gate_up, wq, ws, 1, k, config=cfg)
                label += " +silu"
            else:
                fn = partial(fp8_gemv, x, wq, ws, 1, k, config=cfg)
            out.append((f"{label} {cfg.block_n}x{cfg.block_k} s{cfg.num_stages} split{cfg.split_k}", fn))
        out.append((f"{name} bare read", bare_read(wq, sms)))
    for model, hq, hkv, bs, ctx in ATTENTION:
        page, d = 16, 128
        blocks = bs * ctx // page
        kv = torch.randn(2, blocks, page, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        tables = torch.arange(blocks, device=dev, dtype=torch.int32).view(bs, ctx // page)
        lens = torch.full((bs,), ctx, device=dev, dtype=torch.int32)
        q = torch.randn(bs, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        work = torch.empty(workspace_numel(hq, hkv, d, sms), dtype=torch.float32, device=dev)
        counters = torch.zeros(max(1, counters_numel(hkv, sms)), dtype=torch.int32, device=dev)
        out.append((f"attention {model} bs{bs} ctx{ctx}",
                    partial(decode_attention, q, kv, tables, lens, d**-0.5, workspace=work, counters=counters)))
    return out


def launch_cases() -> None:
    """Compile and warm every case, then launch each once between cudaProfilerStart and Stop."""
    todo = cases()
    for _, fn in todo:
        fn()
    torch.cuda.synchronize()
    if os.environ.get("NCU_KERNELS_LABELS"):  # where the profiling parent reads which launch is which
        Path(os.environ["NCU_KERNELS_LABELS"]).write_text(json.dumps([label for label, _ in todo]))
    torch.cuda.cudart().cudaProfilerStart()
    for _, fn in todo:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def number(text: str) -> float:
    return float(text.replace(",", "")) if text not in ("", "n/a") else float("nan")


def read_report(details: str, raw: str, labels: list[str]) -> list[dict]:
    """One row per profiled launch from ncu's details and raw CSV pages, labelled in launch order."""
    rows: dict[str, dict] = {}
    for r in csv.DictReader(Path(details).read_text().splitlines()):
        row = rows.setdefault(r["ID"], {"kernel": r["Kernel Name"]})
        key = METRICS.get(r["Metric Name"])
        if key and key not in row:
            row[key] = number(r["Metric Value"]) * SCALE.get(r["Metric Unit"], 1.0)
    lines = list(csv.reader(Path(raw).read_text().splitlines()))
    header, body = lines[0], lines[2:]  # the second line holds the units
    stalls = [i for i, h in enumerate(header) if h.startswith(STALL) and not h.endswith("_not_issued")]
    for line in body:
        row = rows.get(line[header.index("ID")])
        if row is None:
            continue
        counts = {header[i][len(STALL):]: number(line[i]) for i in stalls}
        total = sum(counts.values())
        # no samples (or a counter ncu left n/a, NaN): no shares to give, rather than shares of 0.0
        row["stalls"] = ({k: round(v / total, 3) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:3]}
                         if total > 0 else None)
        if "dram__bytes_read.sum" in header:
            col = header.index("dram__bytes_read.sum")
            row["dram_read_mb"] = number(line[col]) * SCALE.get(lines[1][col], 1.0)
    ordered = [rows[i] for i in sorted(rows, key=int)]
    if len(ordered) != len(labels):
        raise ValueError(f"ncu profiled {len(ordered)} launches for {len(labels)} cases: the labels would not line up")
    for label, row in zip(labels, ordered):
        row["case"] = label
        if row.get("dram_read_mb") and row.get("duration_us"):
            row["dram_gbps"] = row["dram_read_mb"] / row["duration_us"] * 1e3
    return ordered


def find_ncu() -> str:
    found = shutil.which("ncu") or next((str(p) for p in (Path("/usr/local/cuda/bin/ncu"),) if p.exists()), None)
    if found is None:
        raise SystemExit("ncu (Nsight Compute) was not found on PATH or in /usr/local/cuda/bin")
    return found


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", action="store_true", help="only launch the cases (the process ncu profiles)")
    p.add_argument("--result-name", default="ncu_kernels")
    args = p.parse_args()
    if args.cases:
        launch_cases()
        return
    ncu = find_ncu()
    with tempfile.TemporaryDirectory() as tmp:
        rep, labels = Path(tmp, "prof"), Path(tmp, "labels.json")
        env = {**os.environ, "NCU_KERNELS_LABELS": str(labels)}
        subprocess.run([ncu, "--profile-from-start", "off", "--clock-control", "none", "--set", "full",
                        "--import-source", "no", "--kernel-name", KERNELS, "-f", "-o", str(rep),
                        sys.executable, "-m", "benchmarks.ncu_kernels", "--cases"], env=env, check=True)
        pages = {}
        for page in ("details", "raw"):
            text = subprocess.run([ncu, "--import", f"{rep}.ncu-rep", "--csv", "--page", page], capture_output=True,
                                  text=True, check=True).stdout
            pages[page] = Path(tmp, f"{page}.csv")
            pages[page].write_text(text)
        rows = read_report(str(pages["details"]), str(pages["raw"]), json.loads(labels.read_text()))
    print_table(rows, ["case", "duration_us", "dram_pct", "dram_gbps", "grid", "waves", "registers", "smem_bytes",
                       "theoretical_occupancy_pct", "achieved_occupancy_pct", "stalls"])
    write_result(args.result_name, {"rows": rows})


if __name__ == "__main__":
    main()
