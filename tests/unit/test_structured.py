"""Structured output on builtin:tiny-llama (random weights: only the constraint can make its outputs
valid): every output parses and validates / matches / is a choice, across temperatures, seeds, batches
that mix constrained and unconstrained requests, n = 3, the overlap schedule and preemption."""

from __future__ import annotations

import json
import re
import time

import pytest

from graphserve import LLM, SamplingParams
from graphserve import structured as so
from graphserve.errors import BadRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "tags", "ok"],
}
REGEX = r"[a-f]{2,4}-\d{3}(x|yz)"
CHOICES = ["yes", "no", "maybe later"]
GRAMMAR = 'root ::= "(" num (op num){0,3} ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "*"'
GRAMMAR_RE = re.compile(r"\([1-9][0-9]?([+*][1-9][0-9]?){0,3}\)")
TEMPS = [0.0, 0.7, 1.3]
PROMPTS = ["Hello", "The weather in", "A list:", "{"]


def validate(value, schema) -> None:
    """The subset of JSON Schema these tests use, checked strictly (no extra properties)."""
    if "enum" in schema:
        assert value in schema["enum"]
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict) and set(value) <= set(schema["properties"])
        assert set(schema.get("required", [])) <= set(value)
        for k, v in value.items():
            validate(v, schema["properties"][k])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
        for v in value:
            validate(v, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind == "boolean":
        assert isinstance(value, bool)
    else:
        raise AssertionError(f"unhandled schema type {kind}")


CASES = {
    "json_schema": (so.json_schema(SCHEMA, "guided_json"), lambda t: validate(json.loads(t), SCHEMA)),
    "regex": (so.regex(REGEX, "guided_regex"), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    "choice": (so.choice(CHOICES, "guided_choice"), lambda t: t in CHOICES or pytest.fail(t)),
    "grammar": (so.grammar(GRAMMAR, "guided_grammar"), lambda t: GRAMMAR_RE.fullmatch(t) or pytest.fail(t)),
}


@pytest.fixture(scope="module")
def llm():
    # the overlap schedule: a constrained step's masks are filled while its forward runs (the GPU default)
    return LLM("builtin:tiny-llama", max_model_len=256, num_kv_tokens=4096, overlap_schedule="on")


@pytest.fixture(autouse=True)
def no_leak(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.has_unfinished_requests()
        assert engine.core.structured.num_live == 0 and not engine.core.structured.compiling
        engine.core.block_manager.check_no_leak()


@pytest.mark.parametrize("kind", list(CASES))
def test_every_output_follows_its_constraint(llm, kind):
    constraint, check = CASES[kind]
    params, prompts = [], []
    for i, temp in enumerate(TEMPS):
        for seed in (1, 2):
            prompts.append(PROMPTS[(i + seed) % len(PROMPTS)])
            params.append(SamplingParams(max_tokens=120, temperature=temp, seed=seed, structured=constraint,
                                         n=3 if seed == 2 else 1, top_k=50 if temp > 1 else -1))
        # unconstrained neighbours in the same batches
        prompts.append(PROMPTS[i])
        params.append(SamplingParams(max_tokens=12, temperature=temp, seed=i, ignore_eos=True))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params):
        if p.structured is None:
            assert len(out.outputs[0].token_ids) == 12
            continue
        assert len(out.outputs) == p.n
        for o in out.outputs:
            assert o.finish_reason == "stop", (o.text, o.finish_reason)
            check(o.text)


def test_json_object_is_an_object_or_a_prefix_of_one(llm):
    import xgrammar as xgr

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=60, temperature=0.8, seed=3,
                                                structured=so.json_object("response_format")), use_tqdm=False)
    compiled = llm.engine.core.structured.compiler.submit(so.json_object("response_format")).result()
    for out in outs:
        text = out.outputs[0].text
        if out.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: what was written is still on the grammar's path
            assert out.finish_reason == "length" and xgr.GrammarMatcher(compiled).accept_string(text)


def test_serial_schedule_matches_overlap_for_the_same_seed(llm):
    """The serial schedule (the CPU default) fills masks between steps; same seeds, same tokens."""
    c = CASES["json_schema"][0]
    params = [SamplingParams(max_tokens=120, temperature=0.9, seed=7, structured=c), SamplingParams(max_tokens=5)]
    serial = LLM("builtin:tiny-llama", max_model_len=256, num_kv_tokens=4096, overlap_schedule="off")
    a = serial.generate(["Hi", "other"], params, use_tqdm=False)
    b = llm.generate(["Hi", "other"], params, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids and a[0].finish_reason == "stop"
    validate(json.loads(a[0].outputs[0].text), SCHEMA)


def test_preemption_keeps_grammars_in_step():
    # 12 requests of up to ~150 tokens in a pool of 640 tokens: running sequences are preempted and resumed
    llm = LLM("builtin:tiny-llama", max_model_len=256, num_kv_tokens=640, block_size=16, overlap_schedule="on")
    c = CASES["json_schema"][0]
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured=c) if s % 3 else
              SamplingParams(max_tokens=120, temperature=1.0, seed=s, ignore_eos=True) for s in range(12)]
    outs = llm.generate(["Tell me " * 3] * 12, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    for out, p in zip(outs, params):
        if p.structured is not None:
            assert out.finish_reason == "stop"
            validate(json.loads(out.outputs[0].text), SCHEMA)
    llm.engine.core.block_manager.check_no_leak()


def test_compile_timeout_fails_the_request_naming_the_field(llm):
    compiler = llm.engine.core.structured.compiler
    compile_now = compiler._compile

    def slow_compile(c):
        time.sleep(0.5)
        return compile_now(c)

    compiler.timeout_s, saved = 0.1, compiler.timeout_s
    compiler._compile = slow_compile
    try:
        fresh = so.regex(r"timeout-[0-9]{4}", "guided_regex")
        outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=10, structured=fresh),
                                         SamplingParams(max_tokens=4, ignore_eos=True)], use_tqdm=False)
    finally:
        compiler.timeout_s = saved
        del compiler._compile
    assert outs[0].error_param == "guided_regex" and "did not compile within" in outs[0].error
    assert outs[0].finish_reason == "abort" and len(outs[1].token_ids) == 4


def test_abort_while_compiling_and_while_running(llm):
    engine = llm.engine
    engine.add_request("compiling", "x", SamplingParams(max_tokens=50, structured=so.regex("[0-9]{40}", "regex")))
    engine.abort_request("compiling")
    engine.add_request("running", "x", SamplingParams(max_tokens=50, structured=so.regex("[0-9]{40}", "regex")))
    done = {}
    for _ in range(200):
        for out in engine.step():
            done[out.request_id] = out
        if "running" in engine.core.structured.compiling or not engine.core.scheduler.running:
            continue
        engine.abort_request("running")
        break
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert done["compiling"].finish_reason == "abort" and done["running"].finish_reason == "abort"


@pytest.mark.parametrize("build, field, reason", [
    (lambda: so.json_schema('{"type": ', "guided_json"), "guided_json", "not valid JSON"),
    (lambda: so.json_schema({"type": "wat"}, "guided_json"), "guided_json", "Unsupported type"),
    (lambda: so.json_schema({"type": "array", "uniqueItems": True}, "response_format"), "response_format",
     "'uniqueItems'"),
    (lambda: so.json_schema({"properties": {"a": {"not": {"type": "string"}}}}, "guided_json"), "guided_json",
     "#/properties/a"),
    (lambda: so.regex("a(b", "guided_regex"), "guided_regex", "parenthesis"),
    (lambda: so.grammar('root ::= foo', "guided_grammar"), "guided_grammar", 'Rule "foo" is not defined'),
    (lambda: so.choice([], "guided_choice"), "guided_choice", "non-empty list"),
])
def test_bad_constraints_name_the_field_and_the_reason(build, field, reason):
    with pytest.raises(BadRequestError) as err:
        build()
    assert err.value.param == field and reason in err.value.message and field in err.value.message
