"""The offline API: LLM.generate / LLM.chat on builtin:tiny-llama, and every bad input rejected
with an error naming the field, the value and the limit, leaving no block allocated."""

from __future__ import annotations

import pytest

from graphserve import LLM, EngineConfig, SamplingParams
from graphserve.errors import BadRequestError, ConfigError, ModelLoadError
from graphserve.outputs import RequestOutput

MAX_LEN = 64


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny-llama", max_model_len=MAX_LEN)


@pytest.fixture(autouse=True)
def no_leak(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.has_unfinished_requests()
        engine.core.block_manager.check_no_leak()


def test_generate_text_prompts_in_input_order(llm):
    prompts = ["Hello, my name is", "The sky", "A"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts and all(isinstance(o, RequestOutput) for o in outs)
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" and isinstance(o.text, str) for o in outs)
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode(prompts[0])
    single = llm.generate("The sky", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert single[0].token_ids == outs[1].token_ids


def test_per_prompt_params_and_default_params(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=2, ignore_eos=True),
                                     SamplingParams(max_tokens=5, ignore_eos=True)], use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [2, 5]
    default = llm.generate(["a"], use_tqdm=False)[0]
    assert 1 <= len(default.token_ids) <= SamplingParams().max_tokens


def test_max_tokens_none_runs_to_the_context_limit(llm):
    prompt = {"prompt_token_ids": [5] * 60}
    out = llm.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == MAX_LEN - 60 and out.finish_reason == "length"


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "Hi there"}]
    text = llm.engine.apply_chat_template(messages)
    assert "Hi there" in text and text.endswith("<|assistant|>\n")
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1 and out[0].prompt == text
    assert out[0].prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "yo"}]],
                   SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(two) == 2


@pytest.mark.parametrize(
    ("prompt", "params", "words"),
    [
        ({"prompt_token_ids": [5] * (MAX_LEN + 1)}, None, ["65 tokens", f"max_model_len={MAX_LEN}", "--max-model-len"]),
        ("", None, ["prompt", "empty"]),
        ({"prompt_token_ids": []}, None, ["prompt", "at least one token"]),
        ({"prompt_token_ids": [1, 99999]}, None, ["prompt_token_ids", "99999", "in [0, "]),
        ({"prompt_token_ids": [-1]}, None, ["prompt_token_ids", "-1"]),
        ({"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=5), ["max_tokens=5", "60", "room for 4"]),
        ({"prompt_token_ids": [5] * MAX_LEN}, SamplingParams(max_tokens=None), ["max_tokens", "room for 0"]),
    ],
)
def test_bad_prompts_are_rejected(llm, prompt, params, words):
    with pytest.raises(BadRequestError) as err:
        llm.generate([{"prompt_token_ids": [5, 6]}, prompt], params, use_tqdm=False)
    for w in words:
        assert w in err.value.message
    assert llm.engine.core.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", -3, ">= 1"),
        ("temperature", -0.5, ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -2, "-1"),
        ("n", 0, ">= 1"),
        ("logprobs", 21, "[0, 20]"),
    ],
)
def test_bad_sampling_params_are_rejected(field, value, limit):
    with pytest.raises(BadRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and f"{field}={value!r}" in err.value.message and limit in err.value.message


def test_params_changed_after_construction_are_revalidated(llm):
    params = SamplingParams()
    params.temperature = -1.0
    with pytest.raises(BadRequestError, match="temperature"):
        llm.generate(["x"], params, use_tqdm=False)


def test_request_larger_than_the_kv_pool_is_rejected(tmp_path):
    small = LLM("builtin:tiny-llama", num_kv_tokens=32, block_size=16)
    with pytest.raises(BadRequestError, match="--num-kv-tokens"):
        small.generate([{"prompt_token_ids": [5] * 20}], SamplingParams(max_tokens=20), use_tqdm=False)
    small.engine.core.block_manager.check_no_leak()


def test_bad_model_sources(tmp_path):
    with pytest.raises(ModelLoadError, match="not a folder"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="config.json"):
        LLM(str(tmp_path))
    with pytest.raises(ConfigError, match="chunked-prefill-size"):
        EngineConfig(chunked_prefill_size=4, block_size=16)
