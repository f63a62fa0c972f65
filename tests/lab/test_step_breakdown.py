"""benchmarks/step_breakdown.py's kernel families, on the names an FP8 or MoE step launches."""

from __future__ import annotations

import pytest

from benchmarks.step_breakdown import family


@pytest.mark.parametrize("name,want", [
    ("_fp8_gemv_kernel", "matmul"), ("_w8a8_kernel", "matmul"), ("fused_moe_gemm_kernel", "matmul"),
    ("nvjet_sm90_qqtst_128x128_128x6_4x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", "matmul"),
    ("_token_group_quant_kernel", "activation quant"), ("_decode_split_kernel", "attention"),
    ("_fp4_stream_down_kernel", "matmul"), ("_fp4_stream_gate_up_kernel", "matmul"), ("_fp4_split_sum_kernel", "matmul"),
    ("_fp4_to_fp8_kernel", "matmul"), ("_rms_norm_kernel", "norm"), ("_silu_and_mul_kernel", "silu_mul"), ("moe_align_offsets_kernel", "copy/other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>", "sampling (argmax)"),
])  # fmt: skip
def test_families(name: str, want: str) -> None:
    assert family(name) == want
