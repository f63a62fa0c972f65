"""DeepSeek FP8 checkpoints in the layout DeepSeek-V3 ships (our quantizer): projections and routed experts load
in fp8, ``kv_b_proj`` (fp8 with its scale, or left in the source dtype) is dequantized into the model dtype,
and the logits are those of the same model dequantized; a kv_b_proj weight and scale that do not pair up are
refused naming the tensor."""

from __future__ import annotations

import pytest
import torch
from model_utils import PagedHarness, dequantized_checkpoint, make_hf_checkpoints
from safetensors.torch import load_file, save_file
from test_deepseek import _TINY
from transformers import DeepseekV2Config, DeepseekV3Config

from graphserve.config import EngineConfig
from graphserve.errors import ModelLoadError
from graphserve.kernels.fp8_quant import FP8_DTYPE, dequantize_blocks, quantize_weight_blocks
from graphserve.layers.quant.config import DEQUANTIZED_AT_LOAD, Fp8Config
from graphserve.layers.quant.dequant_at_load import dequantize_at_load
from graphserve.models.fp8_checkpoint import quantize_checkpoint
from graphserve.models.loader import load_model

CPU = torch.device("cpu")
TOKENS = list(range(7, 37))
KV_B = "model.layers.0.self_attn.kv_b_proj"
# q LoRA 32 (the fused q_a / kv_a matmul's first part must be a multiple of the 32-row test block); kv_b_proj is
# [4 x (16 + 12), 48] = [112, 48]: its last scale block is partial along both dimensions
_SHAPE = {**_TINY, "num_hidden_layers": 2, "kv_lora_rank": 48, "v_head_dim": 12, "max_position_embeddings": 128}
FAMILIES = {
    "v3": lambda: DeepseekV3Config(**_SHAPE, q_lora_rank=32, n_group=4, topk_group=2, norm_topk_prob=True,
                                   routed_scaling_factor=2.5, rope_theta=10000.0),
    "v2": lambda: DeepseekV2Config(**_SHAPE, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0,
                                   rope_theta=10000.0),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_hf_checkpoints(tmp_path_factory, FAMILIES, seed=5)


def _load(folder):
    return load_model(EngineConfig(model=str(folder)), CPU)


def _logits(loaded) -> torch.Tensor:
    return PagedHarness(loaded.model).step([("s", TOKENS)])[0]


@pytest.mark.parametrize("family,block,unquantized", [
    ("v3", (32, 32), ()), ("v3", (32, 32), (".kv_b_proj",)), ("v2", None, ()), ("v2", None, (".kv_b_proj",)),
], ids=["v3-block", "v3-block-kv_b-unquantized", "v2-channel", "v2-channel-kv_b-unquantized"])  # fmt: skip
def test_fp8_checkpoint_matches_the_same_model_dequantized(sources, tmp_path, family, block, unquantized):
    quantize_checkpoint(sources[family], tmp_path / "fp8", block=block, unquantized=unquantized)
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    scale = f"{KV_B}.weight_scale_inv" if block else f"{KV_B}.weight_scale"
    assert stored[f"{KV_B}.weight"].dtype == (torch.float32 if unquantized else FP8_DTYPE)
    assert (scale in stored) != bool(unquantized)
    assert stored["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].dtype == FP8_DTYPE
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router gate stays unquantized
    dequantized_checkpoint(tmp_path / "fp8", tmp_path / "deq")
    fp8 = _load(tmp_path / "fp8")
    attn = fp8.model.model.layers[0].self_attn
    assert attn.fused_qkv_a_proj.weight.dtype == FP8_DTYPE and attn.o_proj.weight.dtype == FP8_DTYPE
    assert attn.kv_b_proj.quant_method is None and attn.kv_b_proj.weight.dtype == torch.float32
    # The CPU path multiplies by the dequantized fp32 weights, and kv_b_proj holds its dequantized weight: the
    # same numbers as the dequantized checkpoint in the same order of operations (see test_fp8_checkpoint.py)
    torch.testing.assert_close(_logits(fp8), _logits(_load(tmp_path / "deq")), rtol=1e-5, atol=1e-5)
    # kv_b_proj against the unquantized source: e4m3 rounds a weight by at most 2^-4 of itself; weights far
    # below their block's (row's) largest fall to fp8 subnormals, whose steps (amax / 448 * 2^-9, amax ~0.4
    # here) are under 2e-6
    source = load_file(str(sources[family] / "model.safetensors"))[f"{KV_B}.weight"]
    if unquantized:
        assert torch.equal(attn.kv_b_proj.weight, source)
    else:
        assert ((attn.kv_b_proj.weight - source).abs() <= source.abs() * 2**-4 + 2e-6).all()


@pytest.mark.parametrize("scale_first", [False, True], ids=["weight-first", "scale-first"])
def test_a_weight_and_its_scale_pair_up_in_either_order(scale_first):
    """The first of the two is held (nothing else is), the other tensors pass as they come, and the dequantized
    weight is handed on as soon as the second arrives."""
    q, s = quantize_weight_blocks(torch.randn(112, 48) * 0.1, 32, 32)
    pair = [(f"{KV_B}.weight", q), (f"{KV_B}.weight_scale_inv", s)]
    first, second = pair[::-1] if scale_first else pair
    other = ("model.layers.0.self_attn.o_proj.weight", torch.ones(4, 4, dtype=FP8_DTYPE))
    consumed: list[str] = []

    def stream():
        for name, t in (first, other, second, ("model.norm.weight", torch.ones(4))):
            consumed.append(name)
            yield name, t

    out = [(name, t, len(consumed)) for name, t in dequantize_at_load(stream(), DEQUANTIZED_AT_LOAD,
                                                                       Fp8Config(block=(32, 32)))]  # fmt: skip
    assert [(name, n) for name, _, n in out] == [(other[0], 2), (f"{KV_B}.weight", 3), ("model.norm.weight", 4)]
    assert out[0][1] is other[1]
    assert torch.equal(out[1][1], dequantize_blocks(q, s, 32, 32))


def _rewrite(folder, change) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize("block,change,message", [
    ((32, 32), lambda t: t.pop(f"{KV_B}.weight_scale_inv"),
     rf"'{KV_B}\.weight' is torch\.float8_e4m3fn \(112, 48\) but the checkpoint has no '{KV_B}\.weight_scale_inv'"),
    ((32, 32), lambda t: t.pop(f"{KV_B}.weight"), rf"'{KV_B}\.weight_scale_inv' has no fp8 '{KV_B}\.weight'"),
    ((32, 32), lambda t: t.__setitem__(f"{KV_B}.weight", t[f"{KV_B}.weight"].float()),
     rf"'{KV_B}\.weight_scale_inv' scales '{KV_B}\.weight', which is stored in torch\.float32"),
    ((32, 32), lambda t: t.__setitem__(f"{KV_B}.weight_scale_inv", torch.ones(2, 2)),
     rf"'{KV_B}\.weight_scale_inv' has shape \(2, 2\), expected \(4, 2\)"),  # [ceil(112/32), ceil(48/32)]
    (None, lambda t: t.__setitem__(f"{KV_B}.weight_scale", torch.ones(56)),
     rf"'{KV_B}\.weight_scale' has shape \(56,\), expected one scale \(per tensor\) or 112 \(per channel\)"),
], ids=["no-scale", "no-weight", "scale-of-an-unquantized-weight", "block-scale-shape", "channel-scale-shape"])  # fmt: skip
def test_kv_b_proj_that_does_not_pair_up_is_refused_by_name(sources, tmp_path, block, change, message):
    quantize_checkpoint(sources["v3"], tmp_path / "fp8", block=block)
    _rewrite(tmp_path / "fp8", change)
    with pytest.raises(ModelLoadError, match=message):
        _load(tmp_path / "fp8")


def test_a_scale_before_an_unquantized_weight_is_refused():
    stream = [(f"{KV_B}.weight_scale_inv", torch.ones(4, 2)), (f"{KV_B}.weight", torch.zeros(112, 48))]
    with pytest.raises(ModelLoadError, match=rf"'{KV_B}\.weight_scale_inv' scales '{KV_B}\.weight', which is stored "
                                             r"in torch\.float32"):  # fmt: skip
        list(dequantize_at_load(iter(stream), DEQUANTIZED_AT_LOAD, Fp8Config(block=(32, 32))))


def test_the_plan_prices_what_fp8_keeps_in_the_model_dtype_at_its_bytes():
    """DeepSeek-V2-Lite under --quantization fp8: kv_b_proj (27 layers x [16 heads x (128 + 128), 512]), the
    routers (26 MoE layers x [64, 2048]) and the norms (27 x (2 x 2048 + 512) + 2048) stay bf16."""
    from graphserve.analysis.plan import build_plan, load_hf_config
    from graphserve.models.registry import describe_model

    hf = load_hf_config("dummy:deepseek-v2-lite")
    d = describe_model(hf, torch.bfloat16, 1)
    assert d.model_dtype_params == 27 * 16 * 256 * 512 + 26 * 64 * 2048 + 27 * (2 * 2048 + 512) + 2048
    fp8 = build_plan(hf, gpu_memory_gb=141, quantization="fp8")
    # the projections take one byte and a 4-byte scale per output row: each layer's q_proj fused with kv_a_proj
    # [16 x 192 + 576, 2048] and o_proj [2048, 16 x 128], layer 0's MLP (gate_up [2 x 10944, 2048], down [2048,
    # 10944]) and 26 layers' shared experts (gate_up [2 x 2816, 2048], down [2048, 2816])
    scales = 4 * (27 * (16 * 192 + 576 + 2048) + (2 * 10944 + 2048) + 26 * (2 * 2816 + 2048))
    # a routed expert (64 in each of 26 layers): gate, up [1408, 2048] and down in fp8, and 128x128 block scales
    expert = 3 * 1408 * 2048 + 4 * (2 * 11 * 16 + 16 * 11)
    want = (d.dense_params - d.model_dtype_params + scales
            + (d.model_dtype_params + d.embed_params + d.lm_head_params) * 2 + 26 * 64 * expert)
    assert fp8["weights_bytes"] == want
