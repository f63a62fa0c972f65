"""A deterministic tokenizer covering an arbitrary vocabulary, for random-weight models.

Special tokens sit at the ids the real model uses; the 256 byte-level symbols fill the next
free ids, so any text encodes (byte by byte) and decodes back exactly; every remaining id is a
word-like token ``" w<id>"``, its id zero-padded to the width of the largest, so random token ids
still decode to readable text.

Text clients of a benchmark (SGLang's bench_serving random-ids, vLLM's random dataset) draw token ids,
decode them and send the text, which the server encodes again: the prompt arrives at the length asked only
if that round trip gives the same ids. So a word encodes back to its own id, never to its bytes: a split
isolates every ``" w"`` + fixed-width digits (the fixed width keeps a digit byte that follows a word from
joining it), and the BPE takes a piece that is a whole vocabulary entry as that entry (``ignore_merges``).
The exception is the 128 byte tokens 0x80-0xFF, parts of multi-byte characters: one drawn alone decodes to
U+FFFD, which no encoding can tell from a real U+FFFD. Its bytes are merged into one token, so such a prompt
still arrives at its length with that one id changed (two such bytes side by side may form a real character,
and then both ids survive); so does the token of U+FFFD's first two bytes. They are 129 of a preset's 32k-152k
ids.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

REPLACEMENT = "\u00ef\u00bf\u00bd"  # U+FFFD in UTF-8 (EF BF BD), as byte-level symbols
REPLACEMENT_PAIR = REPLACEMENT[:2]

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
    if vocab_size < len(special_tokens) + 258:
        raise ValueError(f"vocab_size={vocab_size} is too small: needs 256 byte tokens, 2 for U+FFFD and "
                         f"{len(special_tokens)} specials")
    vocab: dict[str, int] = {text: i for i, text in special_tokens.items()}
    free = (i for i in range(vocab_size) if i not in special_tokens)
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = next(free)
    # U+FFFD's bytes EF BF BD (byte-level "ï¿½") merge into one token, as does their first pair: a lone byte of a
    # multi-byte character decodes to U+FFFD and so encodes back to one token, the prompt's length kept
    vocab[REPLACEMENT_PAIR] = next(free)
    vocab[REPLACEMENT] = next(free)
    width = len(str(vocab_size - 1))
    for i in free:
        vocab[f"\u0120w{i:0{width}d}"] = i  # \u0120 is the byte-level symbol for a space
    merges = [(REPLACEMENT[0], REPLACEMENT[1]), (REPLACEMENT_PAIR, REPLACEMENT[2])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(f" w[0-9]{{{width}}}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens.values()))
    # no clean-up: it deletes the space before punctuation, and a decoded prompt must encode back to its ids
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos_token, eos_token=eos_token, chat_template=chat_template,
        clean_up_tokenization_spaces=False,
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
