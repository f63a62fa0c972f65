"""Structured output on the GPU path: CUDA-graph decode, the overlap schedule (masks filled while the
forward runs) and the mask applied on the device, with unconstrained rows in the same batches."""

from __future__ import annotations

import json
import re

import pytest
from test_structured import CASES, SCHEMA, validate

from graphserve import LLM, SamplingParams
from graphserve import structured as so


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny-llama", max_model_len=512)


def test_graph_decode_with_masks_keeps_every_constraint(llm):
    assert llm.engine.core.overlap and llm.engine.core.runner.graphs is not None
    prompts, params = [], []
    for i in range(24):
        kind = list(CASES)[i % len(CASES)]
        temp = (0.0, 0.8, 1.2)[i % 3]
        prompts.append(f"Request {i}:")
        params.append(SamplingParams(max_tokens=120, temperature=temp, seed=i, top_p=0.95 if temp else 1.0,
                                     structured=CASES[kind][0], n=2 if i % 5 == 0 else 1))
        prompts.append(f"Free {i}")
        params.append(SamplingParams(max_tokens=30, temperature=temp, seed=i, ignore_eos=True))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params):
        if p.structured is None:
            assert len(out.outputs[0].token_ids) == 30
            continue
        check = next(check for c, check in CASES.values() if c is p.structured)
        for o in out.outputs:
            assert o.finish_reason == "stop", o.text
            check(o.text)
    stats = llm.engine.core.telemetry.records()
    assert any(r.graph for r in stats), "no decode step replayed a CUDA graph"


def test_regex_and_schema_at_batch_64(llm):
    c = so.json_schema(SCHEMA, "guided_json")
    r = so.regex(r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)", "guided_regex")
    params = [SamplingParams(max_tokens=120, temperature=0.9, seed=s, structured=c if s % 2 else r) for s in range(64)]
    outs = llm.generate([f"p{s}" for s in range(64)], params, use_tqdm=False)
    for out, p in zip(outs, params):
        assert out.finish_reason == "stop"
        if p.structured is c:
            validate(json.loads(out.text), SCHEMA)
        else:
            assert re.fullmatch(r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)", out.text)
