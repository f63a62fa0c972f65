"""The five tables as ``TablePlan``s over the measurement functions of graphserve/tuning/gemv.py, fp8_route.py,
mla.py, moe_tune.py, fp4.py and fp4_moe.py (``python3 -m benchmarks.gemv`` and the others run the same modules): the same
timings and rule derivations that wrote the shipped tables, cut into units so that ``graphserve tune`` can bound
each table's time. They run on the GPU only; each module is imported when its plan is built.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from graphserve.tuning.runner import TablePlan

TABLES = ("gemv", "fp8", "mla", "moe", "fp4")
# the presets whose shapes the shipped tables cover; --quick takes the first two
DEFAULT_MODELS = ("dummy:llama3-8b", "dummy:qwen3-30b-a3b", "dummy:qwen3-0.6b", "dummy:mixtral-8x7b",
                  "dummy:deepseek-v2-lite")  # fmt: skip
QUICK_MODELS = DEFAULT_MODELS[:2]
MLA_HEADS = (16, 128)  # the head counts benchmarks/mla.py has candidate tiles for


def bare(model: str) -> str:
    return model.removeprefix("dummy:")


@functools.lru_cache(maxsize=1)
def environment() -> dict:
    from graphserve.tuning.timing import environment as env

    return env()


def gemv_plan(models: list[str], quick: bool) -> TablePlan | None:
    from graphserve.kernels.common import sm_count
    from graphserve.tuning import gemv as bench

    shapes = list(dict.fromkeys(s for m in models for s in bench.MODEL_SHAPES.get(m, ())))
    if not shapes:
        return None
    sms = sm_count(torch.device("cuda"))

    def measure(name: str, _left: float) -> dict:
        rows = [bench.bench_shape(name, m, sms) for m in bench.BATCHES]
        fused = [bench.bench_fused(name, m) for m in bench.BATCHES] if name.endswith("down") else []
        if name.endswith(("qkv", "gate_up")) and name not in bench.PLAIN_GATE_UP:
            fused += [bench.bench_norm(name, m) for m in bench.BATCHES]
        return {"rows": rows, "fused": fused}

    def finish(results: list[tuple[str, Any]], earlier) -> list[tuple[str, dict]]:
        payload = {"rows": [r for _, res in results for r in res["rows"]],
                   "fused": [r for _, res in results for r in res["fused"]], "environment": environment()}
        rule = bench.rule_from_results(payload)
        before = earlier("gemv_rule.json") or {}
        measured = {s["name"] for s in rule["shapes"]}
        rule["shapes"] = [s for s in before.get("shapes", []) if s["name"] not in measured] + rule["shapes"]
        return [("gemv_rule.json", rule)]

    return TablePlan("gemv", shapes, measure, finish)


def fp8_plan(models: list[str], quick: bool) -> TablePlan | None:
    from graphserve.kernels.common import sm_count
    from graphserve.kernels.fp8_gemm import blockwise_scaled_mm_available
    from graphserve.tuning import fp8_route as bench

    # mixtral-8x7b's attention has llama3-8b's projections
    prefixes = {bare(m).replace("mixtral-8x7b", "llama3-8b") for m in models}
    names = [n for n in bench.SHAPES if n.split()[0] in prefixes]
    units = [f"{n} {scales}" for scales in (("block128",) if quick else ("block128", "channel")) for n in names]
    if not units:
        return None
    device = torch.device("cuda")
    sms, scaled_mm_ok = sm_count(device), blockwise_scaled_mm_available(device)
    counts = bench.QUICK_ROWS if quick else bench.ROWS

    def measure(unit: str, _left: float) -> list[dict]:
        name, scales = unit.rsplit(" ", 1)
        return bench.measure(name, counts, not quick, scaled_mm_ok, sms, scales == "channel")

    def finish(results: list[tuple[str, Any]], earlier) -> list[tuple[str, dict]]:
        rows = [r for _, res in results for r in res]
        return [("fp8_rule.json", bench.rule_from_rows(rows, environment(), earlier("fp8_rule.json")))]

    return TablePlan("fp8", units, measure, finish)


def mla_heads(model: str) -> int | None:
    """The MLA sweep's head count nearest the preset's (None: the preset has no latent attention)."""
    from graphserve.models.presets import PRESETS

    config = PRESETS.get(bare(model), {}).get("config", {})
    if not config.get("kv_lora_rank"):
        return None
    heads = int(config["num_attention_heads"])
    return min(MLA_HEADS, key=lambda h: abs(h.bit_length() - heads.bit_length()))


def mla_plan(models: list[str], quick: bool) -> TablePlan | None:
    from graphserve.tuning import mla as bench
    from graphserve.tuning.roofline import measured_read_bw

    heads = sorted({h for m in models if (h := mla_heads(m))})
    if not heads:
        return None
    points = bench.QUICK_POINTS if quick else bench.SWEEP_POINTS
    caches = ("bf16",) if quick else ("bf16", "fp8")
    units = [f"heads={h} bs={b} ctx={c} cache={cache}" for cache in caches for h in heads
             for b in points[h][0] for c in points[h][1]]  # fmt: skip
    state: dict[str, Any] = {}

    def measure(unit: str, _left: float) -> list[dict]:
        if "bw" not in state:
            state["bw"] = measured_read_bw()
        h, b, c, cache = (part.split("=")[1] for part in unit.split())
        rows: list[dict] = []
        dtype = torch.float8_e4m3fn if cache == "fp8" else bench.DT
        bench.sweep(state["bw"], quick, rows, dtype, points={int(h): ([int(b)], [int(c)])})
        torch.cuda.empty_cache()
        return rows

    def finish(results: list[tuple[str, Any]], earlier) -> list[tuple[str, dict]]:
        rows = [r for _, res in results for r in res]
        bench.finish(rows, state["bw"])
        payload = {"environment": environment(), "winners": bench.winners(rows)}
        return [("mla_tiles.json", bench.rule_from_sweep(payload, earlier("mla_tiles.json")))]

    return TablePlan("mla", units, measure, finish)


def moe_plan(models: list[str], quick: bool, shapes: list[tuple[int, int, int, int]] = (),
             dtypes: tuple[str, ...] | None = None) -> TablePlan | None:  # fmt: skip
    """Expert shapes (experts, hidden, intermediate, top_k) of the models' presets and ``shapes``, per dtype."""
    from graphserve.kernels.moe_config import device_name, table_path
    from graphserve.tuning import moe_tune as bench

    found = [bench.SHAPES[bare(m)] for m in models if bare(m) in bench.SHAPES] + list(shapes)
    dtypes = dtypes or (("bfloat16",) if quick else ("bfloat16", "float8_e4m3fn"))
    units = [f"E={e} H={h} I={i} k={k} {d}" for d in dtypes for e, h, i, k in dict.fromkeys(found)]
    if not units:
        return None
    card = device_name(torch.device("cuda"))

    def measure(unit: str, left: float) -> tuple[str, dict]:
        e, h, i, k = (int(part.split("=")[1]) for part in unit.split()[:4])
        dtype = unit.split()[4]
        tiles, rows = bench.tune(e, h, i, k, getattr(torch, dtype), quick, max(left, 1.0))
        run = environment()
        rows = [{**r, "measured_at": run} for r in rows]
        name = table_path(e, i, h, getattr(torch, dtype), card).name
        return f"moe_configs/{name}", bench.table_payload(e, i, h, k, dtype, card, quick, run, tiles, rows)

    def finish(results: list[tuple[str, Any]], earlier) -> list[tuple[str, dict]]:
        return [res for _, res in results]

    return TablePlan("moe", units, measure, finish)


FP4_EXPERT_MODELS = ("dummy:deepseek-v4-flash-l6", "dummy:gpt-oss-120b", "dummy:qwen3-30b-a3b", "dummy:gpt-oss-20b")
QUICK_FP4_EXPERT_MODELS = FP4_EXPERT_MODELS[::2]
EXPERTS_UNIT = "experts "
# the presets whose dense projections the FP4 rule and GEMM tiles cover where no model is named: Llama-3-8B's four,
# gpt-oss's attention (its 120b has the 20b's)
FP4_DENSE_MODELS = ("dummy:llama3-8b", "dummy:gpt-oss-20b")
DENSE_UNIT = "dense "


def fp4_dense_units(models: list[str]) -> list[str]:
    """One unit per dense FP4 projection shape of ``models`` (graphserve/tuning/fp4_gemm.dense_shapes), each shape
    once: ``dense <preset> <projection>``."""
    from graphserve.tuning import fp4_gemm

    units: dict[tuple[int, int], str] = {}
    for m in models:
        for proj, shape in fp4_gemm.dense_shapes(m).items():
            units.setdefault(shape, f"{DENSE_UNIT}{bare(m)} {proj}")
    return list(units.values())


def fp4_plan(models: list[str], quick: bool) -> TablePlan | None:
    """The dense FP4 GEMM's units (each dense projection shape of ``models``: the rule's stream and variant crossovers
    and the GEMM tiles, graphserve/tuning/fp4_gemm.py) and the FP4 expert tiles' (one per preset whose experts
    graphserve/tuning/fp4_moe.py knows); where no model was named (``models`` is the default list), the FP4
    presets' (FP4_DENSE_MODELS, FP4_EXPERT_MODELS; --quick the first of each)."""
    from graphserve.kernels.common import sm_count
    from graphserve.tuning import fp4 as bench
    from graphserve.tuning import fp4_gemm, fp4_moe

    default = tuple(models) in (DEFAULT_MODELS, QUICK_MODELS)
    dense_models = list(FP4_DENSE_MODELS[:1] if quick else FP4_DENSE_MODELS) if default else models
    named = models if not default else QUICK_FP4_EXPERT_MODELS if quick else FP4_EXPERT_MODELS
    dense = fp4_dense_units(dense_models)
    experts = [EXPERTS_UNIT + bare(m) for m in named if bare(m) in fp4_moe.SHAPES]
    if not dense and not experts:
        return None
    card = torch.cuda.get_device_name(0)

    def measure(unit: str, left: float) -> list[dict]:
        if unit.startswith(EXPERTS_UNIT):
            return fp4_moe.measure_shape(unit.removeprefix(EXPERTS_UNIT), max(left, 1.0), quick)
        model, proj = unit.removeprefix(DENSE_UNIT).split()
        return fp4_gemm.measure_projection(model, proj, max(left, 1.0), quick, sm_count(torch.device("cuda")), card)

    def finish(results: list[tuple[str, Any]], earlier) -> list[tuple[str, dict]]:
        files = []
        rows = [r for unit, res in results if unit.startswith(DENSE_UNIT) for r in res]
        if rows:
            measured = {(r["n"], r["k"]) for r in rows}
            rule = bench.derive_rule(rows, card)
            kept = [s for s in (earlier("fp4_rule.json") or {}).get("shapes", []) if (s["n"], s["k"]) not in measured]
            rule["shapes"] = kept + rule["shapes"]
            files.append(("fp4_rule.json", rule))
            tiles = fp4_gemm.table_from(rows, earlier(fp4_gemm.TABLE_FILE), card)
            if tiles is not None:
                files.append((fp4_gemm.TABLE_FILE, tiles))
        shapes = {unit.removeprefix(EXPERTS_UNIT): res for unit, res in results if unit.startswith(EXPERTS_UNIT)}
        if shapes:
            files.append((fp4_moe.TABLE_FILE, fp4_moe.table_from(shapes, earlier(fp4_moe.TABLE_FILE), card)))
        return files

    return TablePlan("fp4", dense + experts, measure, finish)


def build_plans(tables: list[str], models: list[str], quick: bool, moe_shapes: list[tuple[int, int, int, int]],
                moe_dtypes: tuple[str, ...] | None) -> list[TablePlan]:  # fmt: skip
    """The plans of ``tables`` that have units for these models (a table no model uses is left out)."""
    makers = {"gemv": lambda: gemv_plan(models, quick), "fp8": lambda: fp8_plan(models, quick),
              "mla": lambda: mla_plan(models, quick), "fp4": lambda: fp4_plan(models, quick),
              "moe": lambda: moe_plan(models, quick, moe_shapes, moe_dtypes)}  # fmt: skip
    return [plan for t in tables if (plan := makers[t]()) is not None]
