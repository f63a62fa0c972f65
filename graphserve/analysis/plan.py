"""`graphserve plan MODEL ...`: the memory plan of a model and config before any GPU is touched,
and a verdict per concurrency: fits / preempts / queues / out of memory.

"out of memory" is the first story's crash: an engine that runs a decode batch above its largest
captured size eagerly (``--oversize eager``, what SGLang and vLLM do) allocates activations the
plan never reserved. graphserve splits such a batch into captured sizes (``--oversize split``,
the default), so its verdicts only depend on the KV pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from graphserve.analysis.plan_answer import answer
from graphserve.config import FP4_LOAD_AS, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig, default_cuda_graph_sizes
from graphserve.engine.memory import RESERVE_BYTES, gib, plan_memory, wanted_latent_pages
from graphserve.errors import BadRequestError, ModelLoadError, bad_field
from graphserve.layers.kv_layout import with_block_size, with_cache_dtype
from graphserve.layers.quant.config import parse_quantization_config, quantized_description, resolve_quantization
from graphserve.models.registry import describe_model, ignore_list

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32, "fp8": torch.float8_e4m3fn}
GiB_ = 1024**3
GB = 10**9  # GPU memory is sold in GB (H200: 141 GB); the plan prints GiB


def load_hf_config(model: str) -> dict[str, Any]:
    """A config.json path, a folder holding one, or a preset name such as ``dummy:llama3-8b``."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        hf = json.loads(path.read_text())
        if hf.get("quantization_config") is None:  # ModelOpt's quantization beside config.json, as the loader reads
            from graphserve.layers.quant.fp4_config import modelopt_file_config

            modelopt = modelopt_file_config(path.parent)
            if modelopt is not None:
                hf["quantization_config"] = modelopt
        return hf
    if ":" in model:
        from graphserve.models.presets import get_preset_config  # written alongside the models; load lazily

        cfg = get_preset_config(model.split(":", 1)[1] if model.startswith("dummy:") else model)
        return cfg if isinstance(cfg, dict) else cfg.to_dict()
    raise ModelLoadError(f"MODEL={model!r} is not a config.json, a model folder or a preset name (e.g. dummy:llama3-8b)",
                         param="model")


def _blocks(tokens: int, block: int) -> int:
    return math.ceil(tokens / block) * block


def build_plan(hf: dict[str, Any], *, gpu_memory_gb: float, tp: int = 1, ep: int = 1, mem_fraction_static: float = 0.88,
               cuda_graph_max_bs: int = 256, cuda_graph_bs: list[int] | None = None, disable_cuda_graph: bool = False,
               max_running_requests: int | None = None, input_len: int = 1024, output_len: int = 1024,
               dtype: str = "bf16", concurrency: list[int] | None = None, max_model_len: int | None = None,
               chunked_prefill_size: int = 2048, block_size: int = 16, reserve_gb: float = RESERVE_BYTES / GiB_,
               oversize: str = "split", quantization: str = "none", kv_cache_dtype_name: str = "auto",
               fp4_load_as: str = "none") -> dict[str, Any]:
    if dtype not in DTYPES:
        raise BadRequestError(f"--dtype={dtype!r} is invalid: choose one of {', '.join(DTYPES)}", param="dtype")
    if oversize not in ("split", "eager"):
        raise BadRequestError(f"--oversize={oversize!r} is invalid: choose split or eager", param="oversize")
    # an FP8 checkpoint's own quantization_config, else --quantization (what the loader applies)
    quant = resolve_quantization(parse_quantization_config(hf.get("quantization_config")), quantization)
    if fp4_load_as != "none":  # FP4 weights held as FP8: the converter's kernels load only where asked for
        from graphserve.layers.quant.fp4_to_fp8 import check_fp4_load_as, fp8_description

        check_fp4_load_as(fp4_load_as, quant, "the model")
        model = fp8_description(describe_model(hf, DTYPES[dtype], tp, ep), quant, DTYPES[dtype], ignore_list(hf, quant))
    else:
        model = quantized_description(describe_model(hf, DTYPES[dtype], tp, ep), quant, DTYPES[dtype],
                                      ignore_list(hf, quant))
    if kv_cache_dtype_name not in KV_CACHE_DTYPES:
        raise BadRequestError(f"--kv-cache-dtype={kv_cache_dtype_name!r} is invalid: choose one of "
                              f"{', '.join(KV_CACHE_DTYPES)}", param="kv_cache_dtype")
    kv = with_block_size(with_cache_dtype(model.kv, kv_cache_dtype_name), block_size)
    model = dataclasses.replace(model, kv=kv)
    sizes = [] if disable_cuda_graph else sorted(set(cuda_graph_bs or default_cuda_graph_sizes(cuda_graph_max_bs)))
    largest = sizes[-1] if sizes else 0
    max_running = max_running_requests or (largest or 256)
    max_len = max_model_len or int(hf.get("max_position_embeddings") or input_len + output_len)
    seq_len = input_len + output_len

    weights = model.weights_bytes
    kv_tok = model.kv.bytes_per_token
    chunk = min(chunked_prefill_size, max_running * input_len)
    index_scores = model.index_scores_bytes(chunk, max_len)  # a chunk's indexer at the longest context
    dequant = model.fp4_dequant_bytes(chunk)  # an FP4 projection dequantized for the prefill's matmul
    prefill_act = (model.activation_bytes(chunk, sampled_rows=max(1, math.ceil(chunk / input_len))) + index_scores
                   + dequant)  # fmt: skip
    # Graph-covered decode batches draw on the graph pool; the largest eager one is reserved here.
    eager_decode_bs = 0 if sizes and (oversize == "split" or max_running <= largest) else (largest or max_running)
    decode_act = model.activation_bytes(eager_decode_bs) if eager_decode_bs else 0
    # decode graphs are captured at the widest block tables: their indexer scores span --max-model-len
    pool = model.graph_pool_bytes(sizes) + model.index_scores_bytes(largest, max_len)
    mp = plan_memory(int(gpu_memory_gb * GB), mem_fraction_static, weights, (prefill_act, decode_act), pool,
                     int(reserve_gb * GiB_), kv_tok, block_size, max_len, max_running, tp=tp,
                     activation_parts=([("MoE workspace", model.moe_workspace_bytes(chunk))] if model.is_moe else []) +
                     ([("indexer scores", index_scores)] if index_scores else []) +
                     ([("FP4 dequant", dequant)] if dequant else []),
                     kv_parts=kv.parts(),
                     request_tokens=model.kv.held_tokens(max_len, block_size, chunked_prefill_size),
                     latent_bytes_per_token=kv.latent_bytes_per_token, latent_window=kv.latent_window or 0,
                     latent_pages=wanted_latent_pages(kv, block_size, max_running, chunked_prefill_size))

    verdicts = []
    # what one request holds at once: its length, or its window where every layer is windowed
    per_request = _blocks(model.kv.held_tokens(seq_len, block_size, chunked_prefill_size), block_size)
    for c in concurrency or [1, 8, 32, 64]:
        batch = min(c, max_running)
        need_tokens = batch * per_request
        v: dict[str, Any] = {"concurrency": c, "batch": batch, "kv_tokens_needed": need_tokens}
        notes = []
        if c > max_running:
            notes.append(f"queues: at most {max_running} run at once (--max-running-requests)")
        if batch > largest:
            if oversize == "split" and sizes:
                notes.append(f"batch {batch} > largest captured size {largest}: replayed as captured pieces")
            else:
                asked = model.activation_bytes(batch, context_tokens=batch * seq_len)
                planned = mp.activation_bytes + mp.reserve_bytes
                v["eager_bytes"], v["planned_bytes"] = asked, planned
                if asked > planned:
                    v["verdict"] = "out of memory"
                    notes.append(
                        f"batch {batch} > largest captured size {largest} runs eagerly and needs {gib(asked):.2f} GiB "
                        f"of activations; the plan reserved {gib(planned):.2f} GiB: raise --cuda-graph-max-bs to "
                        f">= {batch} or lower --max-running-requests to {largest or 1}")
        if "verdict" not in v:
            if not mp.fits:
                v["verdict"] = "out of memory"
                notes.append(mp.refusal or "")
            elif need_tokens > mp.kv_tokens:
                v["verdict"] = "preempts"
                held = mp.kv_tokens // per_request
                notes.append(f"KV pool holds {mp.kv_tokens} tokens = {held} requests of {seq_len} tokens, "
                             f"{batch} need {need_tokens}")
            else:
                v["verdict"] = "fits"
        v["notes"] = notes
        verdicts.append(v)
    plan = {
        "model": hf.get("_name_or_path") or hf.get("model_type"),
        "dtype": dtype, "quantization": quant.name if quant else "none",
        "kv_cache_dtype": str(kv.dtype).removeprefix("torch."), "tp": tp, "captured_sizes": sizes, "oversize": oversize,
        "weights_bytes": weights, "kv_bytes_per_token": kv_tok, "kv_index_bytes_per_token": kv.index_bytes_per_token,
        "graph_pool_bytes": pool,
        "prefill_activation_bytes": prefill_act, "decode_activation_bytes": decode_act,
        "memory": mp.to_dict(), "table": mp.table(), "verdicts": verdicts,
    }
    plan["answers"] = answer(plan, input_len, output_len)
    return plan



def format_plan(p: dict[str, Any]) -> str:
    m = p["memory"]
    lines = [
        f"weights per GPU      {gib(p['weights_bytes']):.2f} GiB (tp {p['tp']}, {p['dtype']}, "
        f"quantization {p['quantization']})",
        f"KV bytes per token   {p['kv_bytes_per_token']} B ({p['kv_cache_dtype']}"
        + (f"; indexer keys {p['kv_index_bytes_per_token']} B of it" if p.get("kv_index_bytes_per_token") else "")
        + (f"; the latent {m['latent_bytes_per_token']} B of it, held in pages for running windows only"
           if m.get("latent_pages") else "")
        + ")",
        f"cuda graph pool      {gib(p['graph_pool_bytes']):.2f} GiB for sizes "
        f"{p['captured_sizes'][:6]}{'...' if len(p['captured_sizes']) > 6 else ''} (largest {max(p['captured_sizes'], default=0)})",
        f"activation peak      prefill {gib(p['prefill_activation_bytes']):.3f} GiB, "
        f"eager decode {gib(p['decode_activation_bytes']):.3f} GiB",
        p["table"],
        f"KV capacity          {m['kv_tokens']} tokens; {m['max_concurrent_at_max_len']} requests at max length",
        "",
        f"{'C':>6}  {'verdict':<14} notes",
    ]
    for v in p["verdicts"]:
        lines.append(f"{v['concurrency']:>6}  {v['verdict']:<14} {'; '.join(v['notes'])}")
    lines += ["", *(a["text"] for a in p.get("answers", ()))]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="config.json, HF model folder, or preset (dummy:llama3-8b)")
    parser.add_argument("--gpu-memory-gb", type=float, default=141.0, help="GPU memory in GB (1e9 bytes)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (placement only)")
    parser.add_argument("--nnodes", type=int, default=1, help="machines the ranks span: what each GPU holds")
    parser.add_argument("--mem-fraction-static", type=float, default=0.88)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=256)
    parser.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--max-running-requests", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                        help="weights quantized at load (an FP8 checkpoint is counted in FP8 regardless)")
    parser.add_argument("--fp4-load-as", choices=FP4_LOAD_AS, default="none",
                        help="fp8: FP4 weights (an NVFP4/MXFP4 checkpoint or --quantization nvfp4/mxfp4) counted as "
                             "the FP8 the engine converts them to at load")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="KV cache dtype: auto (the model dtype) or fp8_e4m3")
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated concurrency levels")
    parser.add_argument("--max-model-len", "--context-length", dest="max_model_len", type=int, default=None,
                        help="the longest request the engine admits (SGLang's --context-length)")
    parser.add_argument("--chunked-prefill-size", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reserve-gb", type=float, default=RESERVE_BYTES / GiB_,
                        help="workspaces and allocator slack kept in the budget (GiB; the engine keeps the same)")
    parser.add_argument("--oversize", choices=("split", "eager"), default="split",
                        help="what runs a decode batch above the largest captured size: graphserve splits it; "
                             "eager models SGLang/vLLM")
    parser.add_argument("--json", action="store_true")


def check_args(args: argparse.Namespace) -> list[int]:
    """The engine's own flag checks (EngineConfig validates once, in one place) plus plan's; returns the levels."""
    # plan has no rendezvous: a placeholder address lets EngineConfig check the --nnodes split
    EngineConfig(tp=getattr(args, "tp", 1), ep=getattr(args, "ep", 1), nnodes=getattr(args, "nnodes", 1),
                 dist_init_addr="node0:29500" if getattr(args, "nnodes", 1) > 1 else None,
                 mem_fraction_static=args.mem_fraction_static, cuda_graph_max_bs=args.cuda_graph_max_bs,
                 cuda_graph_bs=tuple(args.cuda_graph_bs) if args.cuda_graph_bs else None, block_size=args.block_size,
                 chunked_prefill_size=args.chunked_prefill_size, max_model_len=args.max_model_len,
                 max_running_requests=args.max_running_requests)
    for name, value, ok, limit in [("gpu_memory_gb", args.gpu_memory_gb, args.gpu_memory_gb > 0, "must be > 0"),
                                   ("input_len", args.input_len, args.input_len >= 1, "must be >= 1"),
                                   ("output_len", args.output_len, args.output_len >= 1, "must be >= 1"),
                                   ("reserve_gb", args.reserve_gb, args.reserve_gb >= 0, "must be >= 0")]:
        if not ok:
            raise bad_field(name, value, limit)
    try:
        conc = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    except ValueError as e:
        raise bad_field("concurrency", args.concurrency, "use integers like 1,8,32") from e
    if not conc or min(conc) < 1:
        raise bad_field("concurrency", args.concurrency, "every level must be >= 1")
    return conc


def run(args: argparse.Namespace) -> int:
    conc = check_args(args)
    p = build_plan(load_hf_config(args.model), gpu_memory_gb=args.gpu_memory_gb, tp=args.tp, ep=getattr(args, "ep", 1),
                   mem_fraction_static=args.mem_fraction_static, cuda_graph_max_bs=args.cuda_graph_max_bs,
                   cuda_graph_bs=args.cuda_graph_bs, disable_cuda_graph=args.disable_cuda_graph,
                   max_running_requests=args.max_running_requests, input_len=args.input_len, output_len=args.output_len,
                   dtype=args.dtype, concurrency=conc, max_model_len=args.max_model_len,
                   chunked_prefill_size=args.chunked_prefill_size, block_size=args.block_size,
                   reserve_gb=args.reserve_gb, oversize=args.oversize, quantization=args.quantization,
                   kv_cache_dtype_name=args.kv_cache_dtype,
                   fp4_load_as=getattr(args, "fp4_load_as", "none"))
    ep, nnodes = getattr(args, "ep", 1), getattr(args, "nnodes", 1)
    text = format_plan(p)
    if max(args.tp, ep) > 1:
        from graphserve.analysis.plan_nodes import format_placement, placement

        p["placement"] = placement(load_hf_config(args.model), args.tp, ep, nnodes, p["weights_bytes"])
        text += "\n" + format_placement(p["placement"], args.tp, ep, nnodes)
    print(json.dumps(p, indent=2) if args.json else text)
    # Non-zero when the engine would refuse to start or a concurrency would crash it.
    return 0 if p["memory"]["fits"] and all(v["verdict"] != "out of memory" for v in p["verdicts"]) else 1
