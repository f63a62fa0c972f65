"""Tensor parallelism on a multi-GPU host: decode steps at tp 1 and tp 2 with their communication share.

Also where the one-shot all-reduce should hand over to NCCL.

Two parts, each run in fresh processes (one per rank, NCCL env set before the group forms):

- ``step``: ``dummy:llama3-8b`` (and ``dummy:qwen3-30b-a3b`` at tp 2 / ep 2 when that preset exists) decode
  steps at batch 1 and 64 over 512 tokens of context each, as the engine replays them (CUDA graph of the
  forward and the logits). Every tp > 1 step is timed twice: as captured, and recaptured with the
  collectives left out (``skip_communication``: same kernels, no communication). ``comm_ms`` is the
  difference — what communication costs the step, launch gaps and waits included — and ``comm_share`` its
  share; ``vs_tp1`` is the step over the tp-1 step of the same batch (target at batch 1: <= 0.62).
  Variants: one-shot all-reduce for small messages + NCCL (the engine's default), NCCL alone, and NCCL
  with ``NCCL_P2P_DISABLE=1`` (a stand-in for GPUs that talk over PCIe).
- ``allreduce``: one all-reduce of 8 KiB .. 8 MiB bf16, NCCL and the one-shot kernel, eager and inside a
  CUDA graph (one call's share of a graph of 20); the last line is the largest size at which the one-shot
  kernel beats NCCL in a graph: the value for ``CUSTOM_ALL_REDUCE_MAX_BYTES``
  (graphserve/distributed/custom_all_reduce.py).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1). Captured graphs are
released before the process group is destroyed (the other order hangs at exit).

Run on >= 2 GPUs: python3 -m benchmarks.tp [--quick] [--parts dense moe allreduce]
(writes benchmarks/results/tp.json, or tp_<parts>.json for a subset)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result

CTX = 512
STEP_COLS = ["model", "variant", "tp", "ep", "batch", "step_ms", "compute_ms", "comm_ms", "comm_share", "comm_ops",
             "comm_KiB", "vs_tp1"]
AR_COLS = ["variant", "KiB", "nccl_eager_us", "nccl_graph_us", "custom_eager_us", "custom_graph_us",
           "custom/nccl_graph"]


def _env(p2p: bool) -> dict[str, str]:
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    if not p2p:
        env["NCCL_P2P_DISABLE"] = "1"
    return env


def _barrier() -> None:
    from graphserve.distributed.state import get_parallel

    ps = get_parallel()
    if ps.distributed:
        torch.distributed.barrier(group=ps.cpu_group)
        torch.cuda.synchronize()


# ---- one rank ------------------------------------------------------------------------------------------

def _step_rows(s: dict, device: torch.device, iters: int) -> list[dict]:
    from graphserve.config import EngineConfig
    from graphserve.distributed.comm import skip_communication
    from graphserve.distributed.custom_all_reduce import maybe_enable_custom_all_reduce
    from graphserve.distributed.state import get_parallel
    from graphserve.engine.rank_worker import release_runner
    from graphserve.engine.runner import ModelRunner
    from graphserve.layers.forward_batch import contiguous_batch
    from graphserve.models.loader import load_model
    from graphserve.models.parallel_check import model_dtype

    config = EngineConfig(model=s["model"], dtype="bfloat16", tp=s["tp"], ep=s["ep"], max_model_len=CTX + 64,
                          disable_custom_all_reduce=not s["custom"], device=str(device))
    maybe_enable_custom_all_reduce(get_parallel(), config, device, model_dtype(config))
    loaded = load_model(config, device)
    batches = s["batches"]
    runner = ModelRunner(config, loaded, max(batches) * -(-CTX // config.block_size) + 2, device)
    inputs = {bs: contiguous_batch([1] * bs, [CTX] * bs, runner.kv_caches, runner.attn_backend,
                                   loaded.info.vocab_size) for bs in batches}
    # same input ids on every rank: the vocab-parallel embedding must see one batch
    if get_parallel().distributed:
        for batch in inputs.values():
            torch.distributed.broadcast(batch.input_ids, 0)

    def timed() -> dict[int, float]:
        out = {}
        for bs, batch in inputs.items():
            _barrier()
            out[bs] = cuda_time_ms(lambda b=batch: runner.forward_logits(b), warmup=5, iters=iters)
        return out

    with torch.inference_mode():
        runner.capture_graphs(batches, config.max_model_len)
        comm = dict(runner.graph_comm)
        full = timed()
        compute = full
        if get_parallel().distributed:
            with skip_communication():
                runner.capture_graphs(batches, config.max_model_len)
            compute = timed()
    release_runner(runner)
    return [{"model": s["model"].removeprefix("dummy:"), "variant": s["variant"], "tp": s["tp"], "ep": s["ep"],
             "batch": bs, "step_ms": full[bs], "compute_ms": compute[bs], "comm_ms": full[bs] - compute[bs],
             "comm_share": (full[bs] - compute[bs]) / full[bs], "comm_ops": comm.get(bs, (0, 0))[0],
             "comm_KiB": comm.get(bs, (0, 0))[1] / 1024} for bs in batches]


def _allreduce_rows(s: dict, device: torch.device, sizes_kib: list[int]) -> list[dict]:
    import torch.distributed as dist

    from benchmarks.kernels import graph_time_ms
    from graphserve.distributed.custom_all_reduce import SymmMemAllReduce
    from graphserve.distributed.state import get_parallel

    group = get_parallel().device_group
    custom = None
    if s["custom"]:
        custom = SymmMemAllReduce(group, device, torch.bfloat16, max_bytes=max(sizes_kib) * 1024)
        custom.rendezvous()
    rows = []
    for kib in sizes_kib:
        x = torch.randn(kib * 512, device=device, dtype=torch.bfloat16)  # kib KiB of bf16
        row = {"variant": s["variant"], "KiB": kib}
        _barrier()
        row["nccl_eager_us"] = cuda_time_ms(lambda x=x: dist.all_reduce(x, group=group), warmup=5, iters=50) * 1e3
        _barrier()
        row["nccl_graph_us"] = graph_time_ms(lambda x=x: dist.all_reduce(x, group=group)) * 1e3
        if custom is not None:
            expected = x.float().clone()
            dist.all_reduce(expected, group=group)
            got = custom.all_reduce(x).float()
            assert torch.allclose(got, expected, rtol=2e-2, atol=8e-2), f"one-shot all-reduce wrong at {kib} KiB"
            _barrier()
            row["custom_eager_us"] = cuda_time_ms(lambda x=x: custom.all_reduce(x), warmup=5, iters=50) * 1e3
            _barrier()
            row["custom_graph_us"] = graph_time_ms(lambda x=x: custom.all_reduce(x)) * 1e3
            row["custom/nccl_graph"] = row["custom_graph_us"] / row["nccl_graph_us"]
        rows.append(row)
        gc.collect()  # the captured graphs go before the next size (and before the group)
    torch.cuda.synchronize()
    if custom is not None:
        custom.close()
    return rows


def rank_main(rank: int, s: dict, init_method: str, out_path: str, quick: bool) -> None:
    os.environ.update(_env(s["p2p"]))  # before NCCL forms its communicators
    from graphserve.distributed.state import destroy_parallel, init_parallel

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_parallel(rank, s["tp"], s["ep"], init_method, device)
    if s["kind"] == "allreduce":
        sizes = [8, 64, 512, 2048, 8192] if quick else [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
        rows = _allreduce_rows(s, device, sizes)
    else:
        rows = _step_rows(s, device, iters=10 if quick else 30)
    gc.collect()
    torch.cuda.synchronize()
    destroy_parallel()
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))


# ---- driver ------------------------------------------------------------------------------------------------

def run_scenario(s: dict, quick: bool) -> list[dict]:
    import torch.multiprocessing as mp

    from graphserve.engine.ranks import free_tcp_address

    world = max(s["tp"], s["ep"])
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        t0 = time.perf_counter()
        mp.start_processes(rank_main, args=(s, free_tcp_address(), out, quick), nprocs=world, join=True,
                           start_method="spawn")
        print(f"# {s['kind']} {s['variant']} tp={s['tp']} ep={s['ep']}: {time.perf_counter() - t0:.0f} s", flush=True)
        return json.loads(Path(out).read_text())


PARTS = ("dense", "moe", "allreduce")


def scenarios(parts: list[str], tp: int) -> list[dict]:
    batches = [1, 64]
    base = {"kind": "step", "model": "dummy:llama3-8b", "ep": 1, "batches": batches, "p2p": True, "custom": True}
    out = []
    if "dense" in parts:
        out += [{**base, "variant": "tp1", "tp": 1},
                {**base, "variant": "oneshot+nccl", "tp": tp},
                {**base, "variant": "nccl", "tp": tp, "custom": False},
                {**base, "variant": "nccl p2p-off", "tp": tp, "custom": False, "p2p": False}]
    if "moe" in parts:
        moe = {**base, "model": "dummy:qwen3-30b-a3b"}
        out += [{**moe, "variant": "moe tp", "tp": tp}, {**moe, "variant": "moe ep", "tp": 1, "ep": tp}]
    if "allreduce" in parts:
        ar = {"kind": "allreduce", "tp": tp, "ep": 1, "p2p": True, "custom": True}
        out += [{**ar, "variant": "p2p"}, {**ar, "variant": "p2p-off", "p2p": False, "custom": False}]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer all-reduce sizes and step iterations")
    parser.add_argument("--tp", type=int, default=2, help="ranks of the parallel rows (GPUs needed)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="dense: llama3-8b tp 1 / tp 2 variants; moe: qwen3-30b-a3b tp and ep; allreduce: the sweep")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp={args.tp} needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
    os.environ.update(_env(True))
    steps: list[dict] = []
    allreduce: list[dict] = []
    errors: list[dict] = []
    for s in scenarios(args.parts, args.tp):
        try:
            (allreduce if s["kind"] == "allreduce" else steps).extend(run_scenario(s, args.quick))
        except Exception as e:  # noqa: BLE001 - one failing scenario (its ranks are stopped) must not lose the rest
            print(f"# {s['kind']} {s['variant']} failed: {type(e).__name__}: {e}", flush=True)
            errors.append({"kind": s["kind"], "variant": s["variant"], "error": f"{type(e).__name__}: {e}"})
        report(steps, allreduce, errors, args, final=False)  # written after each scenario: a timeout keeps what ran
    report(steps, allreduce, errors, args, final=True)


def report(steps: list[dict], allreduce: list[dict], errors: list[dict], args: argparse.Namespace,
           final: bool) -> None:
    tp1 = {(r["model"], r["batch"]): r["step_ms"] for r in steps if r["tp"] == 1 and r["ep"] == 1}
    for r in steps:
        base = tp1.get((r["model"], r["batch"]))
        r["vs_tp1"] = r["step_ms"] / base if base else None
    wins = [r["KiB"] for r in allreduce if r["variant"] == "p2p" and r.get("custom/nccl_graph", 2.0) < 1.0]
    switch = max(wins) * 1024 if wins else 0
    name = "tp" if set(args.parts) == set(PARTS) else "tp_" + "_".join(sorted(args.parts))
    path = write_result(name, {"ctx": CTX, "steps": steps, "allreduce": allreduce,
                               "custom_all_reduce_max_bytes": switch if allreduce else None,
                               "gpus": torch.cuda.device_count(), "quick": args.quick, "parts": args.parts,
                               "errors": errors, "complete": final})
    if not final:
        return
    if steps:
        print_table(steps, STEP_COLS)
    if allreduce:
        print()
        print_table(allreduce, AR_COLS)
        print(f"\nlargest message where the one-shot all-reduce beats NCCL in a graph: {switch} bytes "
              f"(CUSTOM_ALL_REDUCE_MAX_BYTES)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
