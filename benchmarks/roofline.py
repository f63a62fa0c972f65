"""Measured ceilings of this GPU: device-memory read bandwidth and bf16 matmul peak.

The other benchmarks divide by these numbers (measured in the same run), never by datasheet rates.
Run: python3 -m benchmarks.roofline
"""

from __future__ import annotations

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result


def read_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Bytes read per second by a reduction over a buffer much larger than L2 (decode is read-bound)."""
    n = nbytes // 2
    bufs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    i = [0]

    def run():
        bufs[i[0] % 2].sum(dtype=torch.float32)
        i[0] += 1

    ms = cuda_time_ms(run, warmup=3, iters=20)
    return n * 2 / (ms / 1e3) / 1e9


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, counting bytes read plus written."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * nbytes / (ms / 1e3) / 1e9


def matmul_tflops(m: int = 8192, n: int = 8192, k: int = 8192) -> float:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, warmup=5, iters=20)
    return 2 * m * n * k / (ms / 1e3) / 1e12


def measure() -> dict:
    return {
        "read_gbs": read_bandwidth_gbs(),
        "copy_gbs": copy_bandwidth_gbs(),
        "matmul_tflops": matmul_tflops(),
    }


def main() -> None:
    ceil = measure()
    print_table([ceil], ["read_gbs", "copy_gbs", "matmul_tflops"])
    write_result("roofline", {"ceilings": ceil})


if __name__ == "__main__":
    main()
