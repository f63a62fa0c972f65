"""The fused attention prologue (q/k RMSNorm + rotary + KV write) against its unfused reference.

CPU through Triton's interpreter, fp32, small shapes. Qwen3-like heads carry per-head norms,
Llama-like ones do not; qkv rows are strided as a wider buffer's column slice, slots shuffled.
A whole tiny model is also run through the fused path and compared with the unfused CPU path.
"""

from __future__ import annotations

import os

import torch

# conftest switches the interpreter on when there is no GPU; this keeps the module runnable alone
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from model_utils import PagedHarness, relative_error  # noqa: E402
from transformers import LlamaConfig, Qwen3Config  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from graphserve.kernels.qk_rope_kv import qk_norm_rope_kv_write, qk_norm_rope_kv_write_reference  # noqa: E402
from graphserve.kernels.rotary import rotary_cos_sin  # noqa: E402
from graphserve.layers.attention import TorchAttentionBackend  # noqa: E402
from graphserve.layers.attention_triton import TritonAttentionBackend, decode_prologue  # noqa: E402
from graphserve.models.llama import LlamaForCausalLM, Qwen3ForCausalLM  # noqa: E402

if isinstance(tl.standard.cdiv, InterpretedFunction):
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")  # triton was imported compiled first: the same fp32 checks run on the GPU
else:
    raise RuntimeError("Triton's interpreter could not be switched on and there is no GPU to compile for")

RTOL = 1e-5
BLOCK_SIZE = 4

# (num_heads, num_kv_heads, head_dim, with q/k norms)
QWEN3_LIKE = (4, 2, 32, True)
LLAMA_LIKE = (6, 2, 16, False)  # 6 query heads: not a power of two, so the head mask matters


def make_inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, norms: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    # a column slice of a wider buffer: row stride width + 24, as a padded projection output has
    qkv = (torch.randn(num_tokens, width + 24, generator=gen) * 3)[:, 5 : 5 + width].to(DEVICE)
    max_pos = 64
    cos, sin = rotary_cos_sin(max_pos, head_dim, base=1000.0, device=DEVICE)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(DEVICE)
    cache = torch.randn(2, 6, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    num_slots = 6 * BLOCK_SIZE
    # shuffled real slots (never block 0); with several tokens the last is a padding row on slot 0
    slots = torch.randperm(num_slots - BLOCK_SIZE, generator=gen)[:num_tokens] + BLOCK_SIZE
    if num_tokens > 1:
        slots[-1] = 0
    weights = {}
    if norms:
        weights = {
            "q_norm_weight": (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(DEVICE),
            "k_norm_weight": (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(DEVICE),
        }
    return qkv, positions, cos, sin, cache, slots.to(DEVICE), weights


@pytest.mark.parametrize("shape", [QWEN3_LIKE, LLAMA_LIKE], ids=["qwen3-like", "llama-like"])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_fused_prologue_matches_reference(shape, num_tokens):
    num_heads, num_kv_heads, head_dim, norms = shape
    qkv, positions, cos, sin, cache, slots, weights = make_inputs(num_tokens, *shape, seed=num_tokens)
    before = cache.clone()
    ref_cache = cache.clone()
    q_out = torch.full((num_tokens, num_heads, head_dim), float("nan"), device=DEVICE)
    args = (num_heads, num_kv_heads, head_dim)
    q = qk_norm_rope_kv_write(qkv, positions, cos, sin, cache, slots, *args, **weights, eps=1e-6, q_out=q_out)
    ref_q = qk_norm_rope_kv_write_reference(qkv, positions, cos, sin, ref_cache, slots, *args, **weights, eps=1e-6)
    assert q.data_ptr() == q_out.data_ptr() and not q.isnan().any()
    assert relative_error(q, ref_q) < RTOL
    flat, ref_flat, old = (c.view(2, -1, num_kv_heads, head_dim) for c in (cache, ref_cache, before))
    assert relative_error(flat[0, slots], ref_flat[0, slots]) < RTOL  # K: normed and rotated
    assert torch.equal(flat[1, slots], ref_flat[1, slots])  # V: copied as is
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], old[:, untouched])
    assert not torch.equal(flat[:, slots], old[:, slots])


def test_returned_q_is_contiguous_and_rotation_really_happened():
    num_heads, num_kv_heads, head_dim, _ = LLAMA_LIKE
    qkv, positions, cos, sin, cache, slots, _ = make_inputs(5, *LLAMA_LIKE, seed=11)
    positions = torch.arange(5, device=DEVICE) + 3  # no token at position 0, where rotary is the identity
    q = qk_norm_rope_kv_write(qkv, positions, cos, sin, cache, slots, num_heads, num_kv_heads, head_dim)
    raw_q = qkv[:, : num_heads * head_dim].reshape(5, num_heads, head_dim)
    assert q.is_contiguous() and q.shape == (5, num_heads, head_dim)
    assert not torch.allclose(q, raw_q)
    # a rotation keeps each (x1, x2) pair's length
    half = head_dim // 2
    assert torch.allclose(
        q[..., :half] ** 2 + q[..., half:] ** 2, raw_q[..., :half] ** 2 + raw_q[..., half:] ** 2, rtol=1e-5, atol=1e-5
    )


def test_partial_rotary_and_bad_widths_are_refused():
    num_heads, num_kv_heads, head_dim, _ = QWEN3_LIKE
    qkv, positions, cos, sin, cache, slots, weights = make_inputs(2, *QWEN3_LIKE, seed=12)
    args = (num_heads, num_kv_heads, head_dim)
    with pytest.raises(ValueError, match=r"\[max_position, 16\] for head_dim 32"):
        qk_norm_rope_kv_write(qkv, positions, cos[:, :8], sin[:, :8], cache, slots, *args, **weights)
    with pytest.raises(ValueError, match=r"qkv must be \[T, 256\]"):
        qk_norm_rope_kv_write(qkv[:, :-32], positions, cos, sin, cache, slots, *args, **weights)
    with pytest.raises(ValueError, match="given together"):
        qk_norm_rope_kv_write(qkv, positions, cos, sin, cache, slots, *args, q_norm_weight=weights["q_norm_weight"])
    with pytest.raises(ValueError, match=r"k_norm_weight shape \(16,\)"):
        qk_norm_rope_kv_write(
            qkv,
            positions,
            cos,
            sin,
            cache,
            slots,
            *args,
            q_norm_weight=weights["q_norm_weight"],
            k_norm_weight=weights["k_norm_weight"][:16],
        )


_TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)


def tiny_model(cls, config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = cls(config, max_positions=64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model.to(DEVICE).eval()


@pytest.mark.parametrize(
    ("cls", "config"),
    [
        (Qwen3ForCausalLM, lambda: Qwen3Config(**_TINY, head_dim=32, rope_theta=1e6)),
        (LlamaForCausalLM, lambda: LlamaConfig(**_TINY, rope_theta=1e4)),
    ],
    ids=["qwen3", "llama"],
)
@pytest.mark.parametrize("in_decode", [True, False], ids=["prologue-in-decode", "prologue-launch"])
def test_model_fused_path_matches_unfused_torch_path(cls, config, in_decode):
    """The Triton backend takes the fused prologue (in decode steps inside the decode kernel, or, in a
    ``decode_prologue(fused=False)`` scope, as its own launch); logits and every layer's KV must match the CPU
    path."""
    model = tiny_model(cls, config())
    harnesses = [
        PagedHarness(model, block_size=BLOCK_SIZE, num_blocks=16, device=DEVICE, backend=b)
        for b in (TritonAttentionBackend(), TorchAttentionBackend())
    ]
    gen = torch.Generator().manual_seed(5)
    prompts = {
        "a": torch.randint(0, 96, (6,), generator=gen).tolist(),
        "b": torch.randint(0, 96, (3,), generator=gen).tolist(),
    }
    steps = [[(s, p) for s, p in prompts.items()], [("a", [7]), ("b", [9])], [("a", [11]), ("b", [2])]]
    for chunks in steps:
        with decode_prologue(in_decode):
            fused = torch.cat(harnesses[0].step(chunks))
        unfused = torch.cat(harnesses[1].step(chunks))
        assert relative_error(fused, unfused) < 1e-4
    for fused_kv, unfused_kv in zip(harnesses[0].kv_caches, harnesses[1].kv_caches):
        assert relative_error(fused_kv, unfused_kv) < 1e-5
