"""A deterministic tokenizer covering an arbitrary vocabulary, for random-weight models.

Special tokens sit at the ids the real model uses; the 256 byte-level symbols fill the next
free ids, so any text encodes (byte by byte) and decodes back exactly; every remaining id is a
word-like token ``" w<id>"`` so random token ids still decode to readable text.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def build_synthetic_tokenizer(
    vocab_size: int,
    special_tokens: dict[int, str],
    bos_token: str | None,
    eos_token: str,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    if any(not 0 <= i < vocab_size for i in special_tokens):
        raise ValueError(f"special token ids {sorted(special_tokens)} must lie in [0, {vocab_size})")
    if vocab_size < len(special_tokens) + 256:
        raise ValueError(f"vocab_size={vocab_size} is too small: needs 256 byte tokens + {len(special_tokens)} specials")
    vocab: dict[str, int] = {text: i for i, text in special_tokens.items()}
    free = (i for i in range(vocab_size) if i not in special_tokens)
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = next(free)
    for i in free:
        vocab[f"\u0120w{i}"] = i  # \u0120 is the byte-level symbol for a space
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens.values()))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos_token, eos_token=eos_token, chat_template=chat_template
    )

MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% endfor %}"
)

# gpt-oss's harmony messages, without channels: <|start|>role<|message|>content<|end|>
HARMONY_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)

CHAT_TEMPLATES = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE,
                  "harmony": HARMONY_TEMPLATE}
