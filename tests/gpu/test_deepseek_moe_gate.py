"""DeepSeek's MoE block on the GPU: V2 greedy routing through the fused add + norm + gate launch.

The block at V2-Lite's real expert shape (bf16, 64 experts of 1408, top-6, two shared) with a scaling factor
of 2.5, captured at one row (real or padding) and replayed on new inputs: the fused launch is taken, the
residual and normed hidden are kernels/norm's, the output is the scaled routed sum plus the shared experts.
Then the tiny checkpoints of tests/models/test_deepseek.py decoding the same greedy tokens with graphs on (padded
batches, the row mask built once per step) and off.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_utils import capture, rel_err  # noqa: E402
from model_utils import make_hf_checkpoint  # noqa: E402
from test_deepseek import VARIANTS  # noqa: E402

from graphserve import LLM, SamplingParams  # noqa: E402
from graphserve.kernels import moe_gate  # noqa: E402
from graphserve.kernels.moe_reference import experts_loop_reference  # noqa: E402
from graphserve.kernels.norm import fused_add_rms_norm  # noqa: E402
from graphserve.layers.moe import SoftmaxTopK  # noqa: E402
from graphserve.layers.norm import RMSNorm  # noqa: E402
from graphserve.models.deepseek import DeepseekMoE  # noqa: E402
from graphserve.models.deepseek_shape import shape_from_config  # noqa: E402

DT = torch.bfloat16
SCALE = 2.5


def _v2_lite_block(gen: torch.Generator) -> DeepseekMoE:
    from transformers import AutoConfig

    from graphserve.models.presets import get_preset_config

    config = AutoConfig.for_model(**{**get_preset_config("deepseek-v2-lite"), "routed_scaling_factor": SCALE})
    block = DeepseekMoE(shape_from_config(config, 2)).to(device="cuda", dtype=DT)
    assert isinstance(block.experts.router, SoftmaxTopK) and block.routed_scale == SCALE
    with torch.no_grad():
        for p in block.parameters():
            fan_in = p.shape[-1]
            p.copy_((torch.randn(p.shape, device="cuda", generator=gen) * fan_in**-0.5).to(DT))
    block.experts.rebuild(torch.device("cuda"))
    return block


@pytest.mark.parametrize("real", [1, 0])  # one real row, or one padding row of a padded graph batch
@torch.inference_mode()
def test_v2_lite_block_fuses_add_norm_gate_under_cuda_graph_replay(real, gen, monkeypatch):
    block = _v2_lite_block(gen)
    h, k = block.experts.hidden_size, block.experts.top_k
    norm = RMSNorm(h, 1e-6).to(device="cuda", dtype=DT)
    norm.weight.copy_((1 + 0.1 * torch.randn(h, device="cuda", generator=gen)).to(DT))
    x = (torch.randn(1, h, device="cuda", generator=gen) * 3).to(DT)
    res = torch.randn(1, h, device="cuda", generator=gen).to(DT)
    batch = SimpleNamespace(num_valid_tokens=torch.arange(1, device="cuda") < real)
    fused_calls = []
    launch = moe_gate.moe_add_norm_gate_softmax_topk
    monkeypatch.setattr(moe_gate, "moe_add_norm_gate_softmax_topk", lambda *a: fused_calls.append(1) or launch(*a))
    graph, (out, new_res) = capture(lambda: block.forward_add_norm(x, res, norm, batch))
    assert fused_calls, "one row of greedy routing should take the fused add + norm + gate launch"
    experts = block.experts
    for _ in range(2):
        x.copy_((torch.randn(1, h, device="cuda", generator=gen) * 3).to(DT))
        res.copy_(torch.randn(1, h, device="cuda", generator=gen).to(DT))
        graph.replay()
        torch.cuda.synchronize()
        assert not experts.gate_counters.any() and int(experts.expert_counts.sum()) == real * k
        hidden, want_res = fused_add_rms_norm(x, res, norm.weight, norm.eps)
        assert torch.equal(new_res, want_res)
        shared = block.shared_experts(hidden).float()
        if not real:  # a padding row reaches no expert: the shared experts alone
            assert rel_err(out, shared) < 1e-2
            continue
        # the routing the gate kernel chooses (tests/gpu/test_moe_norm_gate.py checks it against torch): a
        # near-tie decided the other way would swap an expert here
        w, ids = moe_gate.moe_gate_softmax_topk(hidden, block.gate.weight, k, False, torch.zeros_like(experts.gate_counters))
        routed = experts_loop_reference(hidden.float(), experts.w13_weight.float(), experts.w2_weight.float(), w, ids)
        assert rel_err(out, shared + SCALE * routed) < 2e-2


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tiny_deepseek_checkpoints_decode_alike_with_graphs_on_and_off(name, tmp_path):
    """Greedy tokens of five requests (padded to a captured size of 8 while they run), fp32. (Tokens against
    transformers' generate, the greedy scaling factor included, are checked on CPU: tests/models/test_deepseek.py.)"""
    make_hf_checkpoint(tmp_path, VARIANTS[name]())
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(4, 320, (n,), generator=gen).tolist() for n in (3, 9, 17, 30, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    tokens = []
    for graphs_off in (True, False):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", disable_cuda_graph=graphs_off,
                  cuda_graph_bs=(1, 8), max_model_len=128)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens.append([o.token_ids for o in outs])
        if not graphs_off:
            decode = [r for r in llm.engine.core.telemetry.records() if r.kind == "decode"]
            assert any(r.graph and r.padded_size > r.batch_size for r in decode), name
        llm.engine.core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[0] == tokens[1], name
