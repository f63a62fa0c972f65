"""GGUF checkpoints (llama.cpp's single-file format): metadata -> config.json fields, tensors -> checkpoint names,
dequantized to float at load, and the tokenizer and chat template from the file's metadata.

The ``gguf`` package reads the file. Quantized tensors are widened to the model dtype at load: no kernel here reads
GGUF blocks, so the file's quantization error is kept and its memory saving is not. Llama's GGUF files store q/k
rows interleaved for llama.cpp's rotary (convert_hf_to_gguf permutes them); the loader undoes that so the rows meet
the half-split rotary the family uses, as transformers' GGUF loader does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphserve.errors import ModelLoadError

# the types tests/models/test_gguf.py writes and checks against transformers; gguf.quants dequantizes more, untested here
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def is_gguf(source: str) -> bool:
    return source.lower().endswith(".gguf")


class GGUFFile:
    """One GGUF file opened for reading (memory-mapped); every refusal names the file and the field or tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ModelLoadError(f"GGUF file {self.path} does not exist", param="model")
        try:
            import gguf
        except ImportError as e:
            raise ModelLoadError(f"reading {self.path} needs the gguf package: pip install gguf", param="model") from e
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 - the reader raises ValueError, IndexError, struct/numpy errors
            raise ModelLoadError(f"GGUF file {self.path} is corrupt or truncated: {type(e).__name__}: {e}",
                                 param="model") from e
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(f"GGUF file {self.path}: general.architecture={self.arch!r} is not supported: "
                                 f"choose one of {', '.join(sorted(ARCHITECTURES))}", param="model")
        self._check_tensors()

    def field(self, key: str, default: Any = ...) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            if default is ...:
                raise ModelLoadError(f"GGUF file {self.path} lacks the metadata field {key}", param="model")
            return default
        try:
            return f.contents()
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"GGUF file {self.path}: metadata field {key} cannot be read: {e}",
                                 param="model") from e

    def _check_tensors(self) -> None:
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            kind = t.tensor_type.name
            if kind not in SUPPORTED_TYPES:
                raise ModelLoadError(f"GGUF file {self.path}: tensor {t.name} has quantization type {kind}, which is "
                                     f"not supported: choose one of {', '.join(SUPPORTED_TYPES)}", param="model")
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise ModelLoadError(f"GGUF file {self.path} is truncated: tensor {t.name} needs bytes "
                                     f"[{t.data_offset}, {t.data_offset + t.n_bytes}) of a {size}-byte file",
                                     param="model")

    def hf_config(self) -> dict[str, Any]:
        """config.json's fields, from the ``<arch>.*`` metadata as transformers' GGUF loader maps them."""
        a = self.arch
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        tokens = self.field("tokenizer.ggml.tokens")
        scaling = self.field(f"{a}.rope.scaling.type", None)
        if scaling not in (None, "none"):
            raise ModelLoadError(f"GGUF file {self.path}: {a}.rope.scaling.type={scaling!r} is not supported "
                                 f"(only unscaled rotary)", param="model")
        head_dim = self.field(f"{a}.attention.key_length", None) or \
            (self.field(f"{a}.rope.dimension_count", None) if a == "llama" else None) or hidden // heads
        tensors = {t.name: t for t in self.reader.tensors}
        if "rope_freqs.weight" in tensors:  # llama.cpp's form of Llama 3.1's rope scaling: per-frequency factors
            raise ModelLoadError(f"GGUF file {self.path}: tensor rope_freqs.weight (Llama 3.1-style rope scaling) "
                                 f"is not supported", param="model")
        if "token_embd.weight" not in tensors:
            raise ModelLoadError(f"GGUF file {self.path} lacks the tensor token_embd.weight", param="model")
        rows = int(tensors["token_embd.weight"].shape[-1])  # may exceed the token list (padded), never fall short
        if len(tokens) > rows:
            raise ModelLoadError(f"GGUF file {self.path}: tokenizer.ggml.tokens holds {len(tokens)} tokens, more than "
                                 f"token_embd.weight's {rows} rows", param="model")
        names = set(tensors)
        cfg = {
            "architectures": [ARCHITECTURES[a]],
            "model_type": a,
            "vocab_size": rows,
            "hidden_size": hidden,
            "intermediate_size": int(self.field(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self.field(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(head_dim),
            "max_position_embeddings": int(self.field(f"{a}.context_length")),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id", None),
            "dtype": "bfloat16",
        }
        if a == "llama":
            cfg["attention_bias"] = "blk.0.attn_q.bias" in names
        return cfg

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor in ``dtype``) for every tensor; GGUF's dims run fastest-first, torch's last."""
        from gguf.quants import dequantize

        cfg = self.hf_config()
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                raise ModelLoadError(f"GGUF file {self.path}: tensor {t.name} has no place in "
                                     f"{ARCHITECTURES[self.arch]}", param="model")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if self.arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
                heads = cfg["num_attention_heads"] if ".attn_q." in t.name else cfg["num_key_value_heads"]
                w = unpermute_rotary(w, heads)
            yield name, torch.from_numpy(np.array(w, copy=True)).to(dtype)

    def tokenizer(self) -> Any:
        """The file's tokenizer (transformers converts the ``tokenizer.ggml.*`` metadata), converted once and cached
        as an ordinary tokenizer folder beside the builtin checkpoints: the conversion takes seconds, a load does not."""
        from transformers import AutoTokenizer

        folder = tokenizer_cache(self.path)
        if not folder.is_dir():
            try:
                tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
            except Exception as e:  # noqa: BLE001 - the converter raises many kinds on bad metadata
                raise ModelLoadError(f"GGUF file {self.path}: tokenizer.ggml.* metadata cannot be converted: {e}",
                                     param="model") from e
            # transformers' GGUF converter takes eos from bos_token_id; the file's own ids are the truth
            for key, attr in (("tokenizer.ggml.bos_token_id", "bos_token"), ("tokenizer.ggml.eos_token_id", "eos_token")):
                i = self.field(key, None)
                if i is not None:
                    setattr(tok, attr, tok.convert_ids_to_tokens(int(i)))
            # transformers ignores clean-up for a BPE tokenizer, and warns at every load where it is set
            tok.clean_up_tokenization_spaces = False
            template = self.field("tokenizer.chat_template", None)
            if template is not None:
                tok.chat_template = template
            tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
            tok.save_pretrained(str(tmp))
            try:
                tmp.rename(folder)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a GGUF file; from its converted copy when there is one, without parsing the file (a server's
    front-end and a bench client load it so, beside the engine that reads the weights)."""
    path = Path(path).expanduser()
    if path.is_file():
        folder = tokenizer_cache(path)
        if folder.is_dir():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return GGUFFile(path).tokenizer()


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's q/k permutation: per head, rows (pair, 2) -> (2, pair)."""
    pair = w.shape[0] // heads // 2
    return w.reshape(heads, pair, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_cache(path: Path) -> Path:
    """A folder per file content (path, size and mtime stand in for it): a replaced file gets a fresh tokenizer."""
    from graphserve.models.builtin import cache_root

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = cache_root().parent / "gguf-tokenizers"
    root.mkdir(parents=True, exist_ok=True)
    return root / f"{path.stem}-{key}"
