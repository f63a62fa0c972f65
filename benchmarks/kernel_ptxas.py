"""Registers, spills and shared memory of the decode-latency kernels on Hopper, without a GPU: the
split-KV decode attention, the fused MoE router, the FP8 streaming matmul as the routing table runs it, the MoE
streaming kernels, and the FP4 routed experts' grouped GEMM in both variants.

Each kernel is compiled for sm_90 by Triton and its PTX assembled by the ptxas Triton bundles (as
benchmarks/mla_ptxas.py does for MLA). A kernel that spills pays a local-memory round trip per
spilled value, which at batch 1 lands on the chain of dependent loads the kernel's time is made of.

Run (any machine with Triton's NVIDIA backend):
    python3 -m benchmarks.kernel_ptxas [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

SM90_SHARED_BYTES = 232448
REGISTERS_PER_SM = 65536


def compile_report(fn, types: dict, constants: dict, num_warps: int, num_stages: int) -> dict:
    """Compile ``fn`` with ``types`` (Triton type strings per runtime argument; any argument named
    ``*_ptr`` defaults to ``*bf16``, any other to ``i32``) and ``constants`` (its constexprs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = types.get(name, "*bf16" if name.endswith("_ptr") else "i32")
    names = list(signature)
    # what the launcher specialises at run time: 16-byte aligned pointers, strides divisible by 16
    aligned = [i for i, n in enumerate(names) if signature[n].startswith("*") or n.startswith("stride")]
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})  # fmt: skip
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp, "k.ptx")
        ptx.write_text(kernel.asm["ptx"])
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        log = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", str(ptx), "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    smem = int(kernel.metadata.shared)
    fits = min(SM90_SHARED_BYTES // max(smem, 1), REGISTERS_PER_SM // (regs * 32 * num_warps))
    return {"registers": regs, "spill_bytes": spills, "shared_bytes": smem, "programs_per_sm": fits}


def attention_reports() -> list[dict]:
    """The split-KV decode kernel at Qwen3-30B-A3B's and Llama-3-8B's head shapes (128-wide heads, pages
    of 16), the merge fused in, with the merge tile decode_attention picks for 32 splits; on q, and with the
    attention prologue inside (decode_attention_qkv: Qwen3's per-head norms, Llama's none); each in the model dtype
    and fp8 with one scale per sequence (the last kv head's program quantizes the 32 x 128 row)."""
    import triton

    from graphserve.kernels.decode_attention import BLOCK_N, NUM_STAGES, NUM_WARPS, ROW_CHUNK, _decode_split_kernel
    from graphserve.kernels.decode_merge import MERGE_TILE_ELEMS
    from graphserve.kernels.fp8_quant import FP8_MAX, MIN_SCALE

    types = {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "counter_ptr": "*i32", "block_tables_ptr": "*i32",
             "seq_lens_ptr": "*i32", "scale_log2": "fp32", "pos_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32",
             "sin_ptr": "*fp32", "eps": "fp32", "row_counter_ptr": "*i32", "out_scale_ptr": "*fp32"}  # fmt: skip
    rows = []
    for (model, group), new_token, quant_row in itertools.product((("qwen3-30b-a3b", 8), ("llama3-8b", 4)),
                                                                  (False, True), (False, True)):
        block_hm = triton.next_power_of_2(group)
        chunk = min(32, MERGE_TILE_ELEMS // (block_hm * 128))
        consts = {"GROUP": group, "BLOCK_H": max(16, block_hm), "HEAD_DIM": 128, "BLOCK_D": 128, "PAGE": 16,
                  "BLOCK_N": BLOCK_N, "DIRECT": False, "IEEE_DOT": False, "WHILE_LOOP": False, "PREFETCH_V": True,
                  "FUSED_MERGE": True, "BLOCK_HM": block_hm, "CHUNK_S": chunk, "WIDEN_FP16": False,
                  "QUANT_OUT": quant_row, "FP8_MAX_C": FP8_MAX, "MIN_SCALE_C": MIN_SCALE, "NEW_TOKEN": new_token,
                  "HAS_NORM": new_token and model.startswith("qwen3"), "QUANT_ROW": quant_row,
                  "ROW": 32 * 128 if quant_row else 1, "ROW_CHUNK": ROW_CHUNK, "PDL": False}  # fmt: skip
        out_type = {"out_ptr": "*fp8e4nv"} if quant_row else {}
        row = compile_report(_decode_split_kernel, {**types, **out_type}, consts, NUM_WARPS, NUM_STAGES)
        shape = f"{model} group{group} merge_chunk{chunk}{' prologue' if new_token else ''}{' quant_row' if quant_row else ''}"
        rows.append({"kernel": "_decode_split_kernel", "shape": shape, **row})
    return rows


def gate_reports() -> list[dict]:
    """The router gate + softmax top-k at one row of Qwen3-30B-A3B's router (128 experts, hidden 2048, k 8),
    with the ranking tail and with the rounds of argmax, with and without the add + RMSNorm."""
    from graphserve.kernels.moe_gate import TILE_ELEMS, experts_per_program, moe_gate_softmax_topk_kernel

    types = {"logits_ptr": "*fp32", "counter_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i32", "eps": "fp32"}
    rows = []
    e, h, k = 128, 2048, 8
    block_ep = experts_per_program(e)
    block_h = min(h, TILE_ELEMS // block_ep)
    for norm in (False, True):
        for rank in (True, False):
            consts = {"E": e, "H": h, "TOP_K": k, "RENORMALIZE": True, "NORM": norm, "BLOCK_T": 1, "BLOCK_EP": block_ep,
                      "BLOCK_H": block_h, "BLOCK_E": e, "BLOCK_K": k, "EVEN_H": True, "ONE_TILE": h <= block_h,
                      "W_IN_LOOP": not norm or h > block_h, "RANK_TOPK": rank, "SELECT": 0}  # fmt: skip
            row = compile_report(moe_gate_softmax_topk_kernel, types, consts, 4, 3)
            shape = f"T1 E{e} H{h} k{k} {'add+norm ' if norm else ''}tail={'rank' if rank else 'argmax'}"
            rows.append({"kernel": "moe_gate_softmax_topk_kernel", "shape": shape, **row})
    return rows + gate_dot_reports()


def gate_dot_reports(rows_per_call: tuple[int, ...] = (16, 64)) -> list[dict]:
    """The tensor-core router gate + top-k (kernels/moe_gate_dot.py) at Qwen3-30B-A3B's router, with the tiles
    ``dot_tiles`` picks at each row count."""
    from graphserve.kernels.moe_gate_dot import dot_constants, dot_tiles, dot_warps, moe_gate_dot_softmax_topk_kernel

    types = {"partial_ptr": "*fp32", "counter_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i32"}
    e, h, k = 128, 2048, 8
    rows = []
    for t in rows_per_call:
        consts = {**dot_constants(h, e, k, True, *dot_tiles(t, e)), "PREFETCH": False, "PF_THREADS": 32 * dot_warps(e),
                  "PDL": False}
        row = compile_report(moe_gate_dot_softmax_topk_kernel, types, consts, dot_warps(e), 3)
        rows.append({"kernel": "moe_gate_dot_softmax_topk_kernel",
                     "shape": f"T{t} E{e} H{h} k{k} ep{consts['BLOCK_EP']} split{consts['SPLIT_K']}", **row})
    return rows


def fp8_stream_reports(rows_per_call: tuple[int, ...] = (1, 16, 32, 64), sms: int = 132) -> list[dict]:
    """The FP8 streaming matmul as the routing table (kernels/fp8_rule.json) runs llama3-8b's projections, with
    per-channel scales (``--quantization fp8``; an A8 tile then reads x quantized per token) and 128x128 block
    scales, with the prologue the layer fuses at that row count (layers/quant/fp8.py), and its grid: programs,
    and the waves they take at the compiled occupancy on ``sms`` SMs (an H100/H200 has 132)."""
    import triton
    import triton.language as tl

    from benchmarks.fp8_route import SHAPES, prologue
    from graphserve.kernels.fp8_config import load_rule
    from graphserve.kernels.fp8_gemv import _fp8_gemv_kernel, tile_constants

    types = {"w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "part_ptr": "*fp32", "lock_ptr": "*i32", "eps": "fp32"}
    rule, out = load_rule(), []
    for name, scales in ((n, s) for s in ("channel", "block128") for n in SHAPES if n.startswith("llama3-8b")):
        n, k = SHAPES[name]
        channel = scales == "channel"
        for m in rows_per_call:
            route = rule.route(m, n, k, scales)
            if route is None or route.path != "stream" or route.config is None:
                continue
            cfg = route.config
            kind = None if cfg.a8 else prologue(name, m)  # an a8 tile's prologue runs in the quantization before it
            x_types = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32"} if cfg.a8 else {}
            tiles = tile_constants(m, k, cfg, *((1, k) if channel else (128, 128)), channel)
            consts = {"SILU_MUL": kind == "silu", "ADD_RESIDUAL": kind == "norm", "NORM": kind == "norm",
                      "HAS_BIAS": False, "PDL": False, **tiles, "X_TOKEN": channel and cfg.a8,
                      "GATED": False, "QUANT_OUT": False, "ACT_DTYPE": tl.bfloat16}
            row = compile_report(_fp8_gemv_kernel, {**types, **x_types}, consts, cfg.num_warps, cfg.num_stages)
            split_k, programs = consts["SPLIT_K"], triton.cdiv(n, cfg.block_n) * consts["SPLIT_K"]
            mode = "a8 fp8 dot" if cfg.a8 else "fp8 dot" if cfg.fp8_dot else "dot" if cfg.use_dot else "fma"
            tile = f"{mode} {cfg.block_n}x{consts['BLOCK_K']} split{split_k}"
            out.append({"kernel": "_fp8_gemv_kernel", "shape": f"{name} {scales} m{m} {kind or 'plain'} {tile}", **row,
                        "programs": programs, "waves": round(programs / (row["programs_per_sm"] * sms), 2)})
    for (hidden, inter, scales), entries in rule.mlps.items():
        for m, pair in entries:
            if pair is not None:
                out += gated_reports(m, hidden, inter, scales, pair.gate_up, pair.down, sms)
    return out


def gated_reports(m: int, hidden: int, inter: int, scales: str, gate_up, down, sms: int = 132) -> list[dict]:
    """A gated MLP pair's two launches (kernels/fp8_gemv.fp8_gate_up_a8 writing down's quantized input, then down
    reading it in groups of its K step) at ``m`` rows, compiled as the layer runs them (layers/quant/fp8.py
    apply_norm_mlp), with their grids."""
    import triton
    import triton.language as tl

    from graphserve.kernels.fp8_gemv import _fp8_gemv_kernel, tile_constants

    channel = scales == "channel"
    types = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "part_ptr": "*fp32",
             "lock_ptr": "*i32", "os_ptr": "*fp32", "eps": "fp32"}
    out = []
    for what, n, k, cfg, gated in (("gate_up", inter, hidden, gate_up, True), ("down", hidden, inter, down, False)):
        tiles = tile_constants(m, k, cfg, *((1, k) if channel else (128, 128)), channel)
        consts = {"SILU_MUL": False, "ADD_RESIDUAL": False, "NORM": False, "HAS_BIAS": False, "PDL": False, **tiles,
                  "X_TOKEN": channel and gated, "GATED": gated, "QUANT_OUT": gated, "ACT_DTYPE": tl.bfloat16}
        row = compile_report(_fp8_gemv_kernel, {**types, **({"out_ptr": "*fp8e4nv"} if gated else {})}, consts,
                             cfg.num_warps, cfg.num_stages)  # fmt: skip
        programs = triton.cdiv(n, cfg.block_n // 2 if gated else cfg.block_n) * consts["SPLIT_K"]
        tile = f"{'gated ' if gated else ''}a8 fp8 dot {cfg.block_n}x{consts['BLOCK_K']} w{cfg.num_warps} " \
               f"s{cfg.num_stages} split{consts['SPLIT_K']}"
        out.append({"kernel": "_fp8_gemv_kernel", "shape": f"mlp {hidden}x{inter} {scales} m{m} {what} {tile}", **row,
                    "programs": programs, "waves": round(programs / (row["programs_per_sm"] * sms), 2)})
    return out


def moe_stream_reports() -> list[dict]:
    """The MoE small-batch streaming kernels (kernels/moe_stream.py) with the tiles every shipped FP8 expert table
    gives them, at that table's expert shape, with the 128x128 block scales the tuner times them on: a step past
    the block takes the per-column scales (``K_SCALES``, kernels/moe_scales.stream_step's rule, as moe_fused asks)."""
    import triton

    from graphserve.kernels.moe_config import CONFIG_DIR, MoeTiles
    from graphserve.kernels.moe_fused import HISTOGRAM_PAIRS
    from graphserve.kernels.moe_scales import stream_step
    from graphserve.kernels.moe_stream import fused_moe_gemv_down_kernel, fused_moe_gemv_gate_up_kernel

    block, f8, out = 128, "*fp8e4nv", []
    for path in sorted(CONFIG_DIR.glob("*dtype=float8_e4m3fn*.json")):
        raw = json.loads(path.read_text())
        tiles = MoeTiles.from_json(raw)
        if not tiles.small_max_pairs or tiles.gemv_gate_up is None or "top_k" not in raw:
            continue
        e, h, i, k = raw["experts"], raw["hidden"], raw["intermediate"], raw["top_k"]
        scales = {"W_FP8": True, "GROUP_N": block, "GROUP_K": block, "PER_CHANNEL": False, "HAS_VALID": False,
                  "PDL": False, "TOP_K": k, "E_LOCAL": e}  # fmt: skip
        for name, tile, kk in (("gate_up", tiles.gemv_gate_up, h), ("down", tiles.gemv_down, i)):
            step, wide = stream_step(block, block, tile.block_n, min(tile.block_k, triton.next_power_of_2(kk)))
            if name == "gate_up":
                fn = fused_moe_gemv_gate_up_kernel
                types = {"x_ptr": "*bf16", "w13_ptr": f8, "act_ptr": "*bf16", "ids_ptr": "*i32", "valid_ptr": "*i32",
                         "counts_ptr": "*i32", "ws_ptr": "*fp32"}  # fmt: skip
                consts = {"K": kk, "E": e, "BLOCK_P": HISTOGRAM_PAIRS, "BLOCK_E": triton.next_power_of_2(e)}
            else:
                fn = fused_moe_gemv_down_kernel
                types = {"act_ptr": "*bf16", "w2_ptr": f8, "out_ptr": "*bf16", "weights_ptr": "*fp32",
                         "ids_ptr": "*i32", "valid_ptr": "*i32", "ws_ptr": "*fp32"}  # fmt: skip
                consts = {"K": kk, "BLOCK_S": triton.next_power_of_2(k)}
            consts.update(scales, K_SCALES=wide, BLOCK_N=tile.block_n, BLOCK_K=step, HAS_BIAS=False)
            if name == "gate_up":
                consts.update(ACT=0, ALPHA=1.702, LIMIT=7.0)
            row = compile_report(fn, types, consts, tile.num_warps, tile.num_stages)
            out.append({"kernel": fn.__name__, "shape": f"E{e} H{h} I{i} k{k} {name} {tile.block_n}x{step}"
                        f"{' k_scales' if wide else ''} w{tile.num_warps}", **row})
    return out


FP4_EXPERT_SHAPES = {"deepseek-v4-flash": ("nvfp4", 4096, 2048), "gpt-oss-120b": ("mxfp4", 2880, 2880)}


def fp4_moe_gemm_reports(models: tuple[str, ...] = tuple(FP4_EXPERT_SHAPES)) -> list[dict]:
    """The FP4 routed experts' grouped GEMM (kernels/fp4_moe_gemm.py) at DeepSeek-V4-Flash's expert shape (NVFP4, 256
    experts, hidden 4096, intermediate 2048) and gpt-oss-120b's (MXFP4, 2880 / 2880), gate_up and down, in each
    variant at its default tile (kernels/fp4_moe_config.default_tile) for a decode batch (BLOCK_M 16) and a prefill
    one (BLOCK_M 64, where the bf16 variant takes the widened tile as the MMA's first operand)."""
    from graphserve.kernels.fp4_moe_config import default_tile
    from graphserve.kernels.fp4_moe_gemm import _fp4_moe_gemm_fp8_kernel, _fp4_moe_gemm_kernel

    out = []
    for model in models:
        fmt, h, inter = FP4_EXPERT_SHAPES[model]
        group = 16 if fmt == "nvfp4" else 32
        for variant, block_m, (name, k) in itertools.product(("bf16", "fp8"), (16, 64), (("gate_up", h), ("down", inter))):
            fp8 = variant == "fp8"
            tile = default_tile(variant, block_m, group, k)
            types = {"a_ptr": "*u8" if fp8 else "*bf16", "as_ptr": "*fp32", "w_ptr": "*u8", "s_ptr": "*u8",
                     "gs_ptr": "*fp32", "weights_ptr": "*fp32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
                     "num_post_ptr": "*i32", "alpha": "fp32", "limit": "fp32"}  # fmt: skip
            consts = {"K": k, "A_ROW_DIV": 6 if name == "gate_up" else 1, "GATED": name == "gate_up",
                      "MUL_WEIGHT": name == "down", "ACT": 2 if fmt == "nvfp4" else 1, "GROUP_K": group,
                      "MX": fmt == "mxfp4", "HAS_GLOBAL": fmt == "nvfp4", "ROW_GLOBAL": False,
                      "HAS_BIAS": fmt == "mxfp4", "BLOCK_M": block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k,
                      "GROUP_M": tile.group_m, "PDL": False}  # fmt: skip
            fn = _fp4_moe_gemm_fp8_kernel if fp8 else _fp4_moe_gemm_kernel
            row = compile_report(fn, types, consts, tile.num_warps, tile.num_stages)
            out.append({"kernel": fn.__name__, "shape": f"{model} {name} {variant} {block_m}x{tile.block_n}x"
                        f"{tile.block_k} w{tile.num_warps} s{tile.num_stages}", **row})
    return out


def fp4_moe_stream_reports(models: tuple[str, ...] = tuple(FP4_EXPERT_SHAPES)) -> list[dict]:
    """The FP4 routed experts' streaming kernels (kernels/fp4_moe.py) at the expert shapes above as
    fp4_fused_experts launches them with the default widening ("word": int32 words): gate_up, and down in both
    grids (a program per token over its top-k slots; a program per pair writing fp32 terms, ``PER_PAIR``)."""
    import triton

    from graphserve.kernels.fp4_layout import DEFAULT_WIDEN, WIDEN_UNIT_LOG2, WIDENINGS
    from graphserve.kernels.fp4_moe import _fp4_stream_down_kernel, _fp4_stream_gate_up_kernel

    widen = WIDENINGS.index(DEFAULT_WIDEN)
    out = []
    for model in models:
        fmt, h, inter = FP4_EXPERT_SHAPES[model]
        group = 16 if fmt == "nvfp4" else 32
        common = {"TOP_K": 4, "E_LOCAL": 128, "HAS_VALID": True, "GROUP_K": group, "MX": fmt == "mxfp4",
                  "HAS_GLOBAL": fmt == "nvfp4", "ROW_GLOBAL": False, "HAS_BIAS": fmt == "mxfp4", "BLOCK_N": 32,
                  "WIDEN": widen, "UNIT": WIDEN_UNIT_LOG2[widen], "PDL": False}  # fmt: skip
        types = {"w_ptr": "*i32", "s_ptr": "*u8", "gs_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
                 "valid_ptr": "*u8", "counts_ptr": "*i32", "alpha": "fp32", "limit": "fp32"}  # fmt: skip
        launches = [(_fp4_stream_gate_up_kernel, "gate_up", types, {
            **common, "K": h, "E": 128, "ACT": 2 if fmt == "nvfp4" else 1, "BLOCK_K": min(256, triton.next_power_of_2(h)),
            "BLOCK_P": 256, "BLOCK_E": 128})]  # fmt: skip
        for per_pair in (False, True):
            launches.append((_fp4_stream_down_kernel, f"down per {'pair' if per_pair else 'token'}",
                             {**types, "out_ptr": "*fp32" if per_pair else "*bf16"},
                             {**common, "K": inter, "BLOCK_K": min(256, triton.next_power_of_2(inter)),
                              "PER_PAIR": per_pair}))  # fmt: skip
        for fn, name, kinds, consts in launches:
            out.append({"kernel": fn.__name__, "shape": f"{model} {name}",
                        **compile_report(fn, kinds, consts, num_warps=4, num_stages=3)})  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args()
    reports = attention_reports() + gate_reports() + fp8_stream_reports() + moe_stream_reports()
    reports += fp4_moe_gemm_reports() + fp4_moe_stream_reports()
    for row in reports:
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
