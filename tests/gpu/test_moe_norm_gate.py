"""The MoE layer's post-attention add + RMSNorm + router gate + top-k in one launch, on the GPU.

bf16 at the four MoE presets' shapes against the two launches it replaces (kernels/norm's fused add
+ RMSNorm, then the bf16 gate projection and the softmax top-k of torch); the layer's fused path
under CUDA-graph replay with padding rows; and tiny checkpoints of the four families decoding the
same greedy tokens with graphs on (padded batches, the row mask built once per step) and off.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_utils import MOE_MODELS as MODELS  # noqa: E402
from gpu_utils import capture, rel_err  # noqa: E402
from model_utils import make_hf_checkpoint  # noqa: E402
from test_moe_models import VARIANTS  # noqa: E402

from graphserve import LLM, SamplingParams  # noqa: E402
from graphserve.kernels.moe_gate import moe_add_norm_gate_softmax_topk, moe_gate_softmax_topk  # noqa: E402
from graphserve.kernels.moe_reference import experts_loop_reference, softmax_topk_reference  # noqa: E402
from graphserve.kernels.norm import fused_add_rms_norm  # noqa: E402
from graphserve.layers.moe import FusedMoE, SoftmaxTopK  # noqa: E402
from graphserve.layers.norm import RMSNorm  # noqa: E402

DT = torch.bfloat16


def _inputs(t: int, h: int, gen: torch.Generator):
    x = (torch.randn(t, h, device="cuda", generator=gen) * 3).to(DT)
    res = torch.randn(t, h, device="cuda", generator=gen).to(DT)
    norm_w = (1 + 0.1 * torch.randn(h, device="cuda", generator=gen)).to(DT)
    return x, res, norm_w


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("name", list(MODELS))
def test_add_norm_gate_matches_norm_then_gate(name, t, gen):
    e, h, _, k, renorm = MODELS[name]
    gate = (torch.randn(e, h, device="cuda", generator=gen) * h**-0.5).to(DT)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(3):  # the counter must come back to zero after every launch
        x, res, norm_w = _inputs(t, h, gen)
        w, ids, normed, summed = moe_add_norm_gate_softmax_topk(x, res, norm_w, 1e-6, gate, k, renorm, counter)
        assert int(counter) == 0
        want_normed, want_summed = fused_add_rms_norm(x, res, norm_w, 1e-6)
        assert torch.equal(summed, want_summed)
        assert rel_err(normed, want_normed) < 1e-2
        logits = torch.nn.functional.linear(want_normed, gate)
        w_ref, ids_ref = softmax_topk_reference(logits, k, renorm)
        # two sums may round a logit one bf16 step apart: an id may differ only at a near-tie
        probs = torch.softmax(logits.float(), dim=-1)
        gap = (probs.gather(1, ids.long()) - probs.gather(1, ids_ref.long())).abs()
        assert bool((gap[ids != ids_ref] < 2e-2).all())
        same = (ids == ids_ref).all(dim=1)
        torch.testing.assert_close(w[same], w_ref[same], rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("padded,real", [(1, 1), (1, 0), (2, 1)])  # the fused add+norm runs up to ADD_NORM_MAX_ROWS rows
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
@torch.inference_mode()
def test_layer_add_norm_gate_under_cuda_graph_replay(name, padded, real, gen):
    """FusedMoE.forward_add_norm_gate captured with padding rows, replayed on new inputs: equal to eager,
    padding rows zero, the normed hidden and new residual those of kernels/norm, the counter back at zero."""
    e, h, i, k, renorm = MODELS[name]
    layer = FusedMoE(e, k, h, i, SoftmaxTopK(e, k, renorm), dtype=DT, device="cuda")
    layer.w13_weight.copy_((torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5).to(DT))
    layer.w2_weight.copy_((torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5).to(DT))
    gate = torch.nn.Linear(h, e, bias=False, device="cuda", dtype=DT)
    gate.weight.copy_(torch.randn(e, h, device="cuda", generator=gen) * h**-0.5)
    norm = RMSNorm(h, 1e-6).to(device="cuda", dtype=DT)
    x, res, norm_w = _inputs(padded, h, gen)
    norm.weight.copy_(norm_w)
    valid = torch.arange(padded, device="cuda") < real
    graph, (out, hidden, new_res) = capture(lambda: layer.forward_add_norm_gate(x, res, norm, gate, valid=valid))
    for _ in range(2):
        new_x, new_r, _ = _inputs(padded, h, gen)
        x.copy_(new_x)
        res.copy_(new_r)
        graph.replay()
        torch.cuda.synchronize()
        assert not layer.gate_counters.any()
        want_hidden, want_res = fused_add_rms_norm(x, res, norm.weight, norm.eps)
        assert torch.equal(new_res, want_res) and rel_err(hidden, want_hidden) < 1e-2
        eager = layer.forward_add_norm_gate(x, res, norm, gate, valid=valid)
        assert torch.equal(out, eager[0]) and torch.equal(hidden, eager[1])
        assert torch.equal(out[real:], torch.zeros(padded - real, h, device="cuda", dtype=DT))
        assert int(layer.expert_counts.sum()) == real * k
        if real:
            # the routing the gate kernel chooses on the normed hidden (test_add_norm_gate_matches_norm_then_gate
            # checks it against torch): a near-tie decided the other way would swap an expert here
            w, ids = moe_gate_softmax_topk(hidden, gate.weight, k, renorm, torch.zeros_like(layer.gate_counters))
            ref = experts_loop_reference(hidden[:real].float(), layer.w13_weight.float(), layer.w2_weight.float(),
                                         w[:real], ids[:real])  # fmt: skip
            assert rel_err(out[:real], ref) < 2e-2


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tiny_moe_checkpoints_decode_alike_with_graphs_on_and_off(name, tmp_path):
    """Greedy tokens of five requests (padded to a captured size of 8 while they run), fp32."""
    make_hf_checkpoint(tmp_path, VARIANTS[name]())
    gen = torch.Generator().manual_seed(9)
    prompts = [{"prompt_token_ids": torch.randint(4, 320, (n,), generator=gen).tolist()} for n in (3, 9, 17, 30, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    tokens = []
    for graphs_off in (True, False):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", disable_cuda_graph=graphs_off,
                  cuda_graph_bs=(1, 8), max_model_len=128)  # fmt: skip
        tokens.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if not graphs_off:
            decode = [r for r in llm.engine.core.telemetry.records() if r.kind == "decode"]
            assert any(r.graph and r.padded_size > r.batch_size for r in decode), name
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[0] == tokens[1], name
