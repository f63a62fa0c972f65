"""graphserve doctor names an all-reduce over PCIe as the bottleneck: from NCCL's INFO lines in the second
story's SGLang log (8 GPUs over PCIe in a VM, where CUDA graphs lowered throughput), and from graphserve's own
all-reduce topology block; NVLink or one rank gives no such finding."""

from __future__ import annotations

from pathlib import Path

from graphserve.analysis.doctor import diagnose, diagnose_lines
from graphserve.distributed.allreduce_choice import PathTable, Topology

LOGS = Path(__file__).resolve().parents[1] / "data" / "logs"
# The second story (8 RTX PRO 6000 over PCIe, tp 8, GLM-5-NVFP4): its numbers (225 tok/s eager, 194-200 tok/s
# with graphs at the same load, 22 running requests at 7360 tokens) with NCCL_DEBUG=INFO lines as a VM
# without peer-to-peer prints them.
STORY2 = "sglang_story2_pcie.log"


def test_story2_log_names_the_pcie_all_reduce_with_its_evidence():
    rep = diagnose(str(LOGS / STORY2))
    lines = (LOGS / STORY2).read_text().splitlines()
    kinds = {f["kind"]: f for f in rep["findings"]}
    assert set(kinds) == {"allreduce_pcie"}
    f = kinds["allreduce_pcie"]
    assert f["title"] == "decode is bound by the all-reduce over PCIe: 8 ranks, NCCL through host memory (no peer-to-peer)"
    assert "CUDA graphs did not help (224 tok/s without, 204 tok/s with)" in f["explanation"]
    assert any(flag.startswith("--tp (lower it, 8 → 4") for flag in f["flags"])
    for n, text in f["evidence"]:
        assert lines[n - 1].rstrip() == text
    quoted = " ".join(t for _, t in f["evidence"])
    assert "tp_size=8" in quoted and "via SHM" in quoted and "cuda graph: True" in quoted


def _graphserve_log(kind: str, tp: int) -> list[str]:
    table = PathTable([4096], {"nccl": [21.0], "oneshot": [9.5]})
    table.choose()
    block = table.lines(Topology(kind, "GPUs [0, 1], peer access yes"), f"tp={tp}, bfloat16, eager")
    return [f"[2026-03-01 10:00:0{i}] {ln}" for i, ln in enumerate(block)] + [
        f"[2026-03-01 10:00:09] engine ready: model=dummy:qwen3-8b device=cuda dtype=torch.bfloat16 kv pool=1 tokens "
        f"(1 blocks of 16), max_model_len=4096, overlap schedule=on, tp={tp} ep=1"]


def test_graphserve_topology_block_is_read_and_nvlink_or_one_rank_is_not_flagged():
    pcie = {f.kind: f for f in diagnose_lines(_graphserve_log("pcie-p2p", 2))}
    assert pcie["allreduce_pcie"].title == "decode is bound by the all-reduce over PCIe: 2 ranks, PCIe, no NVLink"
    assert any("all-reduce   4 KiB: nccl 21.0 us, oneshot 9.5 us -> oneshot" in t
               for _, t in pcie["allreduce_pcie"].evidence)
    assert not [f for f in diagnose_lines(_graphserve_log("nvlink", 2)) if f.kind == "allreduce_pcie"]
    assert not [f for f in diagnose_lines(_graphserve_log("pcie-p2p", 1)) if f.kind == "allreduce_pcie"]
