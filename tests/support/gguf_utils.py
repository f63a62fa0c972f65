"""Small GGUF files written by the ``gguf`` package's writer: random weights in every accepted quantization type, a
byte-level BPE tokenizer and a chat template in the metadata, as llama.cpp's converter lays them out."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ w", "o r", "e r"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# one matrix per type in each layer, rotated by layer, so a two-layer file holds every type the loader accepts
LAYER_TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "F16", "BF16"]
MATRICES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable symbol table (what ``tokenizer.ggml.tokens`` holds for a ``gpt2`` model)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def vocab() -> list[str]:
    tokens = list(SPECIALS) + byte_alphabet()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    return tokens


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw K-quant blocks (the gguf package quantizes to neither Q4_K nor Q6_K): random codes, with the f16 scales
    set so the weights lie near +-0.05."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    if qtype == "Q4_K":  # d, dmin (f16), scales[12], qs[128]
        data[..., 0:2] = np.full((rows, cols // block, 1), 6e-5, np.float16).view(np.uint8)
        data[..., 2:4] = np.full((rows, cols // block, 1), 3e-5, np.float16).view(np.uint8)
    else:  # Q6_K: ql[128], qh[64], scales[16] (int8), d (f16)
        data[..., 208:210] = np.full((rows, cols // block, 1), 1e-5, np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def encode(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q4_K", "Q6_K"):
        return random_blocks(qtype, w.shape[0], w.shape[1], rng), kind
    if qtype == "F32":
        return w.astype(np.float32), kind
    if qtype == "F16":
        return w.astype(np.float16), kind
    return gguf.quants.quantize(w.astype(np.float32), kind), kind


def permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k permutation for llama (the loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str = "llama", hidden: int = 256, inter: int = 512, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, seed: int = 0, types: list[str] | None = None,
               tied: bool = False, embed_type: str = "Q8_0", skip_tensor: str | None = None,
               metadata: dict | None = None, extra: dict | None = None) -> Path:
    """A ``arch`` model (llama, qwen2, qwen3) with random weights. ``types`` replaces LAYER_TYPES; ``skip_tensor``
    leaves one tensor out; ``metadata`` adds or overrides keys (None removes one); ``extra`` adds float32 tensors."""
    import gguf

    rng = np.random.default_rng(seed)
    types = types or LAYER_TYPES
    head_dim = hidden // heads
    tokens = vocab()
    w = gguf.GGUFWriter(str(path), arch)
    fields: dict = {
        f"{arch}.context_length": ("uint32", 512), f"{arch}.embedding_length": ("uint32", hidden),
        f"{arch}.feed_forward_length": ("uint32", inter), f"{arch}.block_count": ("uint32", layers),
        f"{arch}.attention.head_count": ("uint32", heads), f"{arch}.attention.head_count_kv": ("uint32", kv_heads),
        f"{arch}.rope.freq_base": ("float32", 10000.0),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", 1e-6),
        f"{arch}.rope.dimension_count": ("uint32", head_dim),
        "tokenizer.ggml.bos_token_id": ("uint32", 1), "tokenizer.ggml.eos_token_id": ("uint32", 2),
        "tokenizer.ggml.padding_token_id": ("uint32", 0),
    }
    if arch == "qwen3":
        fields[f"{arch}.attention.key_length"] = ("uint32", head_dim)
        fields[f"{arch}.attention.value_length"] = ("uint32", head_dim)
    for key, value in (metadata or {}).items():
        if value is None:
            fields.pop(key, None)
        else:
            fields[key] = value
    for key, (kind, value) in fields.items():
        if kind == "string":
            w.add_string(key, value)
        else:
            getattr(w, f"add_{kind}")(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_chat_template(CHATML)

    def normal(*shape: int, std: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def add(name: str, data: np.ndarray, qtype: str = "F32") -> None:
        if name == skip_tensor:
            return
        raw, kind = encode(data, qtype, rng) if data.ndim == 2 else (data.astype(np.float32),
                                                                      gguf.GGMLQuantizationType.F32)
        w.add_tensor(name, raw, raw_dtype=kind)

    add("token_embd.weight", normal(len(tokens), hidden, std=1.0), embed_type)
    add("output_norm.weight", 1.0 + normal(hidden, std=0.2))
    if not tied:
        add("output.weight", normal(len(tokens), hidden, std=0.2), "Q8_0")
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
              "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    for i in range(layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", 1.0 + normal(hidden, std=0.2))
        add(p + "ffn_norm.weight", 1.0 + normal(hidden, std=0.2))
        for j, m in enumerate(MATRICES):
            data = normal(*shapes[m])
            if arch == "llama" and m in ("attn_q", "attn_k"):
                data = permute_rotary(data, heads if m == "attn_q" else kv_heads)
            add(p + m + ".weight", data, types[(i + j) % len(types)])
        if arch == "qwen2":
            for m in ("attn_q", "attn_k", "attn_v"):
                add(p + m + ".bias", normal(shapes[m][0], std=0.2))
        if arch == "qwen3":
            add(p + "attn_q_norm.weight", 1.0 + normal(head_dim, std=0.2))
            add(p + "attn_k_norm.weight", 1.0 + normal(head_dim, std=0.2))
    for name, data in (extra or {}).items():
        add(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
