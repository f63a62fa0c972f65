"""The all-reduce paths on 2 GPUs: the two-shot peer all-reduce against its PyTorch reference on random bf16
messages, and the start-up choice (allreduce_choice.py) giving NCCL's sums at every size whichever path it
installed, measured or forced by GRAPHSERVE_ALLREDUCE. Needs 2 GPUs; each rank is a fresh spawned process (peer
memory is registered once per process group name)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason=f"needs 2 GPUs for NCCL ranks, {torch.cuda.device_count()} visible")


def _rank(rank: int, init_method: str, forced: str, out: str) -> None:
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    if forced:
        os.environ["GRAPHSERVE_ALLREDUCE"] = forced
    import torch.distributed as dist

    from graphserve.config import EngineConfig
    from graphserve.distributed.allreduce_choice import choose_all_reduce
    from graphserve.distributed.custom_all_reduce import two_shot_reference
    from graphserve.distributed.state import destroy_parallel, get_parallel, init_parallel

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    parallel = init_parallel(rank, 2, 1, init_method, device)
    table = choose_all_reduce(parallel, EngineConfig(model="dummy:qwen3-0.6b", dtype="bfloat16", tp=2), device,
                              torch.bfloat16)
    router = get_parallel().custom_all_reduce
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    errors = {}
    for rows in (1, 3, 64, 512, 2048):
        x = torch.randn(rows, 2048, generator=gen, device=device).to(torch.bfloat16)
        both = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(both, x, group=parallel.device_group)
        ref = two_shot_reference([t.cpu() for t in both])[rank].float()
        expected = x.float().clone()
        dist.all_reduce(expected, group=parallel.device_group)
        got = router.all_reduce(x) if router is not None and router.accepts(x) else None
        two = router.impl.two_shot(x) if router is not None and router.impl.has_two_shot and \
            router.impl.accepts(x) else None
        errors[rows] = {
            "router": None if got is None else ((got.float() - expected).norm() / expected.norm()).item(),
            "twoshot_vs_reference": None if two is None else
            ((two.float().cpu() - ref).norm() / ref.norm()).item(),
        }
    torch.cuda.synchronize()
    destroy_parallel()
    if rank == 0:
        Path(out).write_text(json.dumps({"chosen": table.chosen, "errors": errors, "note": table.note,
                                         "installed": router is not None}))


def _run(forced: str = "") -> dict:
    import torch.multiprocessing as mp

    from graphserve.engine.ranks import free_tcp_address

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r.json")
        mp.start_processes(_rank, args=(free_tcp_address(), forced, out), nprocs=2, join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


@pytest.mark.parametrize("forced", ["", "oneshot", "twoshot", "nccl"])
def test_chosen_paths_sum_like_nccl_and_two_shot_matches_its_reference(forced):
    r = _run(forced)
    assert len(r["chosen"]) == 8
    if forced == "nccl":
        assert set(r["chosen"]) == {"nccl"} and not r["installed"]
    elif forced and "unavailable" not in r["note"]:
        assert set(r["chosen"]) == {forced}
    for rows, e in r["errors"].items():
        if e["router"] is not None:
            assert e["router"] < 1e-2, (rows, e)
        if e["twoshot_vs_reference"] is not None:
            assert e["twoshot_vs_reference"] < 1e-2, (rows, e)
