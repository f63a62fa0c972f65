"""The all-reduce path per message size: the two-shot reference against a plain sum, the topology read from
`nvidia-smi topo -m`, the fastest-per-size choice, its forcing switch and its log block (CPU)."""

from __future__ import annotations

import pytest
import torch

from graphserve.distributed.allreduce_choice import (
    ENV,
    PathTable,
    Topology,
    classify,
    forced_path,
    parse_topo_matrix,
)
from graphserve.distributed.custom_all_reduce import two_shot_reference
from graphserve.errors import ConfigError

# nvidia-smi topo -m of an 8-GPU PCIe box without NVLink (the stories' RTX PRO 6000 machines) and of an
# NVLink pair, trimmed to the columns that matter
PCIE_TOPO = """\
\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tPIX\tNODE\tSYS\t0-31\t0\t\tN/A
GPU1\tPIX\t X \tNODE\tSYS\t0-31\t0\t\tN/A
GPU2\tNODE\tNODE\t X \tSYS\t0-31\t0\t\tN/A
GPU3\tSYS\tSYS\tSYS\t X \t32-63\t1\t\tN/A

Legend:
  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
  NV#  = Connection traversing a bonded set of # NVLinks
"""
NVLINK_TOPO = """\
\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tSYS\t0-47\t0
GPU1\tNV18\t X \tSYS\t0-47\t0
NIC0\tSYS\tSYS\t X
"""


@pytest.mark.parametrize(("world", "shape", "dtype", "tol"), [
    (2, (7, 33), torch.float32, 1e-6), (4, (5, 64), torch.float32, 1e-6), (8, (3, 17), torch.bfloat16, 2e-2),
])
def test_two_shot_reference_sums_every_rank_message(world, shape, dtype, tol):
    gen = torch.Generator().manual_seed(world)
    inputs = [torch.randn(shape, generator=gen).to(dtype) for _ in range(world)]
    expected = torch.stack([x.float() for x in inputs]).sum(0)
    outputs = two_shot_reference(inputs)
    assert len(outputs) == world
    for out in outputs:
        assert out.shape == shape and out.dtype == dtype
        assert ((out.float() - expected).norm() / expected.norm()).item() < tol


def test_topology_matrix_is_parsed_and_classified():
    pcie = parse_topo_matrix(PCIE_TOPO)
    assert pcie[(0, 1)] == "PIX" and pcie[(1, 2)] == "NODE" and pcie[(3, 0)] == "SYS" and (0, 0) not in pcie
    nv = parse_topo_matrix(NVLINK_TOPO)
    assert nv == {(0, 1): "NV18", (1, 0): "NV18"}
    assert classify(list(nv.values()), True, False) == "nvlink"
    assert classify([pcie[(0, 1)], pcie[(1, 0)]], True, False) == "pcie-p2p"
    assert classify([pcie[(0, 3)]], False, False) == "pcie-no-p2p"
    assert classify([], None, False) == "unknown"
    assert classify(list(nv.values()), True, True) == "nvlink, NCCL P2P off"


def test_fastest_path_per_size_is_kept_and_larger_messages_go_to_nccl():
    table = PathTable([4096, 65536, 1 << 20], {"nccl": [19.0, 25.0, 60.0], "oneshot": [4.0, 30.0, 200.0],
                                               "twoshot": [6.0, 21.0, None]})
    table.choose()
    assert table.chosen == ["oneshot", "twoshot", "nccl"]
    assert [table.path_for(n) for n in (16, 4096, 4097, 65536, 1 << 20, (1 << 20) + 16)] == \
        ["oneshot", "oneshot", "twoshot", "twoshot", "nccl", "nccl"]
    table.choose("oneshot")  # forced where it can run; a size it cannot take keeps the measured choice
    assert table.chosen == ["oneshot", "oneshot", "oneshot"]
    table.choose("twoshot")
    assert table.chosen == ["twoshot", "twoshot", "nccl"]
    lines = table.lines(Topology("pcie-p2p", "GPUs [0, 1]"), "tp=2, bfloat16, eager")
    assert lines[0] == "all-reduce topology: pcie-p2p (GPUs [0, 1])"
    assert lines[2] == "all-reduce   4 KiB: nccl 19.0 us, oneshot 4.0 us, twoshot 6.0 us -> twoshot"
    assert lines[4] == "all-reduce   1 MiB: nccl 60.0 us, oneshot 200.0 us -> nccl"


def test_the_forcing_switch_is_read_and_a_bad_value_refused(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert forced_path() is None
    monkeypatch.setenv(ENV, "TwoShot")
    assert forced_path() == "twoshot"
    monkeypatch.setenv(ENV, "ring")
    with pytest.raises(ConfigError) as e:
        forced_path()
    assert e.value.param == ENV and "'ring'" in e.value.message and "nccl, oneshot, twoshot" in e.value.message


class _PeerPaths:
    """Peer-memory paths that sum like the real ones would (every rank holding the same message) and record
    which one ran."""

    def __init__(self, world: int, max_bytes: int) -> None:
        self.world, self.max_bytes, self.ran = world, max_bytes, []

    def accepts(self, x: torch.Tensor) -> bool:
        return 0 < x.numel() * x.element_size() <= self.max_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.ran.append("oneshot")
        return x * self.world

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        self.ran.append("twoshot")
        return two_shot_reference([x] * self.world)[0]


def test_router_runs_the_chosen_path_and_sends_unsliceable_messages_elsewhere():
    from graphserve.distributed.allreduce_choice import AllReduceRouter

    table = PathTable([4096, 65536], {"nccl": [19.0, 25.0], "oneshot": [4.0, 30.0], "twoshot": [6.0, 21.0]})
    table.choose()
    peers = _PeerPaths(world=4, max_bytes=65536)
    router = AllReduceRouter(peers, table, world=4)
    small, large, odd = torch.randn(256), torch.randn(8192), torch.randn(4100)  # 1 KiB, 32 KiB, 16400 B
    for x in (small, large, odd):
        assert router.accepts(x)
        torch.testing.assert_close(router.all_reduce(x), x * 4)
    # 16400 B does not split into 4 slices of whole 16-byte units: the one-shot runs it
    assert peers.ran == ["oneshot", "twoshot", "oneshot"]
    assert not router.accepts(torch.randn(65536))  # above the table: NCCL
    no_oneshot = PathTable([65536], {"nccl": [25.0], "twoshot": [21.0]})
    no_oneshot.choose()
    router = AllReduceRouter(_PeerPaths(world=4, max_bytes=65536), no_oneshot, world=4)
    assert router.accepts(large) and not router.accepts(odd)  # no one-shot to fall back on: NCCL
