"""The FP8 kernels at Llama-3-8B's projection shapes on the GPU, each against its PyTorch reference
on fresh random inputs, under CUDA-graph replay too; and an FP8 dummy model end to end.

Tolerances: both sides compute from the same fp8 operands and scales, so they differ by the
accumulation (fp32 in the reference; on Hopper the FP8 tensor cores keep fewer bits inside each
K=128 step before the kernel adds it to its fp32 accumulator) and by the final bf16 rounding
(2^-9 relative). A normwise relative error of 1e-2 allows both with room; a wrong scale index or
a missed tile gives errors of order 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_utils import decode_model, graph_runner  # noqa: E402
from model_utils import PagedHarness, make_hf_checkpoint  # noqa: E402

from graphserve.config import EngineConfig  # noqa: E402
from graphserve.kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from graphserve.kernels.extend_attention import extend_attention, extend_attention_reference  # noqa: E402
from graphserve.kernels.fp8_config import DEFAULT_STREAM_ROWS, SCALED_MM_MIN_ROWS, Route, StreamConfig  # noqa: E402
from graphserve.kernels.fp8_gemm import (  # noqa: E402
    blockwise_scale_layout,
    blockwise_scaled_mm_available,
    scaled_mm_blockwise,
    scaled_mm_rowwise,
    scaled_mm_supported,
    w8a8_matmul,
    w8a8_matmul_reference,
)
from graphserve.kernels.fp8_gemv import (  # noqa: E402
    fp8_gemv,
    fp8_gemv_a8,
    fp8_norm_gemv,
    fp8_silu_mul_gemv,
    split_counters,
)
from graphserve.kernels.fp8_quant import (  # noqa: E402
    dequantize_blocks,
    per_token_group_quant,
    per_token_group_quant_reference,
    quantize_weight_blocks,
    quantize_weight_channels,
)
from graphserve.kernels.fp8_reference import (  # noqa: E402
    fp8_gemv_reference,
    fp8_norm_gemv_reference,
    fp8_silu_mul_gemv_reference,
)
from graphserve.kernels.qk_rope_kv import qk_norm_rope_kv_write, qk_norm_rope_kv_write_reference  # noqa: E402
from graphserve.layers.attention_triton import TritonAttentionBackend  # noqa: E402
from graphserve.layers.linear import Linear, MergedLinear  # noqa: E402
from graphserve.layers.quant.config import Fp8Config  # noqa: E402
from graphserve.layers.quant.fp8 import Fp8LinearMethod  # noqa: E402
from graphserve.models.fp8_checkpoint import quantize_checkpoint  # noqa: E402
from graphserve.models.loader import load_model  # noqa: E402

DEV = torch.device("cuda")
TOL = 1e-2
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(1234)


def _weight(n: int, k: int, gen: torch.Generator, block: bool = True):
    w = torch.randn(n, k, device=DEV, generator=gen, dtype=torch.bfloat16) * 0.02
    if block:
        return quantize_weight_blocks(w, 128, 128)
    q, s = quantize_weight_channels(w)
    return q, s.view(-1, 1)


@pytest.mark.parametrize("m", [1, 33, 2048])
def test_token_group_quant(m: int, gen: torch.Generator) -> None:
    x = torch.randn(m, 4096, device=DEV, generator=gen, dtype=torch.bfloat16) * 4
    q, s = per_token_group_quant(x, 128)
    q_ref, s_ref = per_token_group_quant_reference(x, 128)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # x / scale in fp32 on both sides: identical but for division rounding at a tie (one e4m3 ulp:
    # 12.5% relative for normals, 2**-9 absolute in the subnormal range)
    mismatch = (q.float() != q_ref.float()).float().mean().item()
    assert mismatch < 1e-3
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=0.13, atol=2.0**-9)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("m", [1, 16, 64, 300, 2048])
def test_w8a8_block_matmul(name: str, m: int, gen: torch.Generator) -> None:
    n, k = SHAPES[name]
    wq, ws = _weight(n, k, gen)
    a, a_s = per_token_group_quant(torch.randn(m, k, device=DEV, generator=gen, dtype=torch.bfloat16), 128)
    bias = torch.randn(n, device=DEV, generator=gen, dtype=torch.bfloat16)
    out = w8a8_matmul(a, a_s, wq, ws, 128, 128, torch.bfloat16, bias)
    ref = w8a8_matmul_reference(a, a_s, wq, ws, 128, 128, torch.float32, bias)
    assert rel(out, ref) < TOL


@pytest.mark.parametrize("name", ["qkv", "down"])
@pytest.mark.parametrize("m", [16, 2048])
def test_per_channel_paths(name: str, m: int, gen: torch.Generator) -> None:
    n, k = SHAPES[name]
    wq, ws = _weight(n, k, gen, block=False)
    a, a_s = per_token_group_quant(torch.randn(m, k, device=DEV, generator=gen, dtype=torch.bfloat16), k)
    ref = w8a8_matmul_reference(a, a_s, wq, ws, 1, k, torch.float32)
    assert rel(w8a8_matmul(a, a_s, wq, ws, 1, k, torch.bfloat16), ref) < TOL
    if scaled_mm_supported(m, n, k, DEV):
        assert rel(scaled_mm_rowwise(a, a_s, wq, ws, torch.bfloat16), ref) < TOL


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 33, 64])
@pytest.mark.parametrize("block", [True, False], ids=["block", "channel"])
def test_fp8_gemv(name: str, m: int, block: bool, gen: torch.Generator) -> None:
    n, k = SHAPES[name]
    wq, ws = _weight(n, k, gen, block)
    gn, gk = (128, 128) if block else (1, k)
    x = torch.randn(m, k, device=DEV, generator=gen, dtype=torch.bfloat16)
    bias = torch.randn(n, device=DEV, generator=gen, dtype=torch.bfloat16)
    ref = fp8_gemv_reference(x.float(), wq, ws, gn, gk, bias)
    assert rel(fp8_gemv(x, wq, ws, gn, gk, bias), ref) < TOL


@pytest.mark.parametrize("m", [1, 4, 16, 32, 64])
def test_fp8_gemv_every_swept_tile(m: int, gen: torch.Generator) -> None:
    """Every tile benchmarks/fp8_route.py may write into the routing table (128x128 block scales)
    computes the same product, at both K of Llama-3-8B (14336 takes only some tiles). Rows 1 and 4
    run the FMA tiles (2 rows differ only in the row-tile constant), 4 to 64 the dot tiles (16-, 32- and
    64-row tensor-core tiles)."""
    from benchmarks.fp8_route import candidates

    for n, k in (SHAPES["o_proj"], SHAPES["down"]):
        wq, ws = _weight(n, k, gen, True)
        gn, gk = 128, 128
        x = torch.randn(m, k, device=DEV, generator=gen, dtype=torch.bfloat16)
        ref = fp8_gemv_reference(x.float(), wq, ws, gn, gk)
        # the FP8 dot quantizes x per row and 128 columns as per_token_group_quant does: held to the
        # reference on x quantized so
        ref_q = fp8_gemv_reference(dequantize_blocks(*per_token_group_quant(x, gk), 1, gk), wq, ws, gn, gk)
        for cfg in candidates(m, n, k, torch.cuda.get_device_properties(DEV).multi_processor_count):
            if cfg.a8:  # x quantized by the launch before, as the layer does
                out = fp8_gemv_a8(*per_token_group_quant(x, cfg.block_k), wq, ws, gn, gk, torch.bfloat16, config=cfg)
            else:
                out = fp8_gemv(x, wq, ws, gn, gk, config=cfg)
            assert rel(out, ref_q if cfg.fp8_dot else ref) < TOL, cfg


@pytest.mark.parametrize("m", [2, 9, 32, 64])
def test_fp8_gemv_per_token_x_every_swept_tile(m: int, gen: torch.Generator) -> None:
    """Per-channel weights (``--quantization fp8``'s dense projections) with x quantized per token: every
    A8 tile benchmarks/fp8_route.py --scales channel may write, and the default one, takes both scales
    after one FP8 dot chain and matches the reference on the same quantized x."""
    from benchmarks.fp8_route import candidates
    from graphserve.kernels.fp8_config import per_token_stream_config

    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for n, k in (SHAPES["o_proj"], SHAPES["down"]):
        wq, ws = _weight(n, k, gen, False)
        x = torch.randn(m, k, device=DEV, generator=gen, dtype=torch.bfloat16)
        q, s = per_token_group_quant(x, k)
        ref = fp8_gemv_reference(dequantize_blocks(q, s, 1, k), wq, ws, 1, k)
        tiles = [c for c in candidates(m, n, k, sms, channel=True) if c.a8] + [per_token_stream_config(m, n, k, sms)]
        assert len(tiles) > 1 or m <= 4  # the sweep tries A8 tiles above 4 rows
        for cfg in tiles:
            assert rel(fp8_gemv_a8(q, s, wq, ws, 1, k, torch.bfloat16, config=cfg), ref) < TOL, cfg


@pytest.mark.parametrize("m", [1, 3, 8, 16, 40])
def test_fp8_fused_prologues(m: int, gen: torch.Generator) -> None:
    """RMSNorm (+ residual) before qkv and SiLU·mul before down, in the streaming kernel's loads."""
    n, k = SHAPES["qkv"]
    wq, ws = _weight(n, k, gen)
    x, res = (torch.randn(m, k, device=DEV, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    nw = torch.randn(k, device=DEV, generator=gen, dtype=torch.bfloat16)
    out, summed = fp8_norm_gemv(x, nw, 1e-6, wq, ws, 128, 128, residual=res)
    want, want_sum = fp8_norm_gemv_reference(x, nw, 1e-6, wq, ws, 128, 128, residual=res)
    assert rel(out, want) < TOL and torch.equal(summed, want_sum)
    n, k = SHAPES["down"]
    wq, ws = _weight(n, k, gen)
    gate_up = torch.randn(m, 2 * k, device=DEV, generator=gen, dtype=torch.bfloat16)
    assert rel(fp8_silu_mul_gemv(gate_up, wq, ws, 128, 128), fp8_silu_mul_gemv_reference(gate_up, wq, ws, 128, 128)) < TOL


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("m", [1, 5, 64, 2048])
def test_scaled_mm_blockwise(name: str, m: int, gen: torch.Generator) -> None:
    """cuBLASLt's block-scaled GEMM on padded, column-major activation scales, where this build has it."""
    if not blockwise_scaled_mm_available(DEV):
        pytest.skip("torch._scaled_mm has no block-scaled mode in this build (the layer uses the Triton GEMM)")
    n, k = SHAPES[name]
    wq, ws = _weight(n, k, gen)
    x = torch.randn(m, k, device=DEV, generator=gen, dtype=torch.bfloat16)
    a, a_s = per_token_group_quant(x, 128, pad_rows_to=4, scales_column_major=True)
    assert a.shape[0] % 4 == 0 and a_s.stride(0) == 1
    out = scaled_mm_blockwise(a, a_s, wq, blockwise_scale_layout(ws), rows=m)
    assert out.shape == (m, n)
    ref = w8a8_matmul_reference(a[:m], a_s[:m], wq, ws, 128, 128, torch.float32)
    assert rel(out, ref) < TOL


def _fp8_layer(n: int, k: int, block: bool, gen: torch.Generator) -> Linear:
    layer = Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
    Fp8LinearMethod(Fp8Config(block=(128, 128) if block else None, serialized=False)).create_weights(layer)
    layer.quant_method.init_random(layer, torch.bfloat16, gen)
    return layer


@pytest.mark.parametrize("cfg", [StreamConfig(8, 2048, 4, 2, False, split_k=4), StreamConfig(32, 256, 4, 3, True, split_k=2)],
                         ids=["fma_split4", "dot_split2"])
def test_split_k_gemv_under_cuda_graph_replay(cfg: StreamConfig, gen: torch.Generator) -> None:
    """Split-K at the down projection (K = 14336: splits of 4 and 3 tiles of 2048, or 28 tiles of 256 in
    two): replays on new inputs match the reference and the eager call, and leave the counters zero."""
    n, k = SHAPES["down"]
    m = 1 if not cfg.use_dot else 4
    wq, ws = _weight(n, k, gen, True)
    x = torch.zeros(m, k, device=DEV, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_gemv(x, wq, ws, 128, 128, config=cfg)  # compile, and the stream's counters, outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fp8_gemv(x, wq, ws, 128, 128, config=cfg)
        counters = split_counters(x.device, 1)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        x.copy_(torch.randn(m, k, device=DEV, generator=gen, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out, fp8_gemv_reference(x.float(), wq, ws, 128, 128)) < TOL
        # against the unsplit FMA tile: the dot path rounds the block-scaled x to bf16 before its products
        # (a 2^-9 relative step per element, kernels/fp8_gemv.py), so it agrees to a few 1e-3, the FMA path to 1e-3
        agree = 4e-3 if cfg.use_dot else 1e-3
        assert rel(out, fp8_gemv(x, wq, ws, 128, 128, config=StreamConfig(8, 2048, 4, 2, False))) < agree
        assert not counters.any()


@pytest.mark.parametrize("m", [1, 4, DEFAULT_STREAM_ROWS, 16, 64, SCALED_MM_MIN_ROWS, 256])
@pytest.mark.parametrize("block", [True, False], ids=["block", "channel"])
def test_layer_under_cuda_graph_replay(m: int, block: bool, gen: torch.Generator) -> None:
    """Every path the layer routes to (stream, W8A8, scaled_mm, at the row counts the table or the
    defaults send there) replays from a graph on new inputs."""
    layer = _fp8_layer(6144, 4096, block, gen)
    x = torch.zeros(m, 4096, device=DEV, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        layer(x)  # compile outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = layer(x)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        x.copy_(torch.randn(m, 4096, device=DEV, generator=gen, dtype=torch.bfloat16))
        graph.replay()
        ref = x.float() @ layer.quant_method.dequantized_weight(layer, torch.float32).T
        assert rel(out, ref) < 0.05  # W8A8 rows also carry activation rounding (2^-4 relative per element)
        with torch.inference_mode():  # the eager call on the same input: a stale replay would differ by O(1)
            assert rel(out, layer(x)) < 1e-3


@pytest.mark.parametrize("m", [1, 8, 64])
def test_norm_and_silu_linear_fuse_into_fp8_layers(m: int, gen: torch.Generator) -> None:
    """norm_linear / silu_mul_linear on FP8 layers (fused into the stream at decode sizes, separate
    launches above) give what the separate norm / activation and the layer give."""
    from graphserve.layers.activation import silu_and_mul
    from graphserve.layers.linear import norm_linear, silu_mul_linear
    from graphserve.layers.norm import RMSNorm

    qkv, down = _fp8_layer(6144, 4096, True, gen), _fp8_layer(4096, 14336, True, gen)
    norm = RMSNorm(4096, 1e-6).to(DEV, torch.bfloat16)
    norm.weight.data.normal_(1.0, 0.1, generator=gen)
    x, res = (torch.randn(m, 4096, device=DEV, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    gate_up = torch.randn(m, 2 * 14336, device=DEV, generator=gen, dtype=torch.bfloat16)
    with torch.inference_mode():
        y, new_res = norm_linear(norm, x, res.clone(), qkv)
        h, want_res = norm(x, res.clone())
        assert rel(y, qkv(h)) < TOL and rel(new_res, want_res) < 1e-3
        assert rel(silu_mul_linear(gate_up, down), down(silu_and_mul(gate_up))) < TOL


A8_TILE = StreamConfig(128, 128, 8, 3, True, split_k=4, fp8_dot=True, a8=True)
GATED_PAIRS = [  # (gate_up tile, down tile): 128 and 64 columns a program, one and two splits
    (StreamConfig(256, 128, 8, 3, True, split_k=1, fp8_dot=True, a8=True),
     StreamConfig(64, 128, 4, 3, True, split_k=2, fp8_dot=True, a8=True)),
    (StreamConfig(128, 128, 4, 3, True, split_k=2, fp8_dot=True, a8=True),
     StreamConfig(64, 64, 4, 4, True, split_k=4, fp8_dot=True, a8=True)),
]


# (pair, block scales): block scales take only a down tile whose K step is the 128-column scale block
GATED_CASES = [pytest.param(pair, block, id=f"{name}-{'block' if block else 'channel'}")
               for pair, name in zip(GATED_PAIRS, ("half128", "half64_split"))
               for block in (True, False) if not block or pair[1].block_k == 128]


@pytest.mark.parametrize("pair,block", GATED_CASES)
@pytest.mark.parametrize("m", [16, 64])
def test_gated_mlp_under_cuda_graph_replay(pair, block: bool, m: int, gen: torch.Generator, monkeypatch) -> None:
    """layers/linear.norm_mlp with a table pair for the call (gate_up's epilogue writing down's quantized input,
    kernels/fp8_gemv.fp8_gate_up_a8) at Llama-3-8B's MLP, replayed from a CUDA graph on new inputs. Against the MLP
    in fp32 on the dequantized weights both it and the unfused launches (norm_linear, silu_mul_linear) carry two
    activation quantizations (~2e-2 normwise each); with block scales both quantize silu·up in the same 128-column
    groups, so they agree to what summation order flips in the bf16 and fp8 roundings (a few 1e-3)."""
    from graphserve.kernels import fp8_config
    from graphserve.kernels.fp8_config import Fp8Rule, GatedMlp
    from graphserve.layers.linear import norm_linear, norm_mlp, silu_mul_linear
    from graphserve.layers.norm import RMSNorm

    tiles = GatedMlp(*pair)
    kind = "block128" if block else "channel"
    rule = Fp8Rule("card", {}, {(4096, 14336, kind): [(64, tiles)]})
    monkeypatch.setattr(fp8_config, "rule_for", lambda device: rule)
    gate_up, down = _fp8_layer(28672, 4096, block, gen), _fp8_layer(4096, 14336, block, gen)
    norm = RMSNorm(4096, 1e-6).to(DEV, torch.bfloat16)
    norm.weight.data.normal_(1.0, 0.1, generator=gen)
    x, res = (torch.zeros(m, 4096, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        # the table's pair is what the call takes (else this would test the unfused launches against themselves)
        assert gate_up.quant_method.apply_norm_mlp(gate_up, norm, x, res, down) is not None  # compiles, outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out, new_res = norm_mlp(norm, x, res, gate_up, down)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        x.copy_(torch.randn(m, 4096, device=DEV, generator=gen, dtype=torch.bfloat16))
        res.copy_(torch.randn(m, 4096, device=DEV, generator=gen, dtype=torch.bfloat16))
        graph.replay()
        with torch.inference_mode():
            h, want_res = norm_linear(norm, x, res, gate_up)
            want = silu_mul_linear(h, down)
        assert torch.equal(new_res, want_res)
        exact = norm(x, res.clone())[0].float() @ gate_up.quant_method.dequantized_weight(gate_up, torch.float32).T
        act = torch.nn.functional.silu(exact[:, :14336]) * exact[:, 14336:]
        exact = act @ down.quant_method.dequantized_weight(down, torch.float32).T
        assert rel(out, exact) < 0.05 and rel(want, exact) < 0.05
        if block:
            assert rel(out, want) < 2e-2


@pytest.mark.parametrize("route", [Route("stream", A8_TILE), Route("w8a8"), Route("scaled_mm")],
                         ids=["stream_a8", "w8a8", "scaled_mm"])
@pytest.mark.parametrize("m", [5, 64])
def test_fused_quant_prologues_in_every_quantizing_path(route: Route, m: int, gen: torch.Generator) -> None:
    """Each path that quantizes its input takes the norm (+ residual) and SiLU·mul into that quantization's
    launch: norm_linear / silu_mul_linear give what the separate norm / activation and the layer on the
    same route give, and the residual sum exactly; also from a CUDA graph replayed on new inputs."""
    from graphserve.layers.activation import silu_and_mul
    from graphserve.layers.linear import norm_linear, silu_mul_linear
    from graphserve.layers.norm import RMSNorm

    if route.path == "scaled_mm" and not blockwise_scaled_mm_available(DEV):
        pytest.skip("this torch build has no block-scaled torch._scaled_mm")
    qkv, down = _fp8_layer(6144, 4096, True, gen), _fp8_layer(4096, 14336, True, gen)
    dev = qkv.weight.device  # the index the layer's route cache keys on (cuda:0, not cuda)
    for layer in (qkv, down):  # the route this test exercises, whatever the table says at m rows
        layer.quant_method._routes[(m, layer.out_features, layer.in_features, torch.bfloat16, dev)] = route
    norm = RMSNorm(4096, 1e-6).to(DEV, torch.bfloat16)
    norm.weight.data.normal_(1.0, 0.1, generator=gen)
    x, res = (torch.randn(m, 4096, device=DEV, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    gate_up = torch.randn(m, 2 * 14336, device=DEV, generator=gen, dtype=torch.bfloat16)
    with torch.inference_mode():
        down(gate_up[:, :14336].contiguous())  # cuBLASLt's scale layout is made outside the capture
        qkv(x)
        y, new_res = norm_linear(norm, x, res, qkv)
        h, want_res = norm(x, res)
        assert rel(y, qkv(h)) < TOL and torch.equal(new_res, want_res)
        z = silu_mul_linear(gate_up, down)
        assert rel(z, down(silu_and_mul(gate_up))) < TOL
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_g, res_g = norm_linear(norm, x, res, qkv)
            z_g = silu_mul_linear(gate_up, down)
        for t in (x, res, gate_up):
            t.copy_(torch.randn(t.shape, device=DEV, generator=gen, dtype=torch.bfloat16))
        graph.replay()
        h, want_res = norm(x, res)
        assert rel(y_g, qkv(h)) < TOL and torch.equal(res_g, want_res)
        assert rel(z_g, down(silu_and_mul(gate_up))) < TOL


def test_merged_layer_loads_shards_into_their_block_rows(gen: torch.Generator) -> None:
    layer = MergedLinear(4096, [4096, 1024, 1024], bias=False).to(device=DEV, dtype=torch.bfloat16)
    Fp8LinearMethod(Fp8Config(block=(128, 128), serialized=False)).create_weights(layer)
    parts = [torch.randn(s, 4096, device=DEV, generator=gen, dtype=torch.bfloat16) * 0.02 for s in (4096, 1024, 1024)]
    for i, part in enumerate(parts):
        layer.load_weight("weight", layer.weight, part, i)
    # every part landed in its rows with its own block scales: e4m3-accurate per element
    w, deq = torch.cat(parts).float(), layer.quant_method.dequantized_weight(layer, torch.float32)
    block_scale = layer.weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert ((deq - w).abs() <= w.abs() * 2**-4 + block_scale * 2**-9).all()
    x = torch.randn(64, 4096, device=DEV, generator=gen, dtype=torch.bfloat16)
    with torch.inference_mode():  # W8A8: activation rounding, 2^-4 relative at most per element
        assert rel(layer(x), x.float() @ deq.T) < 0.05


def test_fp8_dummy_model_generates_with_cuda_graphs() -> None:
    from graphserve import LLM, SamplingParams

    prompts = [[100 + i, 200 + i, 300 + i] for i in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    fp8 = LLM("dummy:qwen3-0.6b", quantization="fp8", max_model_len=512, cuda_graph_max_bs=8)
    outs = fp8.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(len(o.token_ids) == 16 for o in outs)


O_PROJ_A8_TILE = StreamConfig(64, 128, num_warps=4, num_stages=3, use_dot=True, split_k=4, fp8_dot=True, a8=True)


def _o_proj_route(model, rows: int, route: Route):
    """Give the model's o_proj ``route`` at ``rows`` rows, whatever the table says (one method serves every layer)."""
    o_proj = model.model.layers[0].self_attn.o_proj
    key = (rows, o_proj.out_features, o_proj.in_features, torch.bfloat16, o_proj.weight.device)
    o_proj.quant_method._routes[key] = route
    return o_proj


_ATTEND_QUANTIZED = TritonAttentionBackend.attend_quantized  # the method itself, whatever a test patches in


def _attention_quantizes(monkeypatch, on: bool, calls: list[bool]) -> None:
    """The Triton backend writes o_proj's quantized input (each call's success appended to ``calls``), or never."""

    def counted(self, *args, **kwargs):
        made = _ATTEND_QUANTIZED(self, *args, **kwargs)
        calls.append(made is not None)
        return made

    monkeypatch.setattr(TritonAttentionBackend, "attend_quantized", counted if on else lambda self, *a, **k: None)


@pytest.mark.parametrize("quantization,path", [("fp8-block", "stream"), ("fp8-block", "w8a8"),
                                               ("fp8-block", "scaled_mm"), ("fp8", "stream"), ("fp8", "w8a8")])
@pytest.mark.parametrize("fp8_kv", [False, True])
def test_attention_writes_o_proj_quantized_input(quantization: str, path: str, fp8_kv: bool, monkeypatch) -> None:
    """A decode step whose o_proj quantizes its input takes it from the attention kernel, already quantized
    (layers/linear.quantized_input_linear): the same fp8 values and scales as the separate quantization
    launch, so the logits are bit for bit those of the unfused step, on each quantizing route. Block-scaled
    weights (``fp8-block``) take it in head groups (their 128-column scale blocks), per-channel weights (``fp8``)
    per token: the last of a sequence's kv heads in the attention kernel quantizes its whole row."""
    if path == "scaled_mm" and not blockwise_scaled_mm_available(DEV):
        pytest.skip("this torch build has no block-scaled torch._scaled_mm")
    model = load_model(EngineConfig(model="dummy:qwen3-0.6b", device="cuda", quantization=quantization,
                                    max_model_len=1024), DEV).model  # fmt: skip
    b = 32
    o_proj = _o_proj_route(model, b, Route(path, O_PROJ_A8_TILE if path == "stream" else None))
    harnesses = [PagedHarness(model, block_size=16, num_blocks=256, dtype=torch.bfloat16, device=DEV,
                              backend=TritonAttentionBackend()) for _ in range(2)]  # fmt: skip
    if fp8_kv:
        for h in harnesses:
            h.kv_caches = [torch.zeros_like(c, dtype=torch.float8_e4m3fn) for c in h.kv_caches]
    prompts = [(f"s{i}", list(range(50 + 7 * i, 90 + 7 * i + i % 5))) for i in range(b)]
    fused_calls: list[bool] = []
    with torch.inference_mode():
        for h in harnesses:
            h.step(prompts)
        step = [(s, [7 + i]) for i, (s, _) in enumerate(prompts)]
        logits = {}
        for on, h in zip((False, True), harnesses):
            _attention_quantizes(monkeypatch, on, fused_calls)
            logits[on] = torch.stack([x[-1] for x in h.step(step)])
    assert o_proj.quant_method.input_quant(o_proj, b, torch.bfloat16, o_proj.weight.device) is not None
    assert fused_calls and all(fused_calls), "every layer's o_proj read the attention's quantized output"
    assert torch.equal(logits[True], logits[False])


@pytest.mark.parametrize("quantization", ["fp8-block", "fp8"])
def test_attention_writes_o_proj_quantized_input_under_cuda_graph_replay(quantization: str, monkeypatch) -> None:
    """The same fusion inside captured decode steps, as the engine runs them: a graph captured with it and one
    captured without give the same logits bit for bit, replay after replay."""
    from graphserve.layers.forward_batch import contiguous_batch

    bs, ctx = 32, 300
    cfg, loaded, kv_caches = decode_model("dummy:qwen3-0.6b", ctx, bs, quantization=quantization, max_model_len=512)
    model, info = loaded.model, loaded.info
    _o_proj_route(model, bs, Route("stream", O_PROJ_A8_TILE))
    backend = TritonAttentionBackend()
    fused_calls: list[bool] = []
    graphs = {}
    with torch.inference_mode():
        for on in (False, True):
            _attention_quantizes(monkeypatch, on, fused_calls)
            graphs[on] = graph_runner(cfg, model, backend, kv_caches, [bs], ctx)
            graphs[on].capture()
        assert fused_calls and all(fused_calls), "the fused graph's layers read the attention's quantized output"
        lens = [ctx + 1 - 5 * i for i in range(bs)]
        batch = contiguous_batch([1] * bs, lens, kv_caches, backend, vocab_size=info.vocab_size)
        for _ in range(3):
            unfused, fused = (graphs[on].replay(batch).clone() for on in (False, True))
            assert torch.equal(fused, unfused), f"max diff {(fused.float() - unfused.float()).abs().max().item()}"


# ---- FP8 KV cache ------------------------------------------------------------------------------
def _fp8_cache(seq_lens: list[int], kv_heads: int, gen: torch.Generator, page: int = 16):
    per_seq = [-(-n // page) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    cache = torch.randn(2, num_blocks, page, kv_heads, 128, device=DEV, generator=gen).to(torch.float8_e4m3fn)
    order = torch.randperm(num_blocks - 1, device=DEV, generator=gen).int() + 1
    tables = torch.zeros(len(seq_lens), max(per_seq) + 1, dtype=torch.int32, device=DEV)
    used = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = order[used: used + nb]
        used += nb
    return cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("widen", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seq_lens", [[1000], [37, 2048, 513, 1, 700, 64, 1500, 9]])
def test_decode_attention_on_an_fp8_cache(seq_lens: list[int], widen: torch.dtype, gen: torch.Generator) -> None:
    cache, tables, lens = _fp8_cache(seq_lens, 8, gen)
    q = torch.randn(len(seq_lens), 32, 128, device=DEV, generator=gen, dtype=torch.bfloat16)
    out = decode_attention(q, cache, tables, lens, 128**-0.5, fp8_widen=widen)
    assert rel(out, decode_attention_reference(q.float(), cache, tables, lens, 128**-0.5)) < TOL


@pytest.mark.parametrize("batch,kv_heads", [(4, 8), (16, 8), (40, 8), (64, 4), (100, 4), (300, 8), (700, 4)])
def test_decode_attention_on_an_fp8_cache_at_its_own_split_count(batch: int, kv_heads: int, gen: torch.Generator) -> None:
    """Batches where an fp8 cache takes more splits than a bf16 one (kernels/decode_attention.choose_num_splits)
    and its own launch shape (choose_tile), run on the scratch and counters the attention backend reserves for
    an fp8 cache, eager and replayed."""
    from graphserve.kernels.common import sm_count
    from graphserve.kernels.decode_attention import choose_num_splits

    seq_lens = [int(x) for x in torch.randint(1, 1500, (batch,), generator=gen, device=DEV)]
    cache, tables, lens = _fp8_cache(seq_lens, kv_heads, gen)
    capacity, sms = tables.shape[1] * 16, sm_count(DEV)
    assert choose_num_splits(batch, kv_heads, capacity, sms, True) > choose_num_splits(batch, kv_heads, capacity, sms)
    q = torch.randn(batch, 32, 128, device=DEV, generator=gen, dtype=torch.bfloat16)
    ws, counters = TritonAttentionBackend().reserve(32, kv_heads, 128, DEV, cache.dtype)
    out = torch.empty_like(q)
    decode_attention(q, cache, tables, lens, 128**-0.5, out=out, workspace=ws, counters=counters)
    want = decode_attention_reference(q.float(), cache, tables, lens, 128**-0.5)
    assert rel(out, want) < TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, cache, tables, lens, 128**-0.5, out=out, workspace=ws, counters=counters)
    out.zero_()
    graph.replay()
    assert rel(out, want) < TOL


def test_extend_attention_on_an_fp8_cache(gen: torch.Generator) -> None:
    seq_lens, query_lens = [600, 1030, 77], [600, 30, 77]
    cache, tables, lens = _fp8_cache(seq_lens, 8, gen)
    starts = torch.tensor([0, 600, 630, 707], dtype=torch.int32, device=DEV)
    q = torch.randn(707, 32, 128, device=DEV, generator=gen, dtype=torch.bfloat16)
    out = extend_attention(q, cache, tables, lens, starts, max(query_lens), 128**-0.5)
    assert rel(out, extend_attention_reference(q.float(), cache, tables, lens, starts, 128**-0.5)) < TOL


def test_fused_prologue_writes_an_fp8_cache(gen: torch.Generator) -> None:
    t, heads, kv_heads, d = 48, 32, 8, 128
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device=DEV, generator=gen, dtype=torch.bfloat16)
    positions = torch.randint(0, 4096, (t,), device=DEV, generator=gen)
    angles = torch.arange(4096, device=DEV)[:, None] * 10000 ** (-torch.arange(0, d, 2, device=DEV) / d)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    norm_w = torch.rand(d, device=DEV, generator=gen, dtype=torch.bfloat16) + 0.5
    slots = torch.randperm(64 * 16 - 16, device=DEV, generator=gen)[:t] + 16
    cache = torch.zeros(2, 64, 16, kv_heads, d, device=DEV, dtype=torch.float8_e4m3fn)
    ref_cache = cache.clone()
    q = qk_norm_rope_kv_write(qkv, positions, cos, sin, cache, slots, heads, kv_heads, d, norm_w, norm_w, 1e-6)
    q_ref = qk_norm_rope_kv_write_reference(qkv, positions, cos, sin, ref_cache, slots, heads, kv_heads, d,
                                            norm_w, norm_w, 1e-6)
    assert rel(q, q_ref) < TOL
    # both round K to bf16 and then to e4m3: equal but where the bf16 values differ by an ulp and
    # straddle an e4m3 rounding boundary (one e4m3 step, 2^-3 relative)
    got, want = cache.float(), ref_cache.float()
    assert (got != want).float().mean().item() < 1e-2
    torch.testing.assert_close(got, want, rtol=0.13, atol=2**-9)


def test_fp8_kv_cache_logits_track_bf16_kv_on_a_dummy_model() -> None:
    """dummy:qwen3-0.6b through the Triton backend (fused prologue, extend and decode kernels):
    the same prompts with a bf16 and an fp8 cache, prefill then decode steps."""
    model = load_model(EngineConfig(model="dummy:qwen3-0.6b", device="cuda", max_model_len=1024), DEV).model
    ref = PagedHarness(model, block_size=16, num_blocks=256, dtype=torch.bfloat16, device=DEV,
                       backend=TritonAttentionBackend())
    test = PagedHarness(model, block_size=16, num_blocks=256, dtype=torch.bfloat16, device=DEV,
                        backend=TritonAttentionBackend())
    test.kv_caches = [torch.zeros_like(c, dtype=torch.float8_e4m3fn) for c in test.kv_caches]
    prompts = {f"s{i}": list(range(100 + 37 * i, 100 + 37 * i + 50 + 40 * i)) for i in range(4)}
    errors, agree = [], []
    with torch.inference_mode():
        chunk = list(prompts.items())
        for _ in range(8):
            a = torch.stack([x[-1] for x in ref.step(chunk)]).float()
            b = torch.stack([x[-1] for x in test.step(chunk)]).float()
            errors.append(rel(b, a))
            agree.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
            chunk = [(s, [int(t)]) for s, t in zip(prompts, a.argmax(-1))]  # both follow the bf16 tokens
    print(f"fp8 KV vs bf16 KV: logits relative error max {max(errors):.3e}, top-1 agreement {sum(agree) / len(agree):.3f}")
    # e4m3 rounds each cached element by <= 2^-4 relative, and 28 layers compound it: the same model,
    # prompts and steps on the CPU path (fp32) measure 5.0-5.2%; twice that is the bound. Below 1e-3 the
    # fp8 cache would not have been read at all.
    assert 1e-3 < min(errors) and max(errors) < 0.1, errors


def test_static_activation_scales_on_the_gpu(gen: torch.Generator) -> None:
    """A per-channel checkpoint with a static input_scale per fused part: the largest is used, so no
    part's activations clip; the result matches quantizing x with it and multiplying in fp32."""
    layer = MergedLinear(4096, [4096, 1024, 1024], bias=False).to(device=DEV, dtype=torch.bfloat16)
    Fp8LinearMethod(Fp8Config(block=None, activation_scheme="static")).create_weights(layer)
    for i, size in enumerate((4096, 1024, 1024)):
        q, s = quantize_weight_channels(torch.randn(size, 4096, device=DEV, generator=gen) * 0.02)
        layer.load_weight("weight", layer.weight, q, i)
        layer.load_weight("weight_scale", layer.weight_scale, s, i)
        layer.load_weight("input_scale", layer.input_scale, torch.tensor(2.0 + i, device=DEV) / 448, i)
    x = torch.randn(64, 4096, device=DEV, generator=gen, dtype=torch.bfloat16)
    a_scale = 4.0 / 448
    xq = (x.float() / a_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * a_scale
    with torch.inference_mode():
        out = layer(x)
    assert rel(out, xq @ layer.quant_method.dequantized_weight(layer, torch.float32).T) < TOL


@pytest.mark.parametrize("m,k", [(1, 4096), (7, 14336), (64, 2048), (300, 768), (5, 100)])
def test_static_quant_kernel_matches_reference_bitwise(m, k, gen: torch.Generator) -> None:
    """The static quantization launch stores what its reference stores, values past ±448 saturated included, and
    replays from a CUDA graph to the same bytes."""
    from graphserve.kernels.fp8_quant import static_quant, static_quant_reference

    x = (torch.randn(m, k, device=DEV, generator=gen) * 3).to(torch.bfloat16)
    scale = torch.tensor([x.abs().max().item() / 600.0], device=DEV)  # some of x saturates
    q, s = static_quant(x, scale)
    want = static_quant_reference(x, scale)
    assert (x.float().abs() / scale > 448).any()
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)) and s.shape == (m, 1) and torch.equal(s[:, 0], scale.expand(m))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        held, _ = static_quant(x, scale)
    x.copy_((torch.randn(m, k, device=DEV, generator=gen) * 3).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(held.view(torch.uint8), static_quant_reference(x, scale).view(torch.uint8))


def test_fp8_checkpoint_on_the_gpu_tracks_the_cpu_reference(tmp_path) -> None:
    """A block-wise checkpoint written by our quantizer, loaded on CUDA (W8A8 prefill, gemv decode,
    bf16) against the same checkpoint on the CPU path (dequantized fp32 weights, fp32 activations)."""
    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=256,
                         tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    make_hf_checkpoint(tmp_path / "bf16", config, seed=4)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp8", block=(128, 128))
    gpu = load_model(EngineConfig(model=str(tmp_path / "fp8"), device="cuda"), DEV).model
    cpu = load_model(EngineConfig(model=str(tmp_path / "fp8"), device="cpu"), torch.device("cpu")).model
    g = PagedHarness(gpu, block_size=16, dtype=torch.bfloat16, device=DEV, backend=TritonAttentionBackend())
    c = PagedHarness(cpu, block_size=16)
    prompt = list(range(10, 70))
    with torch.inference_mode():
        errors = [rel(g.step([("s", prompt)])[0].cpu(), c.step([("s", prompt)])[0])]  # 60 rows: W8A8
        for t in (3, 5, 7):
            errors.append(rel(g.step([("s", [t])])[0].cpu(), c.step([("s", [t])])[0]))  # 1 row: gemv
    # the GPU side adds activation quantization (prefill: 2^-4 relative per element, RMS 3.6%) and
    # bf16 rounding; over 7 projections a layer and 2 layers that compounds to ~10%; 0.2 leaves room
    # and still catches a misplaced scale block, which costs O(1)
    assert max(errors) < 0.2, errors


@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("block", [True, False], ids=["block", "channel"])
def test_apply_rows_under_cuda_graph_replay(m: int, block: bool, gen: torch.Generator) -> None:
    """DeepSeek-V4's grouped o_a_proj at its shape (8 groups of 1024 rows, 4096 heads' columns a group): one
    ``apply_rows`` per group on the routed fp8 kernels, never a dequantized weight, against the dequantized rows,
    eagerly and from a graph on new inputs (the block scales' cuBLASLt layout made by the eager call before)."""
    groups, rank, k = 8, 1024, 4096
    layer = _fp8_layer(groups * rank, k, block, gen)
    method = layer.quant_method
    x = torch.zeros(groups, m, k, device=DEV, dtype=torch.bfloat16)

    def grouped() -> torch.Tensor:
        return torch.stack([method.apply_rows(layer, x[g], g * rank, (g + 1) * rank) for g in range(groups)])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        grouped()  # compile and lay out the scales outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = grouped()
    torch.cuda.current_stream().wait_stream(stream)
    w = method.dequantized_weight(layer, torch.float32).view(groups, rank, k)
    for _ in range(2):
        x.copy_(torch.randn(groups, m, k, device=DEV, generator=gen, dtype=torch.bfloat16))
        graph.replay()
        ref = torch.bmm(x.float(), w.transpose(1, 2))
        assert rel(out, ref) < 0.05  # W8A8 rows also carry activation rounding (2^-4 relative per element)
        with torch.inference_mode():  # the eager calls on the same input: a stale replay would differ by O(1)
            assert rel(out, grouped()) < 1e-3
