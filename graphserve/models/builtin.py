"""``builtin:<name>``: small random-weight checkpoints with a real trained tokenizer.

Made deterministically (fixed seeds, a tokenizer trained on an embedded corpus) on first use,
written as an ordinary Hugging Face folder and then loaded through the normal folder path, so
transformers can load the same files. The folder appears atomically (built in a temporary
sibling, then renamed), so parallel processes racing to create it never see half a checkpoint.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

from graphserve import env
from graphserve.errors import ModelLoadError
from graphserve.models.builtin_corpus import CORPUS

TINY_SPECIALS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def cache_root() -> Path:
    return env.path("GRAPHSERVE_CACHE") / "builtin"


def train_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the embedded corpus; same input, same merges, every run."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        min_frequency=1,
        special_tokens=TINY_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=TINY_CHAT_TEMPLATE
    )


def tiny_llama_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def tiny_llama_weights(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the checkpoint's names.

    Projections use std 0.02 (activations stay finite); embeddings and head use a larger std
    so the logits spread out and greedy decoding does not collapse onto one token.
    """
    g = torch.Generator().manual_seed(seed)
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": normal(v, h, std=1.0), "model.norm.weight": torch.ones(h),
         "lm_head.weight": normal(v, h, std=0.2)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
              p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
              p + "mlp.gate_proj.weight": normal(f, h), p + "mlp.up_proj.weight": normal(f, h),
              p + "mlp.down_proj.weight": normal(h, f),
              p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)}
    return w


def write_tiny_llama(folder: Path) -> None:
    tokenizer = train_tiny_tokenizer()
    config = tiny_llama_config(len(tokenizer))
    config.save_pretrained(folder)
    save_file(tiny_llama_weights(config), str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(folder)


BUILTINS: dict[str, Callable[[Path], None]] = {"tiny-llama": write_tiny_llama}


def ensure_builtin(name: str) -> Path:
    """Return the folder of ``builtin:<name>``, creating it on first use."""
    if name not in BUILTINS:
        from graphserve.models.trained import TRAINED  # trained checkpoints come as GGUF files, not folders

        raise ModelLoadError(
            f"model='builtin:{name}' is unknown: choose one of "
            f"{', '.join('builtin:' + b for b in sorted([*BUILTINS, *TRAINED]))}",
            param="model",
        )
    folder = cache_root() / name
    if folder.is_dir():
        return folder  # only ever appears complete, through the rename below
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        BUILTINS[name](tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():
                raise
            # another process finished first: its copy is identical, keep it
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
