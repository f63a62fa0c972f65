"""The FP4 streaming kernels' widenings compiled for sm_90 without a GPU: registers, spills and the SASS instructions
of each (kernels/fp4_words.py against the byte widening), at Llama-3-8B's projections on the FMA path (1 row) and the
dot path (8 rows), and the experts' streaming kernels at gpt-oss-120b's shape.

Each kernel is compiled by Triton for sm_90 and assembled by the ptxas Triton bundles; cuobjdump lists its SASS. The
counts are static (a loop body counts once), so they compare widenings of one kernel at one tile, not times: the
integer (LOP3, SHF, PRMT, IMAD), conversion (F2F, HADD2.F32, I2F) and FMA work per K step that, on the H100, bounds
the byte widening below the read rate (benchmarks/results/fp4_kernels.json). Times come from
``python3 -m benchmarks.fp4_variants`` on the GPU.

Run (any machine with Triton's NVIDIA backend): python3 -m benchmarks.fp4_sass [--json]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

from benchmarks.common import print_table

SMS = 132  # the H100's: the tiles are those stream_config picks there
LLAMA3_8B = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
OPCODES = ("LDG", "LOP3", "SHF", "PRMT", "IMAD", "F2F", "HADD2", "I2F", "FFMA", "FMUL", "HMMA", "F2FP")


def compile_sass(fn, signature: dict, constants: dict, num_warps: int, num_stages: int) -> dict:
    """Registers, spills and SASS opcode counts of ``fn`` compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    aligned = [i for i, n in enumerate(names) if signature[n].startswith("*") or n.startswith("stride")]
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})  # fmt: skip
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})  # fmt: skip
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run([str(bin_dir / "ptxas"), "-v", "-arch=sm_90a", str(ptx), "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(bin_dir / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?"
                                                                            r"([A-Z][A-Z0-9_.]+)", sass))
    return {"registers": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", log).group(1)),
            "sass": sum(ops.values()), **{op: ops.get(op, 0) for op in OPCODES}}


def gemv_rows(widenings) -> list[dict]:
    import triton

    from graphserve.kernels.fp4_gemv import _fp4_gemv_kernel, stream_config
    from graphserve.kernels.fp4_layout import GROUP, WIDEN_UNIT_LOG2, WIDENINGS

    rows = []
    for proj, (n, k) in LLAMA3_8B.items():
        for fmt in ("nvfp4", "mxfp4"):
            for m in (1, 8):
                for widen in widenings:
                    cfg = stream_config(m, n, k, GROUP[fmt], SMS, widen=widen)
                    block_k = min(cfg.block_k, triton.next_power_of_2(k))
                    steps = triton.cdiv(k, block_k)
                    k_split = triton.cdiv(steps, min(cfg.split_k, steps)) * block_k
                    code = WIDENINGS.index(widen)
                    types = {name: "*u8" if name in ("w_ptr", "s_ptr") else "*i32" if name == "lock_ptr" else "*fp32" if name in (
                        "gs_ptr", "part_ptr") else "*bf16" if name.endswith("_ptr") else "fp32" if name == "eps"
                        else "i32" for name in _fp4_gemv_kernel.arg_names}  # fmt: skip
                    if code:
                        types["w_ptr"] = "*i32"
                    consts = dict(K=k, GROUP_K=GROUP[fmt], MX=fmt == "mxfp4", HAS_GLOBAL=fmt == "nvfp4", HAS_BIAS=False,
                                  SILU_MUL=proj == "down", ADD_RESIDUAL=False, NORM=proj != "down",
                                  USE_DOT=cfg.use_dot, BLOCK_M=max(16, m) if cfg.use_dot else m, BLOCK_N=cfg.block_n,
                                  BLOCK_K=block_k, SPLIT_K=triton.cdiv(k, k_split), K_SPLIT=k_split, WIDEN=code,
                                  UNIT=WIDEN_UNIT_LOG2[code], EVEN_K=k % k_split == 0 and k_split % block_k == 0,
                                  PDL=False)  # fmt: skip
                    signature = {a: "constexpr" if a in consts else types[a] for a in _fp4_gemv_kernel.arg_names}
                    try:
                        got = compile_sass(_fp4_gemv_kernel, signature, consts, cfg.num_warps, cfg.num_stages)
                    except Exception as e:  # a widening that does not build costs its row, and says why
                        got = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    rows.append({"kernel": "fp4_gemv", "proj": proj, "fmt": fmt, "m": m, "widen": widen,
                                 "path": "dot" if cfg.use_dot else "fma", "tile": f"{cfg.block_n}x{block_k}", **got})
                    print(rows[-1], flush=True)
    return rows


def moe_rows(widenings) -> list[dict]:
    from graphserve.kernels.fp4_layout import WIDEN_UNIT_LOG2, WIDENINGS
    from graphserve.kernels.fp4_moe import _fp4_stream_down_kernel, _fp4_stream_gate_up_kernel

    rows = []
    e, h, inter, topk = 128, 2880, 2880, 4  # gpt-oss-120b, MXFP4, swiglu_oai, biases
    for widen in widenings:
        code = WIDENINGS.index(widen)
        for fn, consts in (
            (_fp4_stream_gate_up_kernel, dict(K=h, TOP_K=topk, E=e, E_LOCAL=e, HAS_VALID=False, GROUP_K=32, MX=True,
                                              HAS_GLOBAL=False, HAS_BIAS=True, ACT=1, BLOCK_N=32,
                                              BLOCK_K=256, BLOCK_P=256, BLOCK_E=128)),
            (_fp4_stream_down_kernel, dict(K=inter, TOP_K=topk, E_LOCAL=e, HAS_VALID=False, GROUP_K=32, MX=True,
                                           HAS_GLOBAL=False, HAS_BIAS=True, BLOCK_N=32, BLOCK_K=256)),
        ):  # fmt: skip
            consts = {**consts, "WIDEN": code, "UNIT": WIDEN_UNIT_LOG2[code], "PDL": False}
            types = {name: "*u8" if name in ("w_ptr", "s_ptr", "valid_ptr") else "*i32" if name in (
                "ids_ptr", "counts_ptr") else "*fp32" if name in ("gs_ptr", "weights_ptr") else "*bf16"
                if name.endswith("_ptr") else "fp32" if name in ("alpha", "limit") else "i32"
                for name in fn.arg_names}  # fmt: skip
            if code:
                types["w_ptr"] = "*i32"
            signature = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
            try:
                got = compile_sass(fn, signature, consts, 4, 2)
            except Exception as e:
                got = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append({"kernel": fn.fn.__name__, "proj": "gpt-oss-120b", "fmt": "mxfp4", "m": 1, "widen": widen,
                         "path": "stream", "tile": "32x256", **got})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    from graphserve.kernels.fp4_layout import WIDENINGS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="write benchmarks/results/fp4_sass.json")
    args = ap.parse_args()
    rows = gemv_rows(WIDENINGS) + moe_rows(WIDENINGS)
    print_table(rows, ["kernel", "proj", "fmt", "m", "path", "tile", "widen", "registers", "spill_bytes", "sass",
                       *OPCODES])
    if args.json:
        from benchmarks.common import write_result

        write_result("fp4_sass", {"target": "sm_90a (compiled without a GPU)", "rows": rows})


if __name__ == "__main__":
    main()
