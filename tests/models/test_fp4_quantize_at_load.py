"""``--quantization nvfp4`` / ``mxfp4``: a model-dtype model (``dummy:`` presets, or a checkpoint) quantized at load,
its dense projections and routed experts in FP4, embedding and lm_head kept: the stored codes are the quantization
of the unquantized model's draw (same seed), the greedy tokens are those of the unquantized model given the
dequantized weights, and the description counts the bytes each rank holds (every preset's shapes fit the groups)."""

from __future__ import annotations

import pytest
import torch
from model_utils import dummy_preset, held_weight_bytes

from graphserve import LLM, SamplingParams
from graphserve.analysis.plan import build_plan, load_hf_config
from graphserve.config import EngineConfig
from graphserve.distributed import state
from graphserve.kernels.fp4_reference import fp4_dequantize
from graphserve.layers.linear import Linear
from graphserve.layers.moe import FusedMoE
from graphserve.layers.quant import fp4_moe
from graphserve.layers.quant.config import online_config, quantized_description
from graphserve.layers.quant.fp4 import quantize_fp4
from graphserve.layers.quant.fp4_config import Fp4Config
from graphserve.models.loader import load_model
from graphserve.models.registry import describe_model

from test_fp4_checkpoint import greedy  # isort: skip

CPU = torch.device("cpu")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def _tiny(monkeypatch, family: str) -> str:
    if family == "llama":
        return dummy_preset(monkeypatch, "llama3-8b", "tiny-llama-fp4", **SMALL)
    return dummy_preset(monkeypatch, "qwen3-30b-a3b", "tiny-moe-fp4", **SMALL, moe_intermediate_size=64,
                        num_experts=4, num_experts_per_tok=2)


def _split_parts(module, w: torch.Tensor) -> list[torch.Tensor]:
    return list(w.split(module.output_sizes)) if hasattr(module, "output_sizes") else [w]


@pytest.mark.parametrize("family,fmt", [("llama", "nvfp4"), ("moe", "nvfp4"), ("moe", "mxfp4")])
def test_dummy_fp4_is_the_quantized_dummy_and_runs_its_dequantized_tokens(monkeypatch, family, fmt):
    model = _tiny(monkeypatch, family)
    # the experts quantized one or two at a time, as a large model's are: the same result as the whole stack's below
    monkeypatch.setattr(fp4_moe, "INIT_CHUNK_ELEMENTS", 2 * 64 * 64)
    plain = load_model(EngineConfig(model=model, seed=4), CPU)
    fp4 = load_model(EngineConfig(model=model, seed=4, quantization=fmt), CPU)
    assert fp4.info.description.weights_bytes == held_weight_bytes(fp4.model)
    plain_modules = dict(plain.model.named_modules())
    linears = 0
    for name, module in fp4.model.named_modules():
        ref = plain_modules[name]
        if isinstance(module, Linear) and module.quant_method is not None:
            linears += 1
            assert module.weight.dtype == torch.uint8
            back = module.quant_method.dequantized_weight(module, torch.float32)
            # each fused part quantized on its own (its own global scale), from the unquantized model's draw
            want = torch.cat([fp4_dequantize(*quantize_fp4(w, fmt), fmt) for w in _split_parts(ref, ref.weight)])
            assert torch.equal(back, want), name
            ref.weight.data.copy_(back)
        elif isinstance(module, FusedMoE):
            assert module.quant_method is not None and module.w13_weight.dtype == torch.uint8
            d13, d2 = module.quant_method.dequantized(module, torch.float32)
            i = module.intermediate_local
            gate, up = (fp4_dequantize(*quantize_fp4(w, fmt), fmt) for w in ref.w13_weight.split(i, dim=1))
            assert torch.equal(d13, torch.cat([gate, up], 1)), name
            assert torch.equal(d2, fp4_dequantize(*quantize_fp4(ref.w2_weight, fmt), fmt)), name
            ref.w13_weight.data.copy_(d13)
            ref.w2_weight.data.copy_(d2)
    # qkv, o (and a dense MLP's gate_up, down) in each layer; the router gate stays
    assert linears == 2 * (4 if family == "llama" else 2)
    assert fp4.model.lm_head.weight.dtype == torch.float32
    fp4_tokens, fp4_logits = greedy(fp4.model)
    plain_tokens, plain_logits = greedy(plain.model)  # now holding the dequantized weights
    assert fp4_tokens == plain_tokens
    torch.testing.assert_close(fp4_logits, plain_logits, rtol=1e-5, atol=1e-5)


def test_the_engine_generates_with_fp4_weights(monkeypatch):
    llm = LLM(_tiny(monkeypatch, "moe"), quantization="nvfp4", max_model_len=64)
    out = llm.generate(["Hello", "FP4 weights"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [6, 6]


def _load_meta(monkeypatch, model: str, quantization: str, tp: int = 1, ep: int = 1, rank: int = 0):
    world = max(tp, ep)
    monkeypatch.setattr(state, "_STATE", state.ParallelState(rank=rank, world_size=world, tp_size=tp, ep_size=ep))
    return load_model(EngineConfig(model=model, dtype="bfloat16", quantization=quantization), torch.device("meta"))


@pytest.mark.parametrize("preset,fmt,tp,ep", [
    ("llama3-8b", "nvfp4", 2, 1), ("olmoe-1b-7b", "nvfp4", 1, 2), ("qwen3-30b-a3b", "mxfp4", 2, 1),
    ("deepseek-v3-l4", "nvfp4", 1, 1), ("mixtral-8x7b", "mxfp4", 1, 1),
])  # fmt: skip
def test_the_description_counts_the_fp4_bytes_each_rank_holds(monkeypatch, preset, fmt, tp, ep):
    """At the presets' sizes on the meta device: packed codes, group scales and global scales, to the byte; and
    ``graphserve plan`` prices the same."""
    for rank in range(max(tp, ep)):
        loaded = _load_meta(monkeypatch, f"dummy:{preset}", fmt, tp, ep, rank)
        held = held_weight_bytes(loaded.model)
        assert loaded.info.description.weights_bytes == held, rank
        hf = load_hf_config(f"dummy:{preset}")
        planned = quantized_description(describe_model(hf, torch.bfloat16, tp, ep), online_config(fmt), torch.bfloat16)
        assert planned.weights_bytes == held, rank
    assert build_plan(hf, gpu_memory_gb=141, quantization=fmt)["weights_bytes"] == \
        quantized_description(describe_model(hf, torch.bfloat16), online_config(fmt), torch.bfloat16).weights_bytes


def test_fp4_bytes_by_hand():
    """A [N, K] projection in NVFP4: K/2 bytes of codes and K/16 of e4m3 scales a row, 4 per part's global (and 4
    per part's input_scale from a checkpoint); MXFP4: K/32 E8M0 scales a row, no globals."""
    assert Fp4Config("nvfp4", serialized=False).projection_bytes(4096, 4096, parts=1) == 4096 * (2048 + 256) + 4
    assert Fp4Config("nvfp4").projection_bytes(6144, 4096, parts=3) == 6144 * (2048 + 256) + 24
    assert Fp4Config("mxfp4", serialized=False).projection_bytes(4096, 4096) == 4096 * (2048 + 128)
    # qwen3-30b-a3b: one expert (gate, up [768, 2048], down [2048, 768]) and a decode step's floor
    d = describe_model(load_hf_config("dummy:qwen3-30b-a3b"), torch.bfloat16)
    fp4 = quantized_description(d, online_config("nvfp4"), torch.bfloat16)
    assert fp4.expert_bytes == 2 * (768 * (1024 + 128) + 4) + 2048 * (384 + 48) + 4
    assert fp4.decode_read_bytes(1, 0) - d.decode_read_bytes(1, 0) == \
        (fp4.dense_bytes - d.dense_bytes) + 8 * 48 * (fp4.expert_bytes - d.expert_bytes)
    assert fp4.dense_bytes < 0.3 * d.dense_bytes + 2 * d.model_dtype_params
