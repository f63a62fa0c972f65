"""What each MLA decode tile costs on Hopper, without a GPU: compile the kernel for sm_90 with
Triton and ptxas and report its shared memory, registers, spills and MMA kind.

A tile whose shared memory exceeds the card's 227 KiB per block fails at launch; one that spills
registers runs at a fraction of the bandwidth; the shared memory and registers decide how many
programs fit an SM (the tile's ``occupancy``). The pipeline depth is visible here too: the shared
memory grows by one tile per extra stage only when the loads are really multi-buffered.

Run (any machine with Triton's NVIDIA backend, which bundles ptxas):
    python3 -m benchmarks.mla_ptxas hm-h16n32w4s3o2 tm-h16n32w4s3o2 [--direct] [--fp8] [--dtype fp32] [--json]
    (a tile name ending in t2, like hm-h16n16w8s2o1t2, compiles the extend variant)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

SM90_SHARED_BYTES = 232448  # 227 KiB: the most one block may use on an H100/H200
REGISTERS_PER_SM = 65536
_POINTERS = ("q_lat_ptr", "q_rope_ptr", "cache_ptr", "block_tables_ptr", "seq_lens_ptr", "q_start_ptr", "out_ptr",
             "mid_o_ptr", "mid_lse_ptr")  # fmt: skip
_STRIDES = ("stride_qlt", "stride_qlh", "stride_qrt", "stride_qrh", "stride_cblk", "stride_coff", "stride_bt",
            "stride_ot", "stride_oh", "stride_mo_t", "stride_mo_h", "stride_mo_s", "stride_ml_t", "stride_ml_h")


def compile_report(name: str, direct: bool = False, fp8: bool = False, dtype: str = "bf16") -> dict:
    """Compile the kernel at V2/V3 shapes (r 512, rope 64, page 16) with tile ``name`` (its ``block_t``
    above 1: the extend variant), queries in ``dtype`` ("bf16" or "fp32")."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from graphserve.kernels.mla_attention import _mla_attention_kernel
    from graphserve.kernels.mla_config import MLATile

    tile = MLATile.parse(name)
    types = {"cache_ptr": "*fp8e4nv" if fp8 else f"*{dtype}", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
             "q_start_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32"}  # fmt: skip
    signature = {p: types.get(p, f"*{dtype}") for p in _POINTERS}
    signature.update({"scale_log2": "fp32", "num_splits": "i32", "num_heads": "i32"})
    signature.update({s: "i32" for s in _STRIDES})
    constants = {"RANK": 512, "BLOCK_R": 512, "ROPE": 64, "BLOCK_D": 64, "PAGE": 16, "BLOCK_N": tile.block_n,
                 "BLOCK_H": tile.block_h, "BLOCK_T": tile.block_t, "TOKEN_MAJOR": tile.token_major,
                 "DIRECT": direct or tile.block_t > 1, "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
                 "WHILE_LOOP": False}  # fmt: skip
    signature.update({k: "constexpr" for k in constants})
    names = list(signature)
    # what the launcher specialises at run time: 16-byte aligned pointers, strides divisible by 16, but for what
    # the kernel leaves unspecialized (the batch- and context-sized ones, kernels/mla_attention.py)
    params = {p.name: p for p in _mla_attention_kernel.params}
    aligned = [i for i, n in enumerate(names) if (n in _POINTERS and not params[n].do_not_specialize_on_alignment)
               or (n in _STRIDES and not params[n].do_not_specialize)]  # fmt: skip
    src = ASTSource(fn=_mla_attention_kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constants.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": tile.num_warps, "num_stages": tile.num_stages})
    ttgir = kernel.asm["ttgir"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp, "k.ptx")
        ptx.write_text(kernel.asm["ptx"])
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        log = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", str(ptx), "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    smem = int(kernel.metadata.shared)
    fits = min(SM90_SHARED_BYTES // max(smem, 1), REGISTERS_PER_SM // (regs * 32 * tile.num_warps))
    mma = "wgmma" if "warp_group_dot" in ttgir else "mma" if "#mma" in ttgir else "fma"
    return {"tile": name, "direct": direct, "cache": "fp8" if fp8 else dtype, "shared_bytes": smem,
            "registers": regs, "spill_bytes": spills, "programs_per_sm": fits, "mma": mma,
            "fits_sm90": smem <= SM90_SHARED_BYTES}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("tiles", nargs="+", help="tile names, e.g. hm-h16n32w4s3o2")
    p.add_argument("--direct", action="store_true", help="the one-split variant (writes the output itself)")
    p.add_argument("--fp8", action="store_true", help="an fp8 e4m3 cache")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="the queries' (and cache's) dtype")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args()
    for name in args.tiles:
        row = compile_report(name, args.direct, args.fp8, args.dtype)
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
