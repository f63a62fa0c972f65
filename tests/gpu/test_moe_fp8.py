"""FP8 expert weights in the fused MoE path on the GPU, at the expert shapes of Qwen3-30B-A3B,
Mixtral-8x7B, OLMoE-1B-7B and Qwen1.5-MoE-A2.7B.

Fresh random bf16 activations against the dequantizing reference (kernels/moe_fp8_reference.py),
which quantizes the activations the same way where the layer does (the W8A8 rule, ``t * k >=
W8A8_MIN_ROWS_PER_EXPERT * E``, or the tuned table's ``a8`` tiles: kernels/moe_fused.quantized_steps); 128x128 block and per-channel scales; the streaming path, the
grouped GEMM in W8A16 and in W8A8 forced at small batches, and with the activations quantized inside
it (``GemmTile.a8``) or by gate_up's epilogue for down (``QUANT_OUT``); FusedMoE with fp8 experts
captured into a CUDA graph with padding rows and
replayed on new inputs (equal to eager bit for bit, padding rows zero and uncounted), including a
size that takes the W8A8 path; the workspace bound.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import MOE_MODELS as MODELS
from gpu_utils import capture, rel_err

from graphserve.kernels.moe_config import GemmTile
from graphserve.kernels.moe_fp8_reference import experts_fp8_reference
from graphserve.kernels.moe_fused import fused_experts, moe_workspace_bytes, quantized_steps
from graphserve.kernels.moe_reference import expert_counts_reference, softmax_topk_reference
from graphserve.kernels.moe_routing import moe_softmax_topk
from graphserve.layers.moe import FusedMoE, SoftmaxTopK
from graphserve.layers.quant.config import Fp8Config
from graphserve.layers.quant.fp8_moe import Fp8MoEMethod, quantize_stack

DT = torch.bfloat16
TOL = 2e-2
BLOCK = (128, 128)
SCALES = {"block": BLOCK, "channel": None}


@pytest.fixture(scope="module")
def experts() -> dict:
    """Per (model, scales): fp8 w13 (gate and up quantized apart, as checkpoints store them), w2, scales."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    made = {}
    for name, (e, h, i, _, _) in MODELS.items():
        w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5).to(DT)
        w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5).to(DT)
        for kind, block in SCALES.items():
            qg, sg = quantize_stack(w13[:, :i], block)
            qu, su = quantize_stack(w13[:, i:], block)
            q2, s2 = quantize_stack(w2, block)
            made[name, kind] = (torch.cat([qg, qu], 1), q2, torch.cat([sg, su], 1).contiguous(), s2.contiguous())
        del w13, w2
    return made


def _routing(t, name, gen):
    e, h, _, k, renorm = MODELS[name]
    x = torch.randn(t, h, device="cuda", generator=gen).to(DT)
    w, ids = moe_softmax_topk(torch.randn(t, e, device="cuda", generator=gen), k, renorm)
    return x, w, ids


# block scales at every model's shape; per-channel (each K a separate compile) at two of them
SHAPE_CASES = [(name, "block") for name in MODELS] + [("qwen3-30b-a3b", "channel"), ("mixtral-8x7b", "channel")]


@pytest.mark.parametrize("t", [1, 7, 64, 256, 2048])
@pytest.mark.parametrize("name,kind", SHAPE_CASES)
def test_fp8_experts_model_shapes(name, kind, t, experts, gen):
    e, _, _, k, _ = MODELS[name]
    w13, w2, s13, s2 = experts[name, kind]
    x, w, ids = _routing(t, name, gen)
    counts = torch.full((e,), -1, dtype=torch.int32, device="cuda")
    out = fused_experts(x, w13, w2, w, ids, counts=counts, w13_scale=s13, w2_scale=s2, weight_block=SCALES[kind])
    w8a8 = quantized_steps(t, k, w13, w2, s13, s2, SCALES[kind])  # the W8A8 rule, or the table's a8 tiles
    ref = experts_fp8_reference(x, w13, w2, s13, s2, SCALES[kind], w, ids, w8a8=w8a8)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL, w8a8
    assert torch.equal(counts, expert_counts_reference(ids, None, e))


@pytest.mark.parametrize("kind", list(SCALES))
@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_every_path_and_mode_at_small_batches(name, t, kind, experts, gen):
    w13, w2, s13, s2 = experts[name, kind]
    x, w, ids = _routing(t, name, gen)
    block, k = SCALES[kind], MODELS[name][3]
    for path, w8a8 in (("gemv", None), ("gemm", False), ("gemm", True)):
        out = fused_experts(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, weight_block=block, path=path, w8a8=w8a8)
        modes = quantized_steps(t, k, w13, w2, s13, s2, block, path=path, w8a8=w8a8)
        assert modes == ((False, False) if not w8a8 else (True, True))  # W8A16 asked for stays W8A16
        ref = experts_fp8_reference(x, w13, w2, s13, s2, block, w, ids, w8a8=modes)
        assert rel_err(out, ref) < TOL, (path, w8a8)


@pytest.mark.parametrize("block_k", [256, 512])
@pytest.mark.parametrize("t", [7, 64])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_w8a16_k_steps_across_scale_blocks(name, t, block_k, experts, gen):
    """Grouped GEMM tiles whose K step spans 2 or 4 of the 128-wide scale blocks (block_n inside one
    scale row: the weight scale goes onto the activations), gated and not, at the decode sizes they
    are tuned for; and the per-column path's tile beside them (block_n 256 over 128-row blocks)."""
    w13, w2, s13, s2 = experts[name, "block"]
    x, w, ids = _routing(t, name, gen)
    ref = experts_fp8_reference(x, w13, w2, s13, s2, BLOCK, w, ids)
    for tiles in ((GemmTile(16, 32, block_k, 1, 4, 3), GemmTile(16, 64, block_k, 1, 4, 2)),
                  (GemmTile(16, 64, block_k, 1, 4, 2), GemmTile(16, 256, block_k, 1, 8, 2))):  # fmt: skip
        out = fused_experts(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, weight_block=BLOCK, path="gemm",
                            w8a8=False, gemm_tiles=tiles)  # fmt: skip
        assert not out.isnan().any()
        assert rel_err(out, ref) < TOL, tiles


# tiles that quantize the activations in the GEMM (GemmTile.a8): 16-row tiles as the tuner offers them at
# decode sizes, narrow and wide, and 64-row ones
A8_TILES = [
    (GemmTile(16, 64, 128, 1, 4, 3, a8=True), GemmTile(16, 32, 128, 1, 4, 3, a8=True)),
    (GemmTile(16, 128, 128, 1, 8, 4, a8=True), GemmTile(16, 128, 128, 1, 4, 3, a8=True)),
    (GemmTile(64, 128, 128, 8, 8, 3, a8=True), GemmTile(64, 64, 128, 8, 4, 3, a8=True)),
]
PLAIN = GemmTile(16, 64, 128, 1, 4, 3)


@pytest.mark.parametrize("t", [1, 7, 64, 256])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_a8_tiles_quantize_in_the_gemm(name, t, experts, gen):
    """Activations quantized in the grouped GEMM per row and K step, gated and not, against the reference
    on activations quantized the same way (the W8A8 tolerance); one step in the GEMM beside the other's
    quantization launch (w8a8=True); a real row with an all-zero K step quantizes to zeros, not NaN."""
    w13, w2, s13, s2 = experts[name, "block"]
    x, w, ids = _routing(t, name, gen)
    x[0, : BLOCK[1]] = 0.0
    ref = experts_fp8_reference(x, w13, w2, s13, s2, BLOCK, w, ids, w8a8=True)
    cases = [(tiles, False) for tiles in A8_TILES] + [((A8_TILES[0][0], PLAIN), True), ((PLAIN, A8_TILES[0][1]), True)]
    for tiles, w8a8 in cases:
        out = fused_experts(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, weight_block=BLOCK, path="gemm",
                            w8a8=w8a8, gemm_tiles=tiles)  # fmt: skip
        assert not out.isnan().any(), tiles
        assert rel_err(out, ref) < TOL, (tiles, w8a8)


@pytest.mark.parametrize("t", [7, 64, 256])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_gate_up_epilogue_quantizes_down_input(name, t, experts, gen, monkeypatch):
    """W8A8 with a gate_up tile one activation group wide (128): gate_up's epilogue writes down's fp8 input
    (``QUANT_OUT``) in place of the quantization launch, equal bit for bit to the same tiles with the launch,
    gate_up quantizing its own input or not, and within the W8A8 tolerance of the reference."""
    from graphserve.kernels import moe_fused

    w13, w2, s13, s2 = experts[name, "block"]
    x, w, ids = _routing(t, name, gen)
    ref = experts_fp8_reference(x, w13, w2, s13, s2, BLOCK, w, ids, w8a8=True)
    for gate_up in (GemmTile(16, 128, 128, 1, 4, 3), GemmTile(16, 128, 128, 1, 8, 4, a8=True)):
        args = dict(w13_scale=s13, w2_scale=s2, weight_block=BLOCK, path="gemm", w8a8=True,
                    gemm_tiles=(gate_up, PLAIN))  # fmt: skip
        assert moe_fused.quant_out_group(gate_up, PLAIN, moe_fused.expert_scales(w13, w2, s13, s2, BLOCK)[1], True)
        fused = fused_experts(x, w13, w2, w, ids, **args)
        with monkeypatch.context() as m:
            m.setattr(moe_fused, "quant_out_group", lambda *a: False)
            apart = fused_experts(x, w13, w2, w, ids, **args)
        assert torch.equal(fused, apart), gate_up
        assert rel_err(fused, ref) < TOL, gate_up


def _fp8_layer(name, kind, experts) -> FusedMoE:
    e, h, i, k, renorm = MODELS[name]
    layer = FusedMoE(e, k, h, i, SoftmaxTopK(e, k, renorm), dtype=DT, device="cuda")
    Fp8MoEMethod(Fp8Config(block=SCALES[kind], serialized=False)).create_weights(layer)
    w13, w2, s13, s2 = experts[name, kind]
    s13_name, s2_name = layer.quant_method.scale_name("w13_weight"), layer.quant_method.scale_name("w2_weight")
    for target, value in ((layer.w13_weight, w13), (layer.w2_weight, w2), (getattr(layer, s13_name), s13),
                          (getattr(layer, s2_name), s2)):  # fmt: skip
        target.copy_(value)
    return layer


@pytest.mark.parametrize("kind", list(SCALES))
@pytest.mark.parametrize("name,padded,real", [
    ("qwen3-30b-a3b", 1, 1), ("qwen3-30b-a3b", 8, 0), ("qwen3-30b-a3b", 64, 50), ("qwen3-30b-a3b", 256, 201),
    ("mixtral-8x7b", 1, 1), ("mixtral-8x7b", 32, 20), ("mixtral-8x7b", 512, 400),  # 1024 pairs: W8A8
])  # fmt: skip
@torch.inference_mode()
def test_fp8_layer_under_cuda_graph_replay(name, padded, real, kind, experts, gen):
    e, h, _, k, renorm = MODELS[name]
    layer = _fp8_layer(name, kind, experts)
    x = torch.randn(padded, h, device="cuda", generator=gen).to(DT)
    logits = torch.randn(padded, e, device="cuda", generator=gen)
    valid = torch.tensor(padded, device="cuda")
    graph, out = capture(lambda: layer(x, logits, valid=valid))
    x.copy_(torch.randn(padded, h, device="cuda", generator=gen).to(DT))
    logits.copy_(torch.randn(padded, e, device="cuda", generator=gen) * 3)
    x[real:] = float("nan")  # padding rows hold stale data: nothing of them may reach the output
    logits[real:] = float("nan")
    valid.fill_(real)
    layer.expert_counts.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    replay_out, replay_counts = out.clone(), layer.expert_counts.clone()
    assert torch.equal(replay_out, layer(x, logits, valid=valid))
    assert torch.equal(replay_out[real:], torch.zeros(padded - real, h, device="cuda", dtype=DT))
    w, ids = softmax_topk_reference(logits[:real], k, renorm)
    assert torch.equal(replay_counts, expert_counts_reference(ids, None, e))
    if real:
        w13, w2, s13, s2 = experts[name, kind]
        w8a8 = quantized_steps(padded, k, w13, w2, s13, s2, SCALES[kind])  # the rule reads the padded size
        ref = experts_fp8_reference(x[:real], w13, w2, s13, s2, SCALES[kind], w, ids, w8a8=w8a8)
        assert rel_err(replay_out[:real], ref) < TOL


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_fp8_workspace_bound_covers_what_a_forward_allocates(name, experts, gen):
    e, h, i, k, _ = MODELS[name]
    w13, w2, s13, s2 = experts[name, "block"]
    for t in (1, 64, 2048):
        x, w, ids = _routing(t, name, gen)
        counts = torch.empty(e, dtype=torch.int32, device="cuda")

        def run(x=x, w=w, ids=ids, counts=counts):
            return fused_experts(x, w13, w2, w, ids, counts=counts, w13_scale=s13, w2_scale=s2, weight_block=BLOCK)

        run()  # compiled and cached before measuring
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = run()
        torch.cuda.synchronize()
        used = torch.cuda.max_memory_allocated() - base
        # the caching allocator rounds each of the ~12 buffers up to 512 bytes
        bound = moe_workspace_bytes(t, k, e, i, h, DT, fp8_group_k=BLOCK[1]) + 12 * 512
        assert out.numel() and used <= bound, (t, used, bound)


@pytest.mark.parametrize("t", [7, 64, 256])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_static_activation_scales_model_shapes(name, t, experts, gen):
    """Per-channel experts with a checkpoint's static activation scales: the grouped GEMM quantizes x and the
    activated product with them (eager and replayed from a CUDA graph alike), as the reference does; the
    streaming path reads none."""
    w13, w2, s13, s2 = experts[name, "channel"]
    x, w, ids = _routing(t, name, gen)
    scales = (torch.tensor([x.abs().max().item() / 448.0], device="cuda"), torch.tensor([0.05 / 448.0], device="cuda"))
    out = fused_experts(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, path="gemm", input_scales=scales)
    ref = experts_fp8_reference(x, w13, w2, s13, s2, None, w, ids, w8a8=True, input_scales=scales)
    assert not out.isnan().any() and rel_err(out, ref) < TOL
    graph, held = capture(lambda: fused_experts(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, path="gemm",
                                                input_scales=scales))  # fmt: skip
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(held, out)
    stream = fused_experts(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, path="gemv", input_scales=scales)
    unscaled = experts_fp8_reference(x, w13, w2, s13, s2, None, w, ids)
    assert rel_err(stream, unscaled) < TOL
