"""Measured ceilings of this GPU: device-memory read bandwidth and bf16 matmul peak.

The other benchmarks divide by these numbers, measured in the same run. A floor that some kernel
beats is a wrong floor, so the read bandwidth is the best of several ways to read memory:

- ``stream_read``: a Triton kernel that streams a buffer with wide loads (graphserve/kernels/stream_read.py), the
  best of a few grids (``STREAM_GRIDS``: persistent, and one program a block);
- ``torch.sum``: a reduction over the same buffer;
- ``copy (read side)``: a device-to-device copy, counting only the bytes it reads;
- ``matvec``: cuBLAS's one-row matmul over the buffer viewed as a weight (a decode step's access pattern:
  cuBLAS picks TMA-fed kernels a reduction does not use), the best of a few weight widths;
- and any rate a benchmark's own kernels reach in the run (``ReadBandwidth.observe``): when a decode
  step or an attention kernel reads faster than the probes, that rate becomes the floor.

Buffers are 4 GiB, alternating between two, far above any L2. Next to each ratio the benchmarks print
the ratio against the card's datasheet bandwidth (``DATASHEET_READ_GBS``) where the card is known.

Use from another benchmark::

    bw = measured_read_bw()              # probes, ~1 s on an H200
    bw.probe_again()                     # after the work: each method's best of both rounds
    floor_ms = nbytes / bw.bytes_per_ms   # best measured rate so far
    bw.observe("decode step bs=8", nbytes, step_ms)   # a faster run raises the floor
    bw.summary()                          # {"best_gbs", "best_method", "methods", "datasheet_gbs"}

Run: python3 -m benchmarks.roofline
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphserve.tuning.timing import cuda_time_ms, print_table

PROBE_BYTES = 4 << 30
# Datasheet HBM bandwidth in GB/s (1e9 B/s), matched against torch.cuda.get_device_name in order:
# the first key contained in the name wins, so the specific variants come before the plain "H100".
DATASHEET_READ_GBS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5 (its name is "NVIDIA H100 80GB HBM3")
)



def datasheet_read_gbs(device_name: str) -> float | None:
    """The card's datasheet memory bandwidth in GB/s, or None for a card not in the table."""
    return next((gbs for key, gbs in DATASHEET_READ_GBS if key in device_name), None)


@dataclass
class ReadBandwidth:
    """Read rates (GB/s) measured in one run; the floor uses the best of them."""

    methods: dict[str, float]
    datasheet_gbs: float | None = None
    l2_bytes: int = 0  # work smaller than twice this may be served from L2: not observed as a DRAM rate
    observed: dict[str, float] = field(default_factory=dict)  # rates the benchmark's own work reached

    @property
    def best_method(self) -> str:
        rates = {**self.methods, **self.observed}
        return max(rates, key=rates.get)

    @property
    def best_gbs(self) -> float:
        return max([*self.methods.values(), *self.observed.values()])

    @property
    def bytes_per_ms(self) -> float:
        return self.best_gbs * 1e6

    def floor_ms(self, nbytes: float) -> float:
        """Time to read ``nbytes`` at the best rate measured so far."""
        return nbytes / self.bytes_per_ms

    def datasheet_floor_ms(self, nbytes: float) -> float | None:
        return nbytes / (self.datasheet_gbs * 1e6) if self.datasheet_gbs else None

    def ratios(self, ms: float, nbytes: float, flops: float = 0.0, peak_tflops: float | None = None) -> dict:
        """``ms`` against the floor max(bytes / best read rate, FLOPs / matmul peak), and against the same
        floor at the datasheet bandwidth (None where the card is not in the table)."""
        compute_ms = flops / (peak_tflops * 1e9) if peak_tflops else 0.0
        floor = max(self.floor_ms(nbytes), compute_ms)
        ds = self.datasheet_floor_ms(nbytes)
        ds_floor = max(ds, compute_ms) if ds is not None else None
        return {"floor_ms": floor, "ratio": ms / floor, "datasheet_floor_ms": ds_floor,
                "ratio_datasheet": ms / ds_floor if ds_floor else None}

    def observe(self, label: str, nbytes: float, ms: float) -> None:
        """Record that some work read ``nbytes`` in ``ms``; the floor rises if it beat every probe.

        Work under twice the L2 size is ignored: replayed back to back it can be read from cache."""
        if ms > 0 and nbytes >= 2 * self.l2_bytes:
            self.observed[label] = max(self.observed.get(label, 0.0), nbytes / ms / 1e6)

    def probe_again(self, nbytes: int = PROBE_BYTES) -> None:
        """Run the probes once more and keep each method's best rate. Benchmarks call it after their work:
        the first probes may run on a GPU still clocking up, and a slow probe would leave every floor of the
        run generous."""
        for method, gbs in measured_read_bw(nbytes).methods.items():
            self.methods[method] = max(self.methods.get(method, 0.0), gbs)

    def summary(self) -> dict:
        best_observed = max(self.observed, key=self.observed.get) if self.observed else None
        return {"best_gbs": self.best_gbs, "best_method": self.best_method, "methods": dict(self.methods),
                "best_observed": best_observed,
                "best_observed_gbs": self.observed[best_observed] if best_observed else None,
                "datasheet_gbs": self.datasheet_gbs}

    def describe(self) -> str:
        probes = ", ".join(f"{k} {v:.0f}" for k, v in self.methods.items())
        ds = f"; datasheet {self.datasheet_gbs:.0f} GB/s" if self.datasheet_gbs else "; no datasheet figure for this card"
        return f"read bandwidth {self.best_gbs:.0f} GB/s ({self.best_method}; probes: {probes}){ds}"


def _probe_buffers(nbytes: int) -> list[torch.Tensor]:
    return [torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16) for _ in range(2)]


def _alternating(fn, bufs: list[torch.Tensor]):
    """``fn`` over the two buffers in turn, so no call finds its buffer in L2."""
    i = [0]

    def run():
        fn(bufs[i[0] % 2])
        i[0] += 1

    return run


# stream_read's grid shapes: (programs an SM, block, warps). A persistent grid of a few programs an SM striding over
# the buffer, or (0 programs an SM) one program a block, each one pass: the projections' kind of grid, which
# benchmarks.step_skeleton found reading faster than every persistent shape
BLOCK_GRID = (0, 4096, 4)  # one program a 4,096-element block
STREAM_GRIDS = ((4, 4096, 8), (8, 2048, 4), (2, 8192, 8), BLOCK_GRID)


def stream_programs(per_sm: int, sms: int, numel: int, block: int) -> int:
    """The grid of a ``STREAM_GRIDS`` shape over ``numel`` elements: ``per_sm`` programs an SM, or with 0 one a block."""
    return per_sm * sms if per_sm else -(-numel // block)


def wide_view(x: torch.Tensor) -> torch.Tensor:
    """A buffer of one-byte elements (an fp8 weight) viewed as half as many 16-bit ones, for kernels/stream_read.py:
    its threads load a fixed count of elements, so one-byte elements would load half the bytes a 16-bit buffer does
    and read more slowly for it. The values do not matter to a read, only that every byte is loaded. Other buffers
    come back as they are."""
    if x.element_size() != 1:
        return x
    if x.numel() % 2:
        raise ValueError(f"wide_view: a one-byte buffer of {x.numel()} elements (odd) has no 16-bit view; "
                         "its element count must be even")
    return x.view(-1).view(torch.bfloat16)


def stream_read_gbs(bufs: list[torch.Tensor]) -> float:
    """The Triton streaming read; the best of ``STREAM_GRIDS``."""
    from graphserve.kernels.common import sm_count
    from graphserve.kernels.stream_read import stream_read

    sms = sm_count(bufs[0].device)
    nbytes = bufs[0].numel() * bufs[0].element_size()
    best = 0.0
    for per_sm, block, warps in STREAM_GRIDS:
        programs = stream_programs(per_sm, sms, bufs[0].numel(), block)
        out = torch.empty(programs, dtype=torch.float32, device="cuda")
        ms = cuda_time_ms(_alternating(lambda b, o=out, p=programs, bl=block, w=warps:
                                       stream_read(b, p, block=bl, num_warps=w, out=o), bufs), warmup=3, iters=20)
        best = max(best, nbytes / ms / 1e6)
    return best


def sum_read_gbs(bufs: list[torch.Tensor]) -> float:
    nbytes = bufs[0].numel() * bufs[0].element_size()
    ms = cuda_time_ms(_alternating(lambda b: b.sum(dtype=torch.float32), bufs), warmup=3, iters=20)
    return nbytes / ms / 1e6


def copy_read_gbs(bufs: list[torch.Tensor]) -> float:
    """Device-to-device copy of one buffer into the other, counting only the bytes read."""
    src, dst = bufs
    nbytes = src.numel() * src.element_size()
    ms = cuda_time_ms(lambda: dst.copy_(src), warmup=3, iters=20)
    return nbytes / ms / 1e6


def matvec_read_gbs(bufs: list[torch.Tensor]) -> float:
    """One bf16 row times the buffer viewed as a [N, K] weight, K = 2048, 4096, 8192 (the hidden sizes of the
    presets): the best rate."""
    nbytes = bufs[0].numel() * bufs[0].element_size()
    best = 0.0
    for k in (2048, 4096, 8192):
        weights = [b.view(-1, k) for b in bufs]
        x = torch.randn(1, k, device=bufs[0].device, dtype=bufs[0].dtype)
        ms = cuda_time_ms(_alternating(lambda w, x=x: torch.nn.functional.linear(x, w), weights), warmup=3, iters=20)
        best = max(best, nbytes / ms / 1e6)
    return best


def measured_read_bw(nbytes: int = PROBE_BYTES) -> ReadBandwidth:
    """Probe this GPU's read bandwidth four ways (same run, same buffers); see the module docstring."""
    bufs = _probe_buffers(nbytes)
    methods = {"stream_read": stream_read_gbs(bufs), "torch.sum": sum_read_gbs(bufs),
               "copy (read side)": copy_read_gbs(bufs), "matvec": matvec_read_gbs(bufs)}
    del bufs
    torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    return ReadBandwidth(methods, datasheet_read_gbs(props.name), getattr(props, "L2_cache_size", 0))


def read_bandwidth_gbs(nbytes: int = PROBE_BYTES) -> float:
    """The best probe rate in GB/s, for callers that need only the number (``measured_read_bw`` also
    says which method gave it and takes the rates a benchmark's own kernels reach)."""
    return measured_read_bw(nbytes).best_gbs


def matmul_tflops(m: int = 8192, n: int = 8192, k: int = 8192) -> float:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, warmup=5, iters=20)
    return 2 * m * n * k / (ms / 1e3) / 1e12


def write_result(name: str, payload: dict):
    """benchmarks/common.write_result: a source checkout's results folder (the benchmark's own entry point only;
    `graphserve tune` writes tables, not results)."""
    from benchmarks.common import write_result as write

    return write(name, payload)


def main() -> None:
    bw = measured_read_bw()
    peak = matmul_tflops()
    rows = [{"method": k, "read_gbs": v, "vs_best": v / bw.best_gbs,
             "vs_datasheet": v / bw.datasheet_gbs if bw.datasheet_gbs else None} for k, v in bw.methods.items()]
    print_table(rows, ["method", "read_gbs", "vs_best", "vs_datasheet"])
    print(f"bf16 matmul {peak:.0f} TFLOP/s; {bw.describe()}")
    write_result("roofline", {"read": bw.summary(), "rows": rows, "matmul_tflops": peak})


if __name__ == "__main__":
    main()
