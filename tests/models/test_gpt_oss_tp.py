"""gpt-oss split over ranks on CPU: under --tp 2 (gloo) each rank's sinks are its heads', its experts' gate/up
biases its rows and the down biases are added once over the ranks' sum, so greedy tokens equal --tp 1's with
prompts longer than the window; the experts' slices under --tp and --ep add up to the whole layer."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_hf_checkpoint
from test_gpt_oss import _config
from tp_utils import generate_on_ranks

from graphserve import SamplingParams
from graphserve.layers.moe import FusedMoE, SoftmaxTopK

PROMPTS = ["Hello world", "tensor parallel ranks agree on every token", "sliding windows and sinks"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _layer_counts(model) -> tuple[int, int]:  # noqa: ANN001
    return len(model.model.layers), len(model.model.layers)


def _generate(folder, **kw) -> list[list[int]]:
    return generate_on_ranks(folder, PROMPTS, GREEDY, _layer_counts, num_kv_tokens=1024, chunked_prefill_size=64,
                             **kw)


def test_gpt_oss_tp_greedy_tokens_match_tp1(tmp_path):
    make_hf_checkpoint(tmp_path, _config())
    assert _generate(tmp_path, tp=2) == _generate(tmp_path)


def _experts(**split) -> FusedMoE:
    return FusedMoE(6, 2, 64, 32, SoftmaxTopK(6, 2, True), activation="swiglu_oai", bias=True, swiglu_limit=2.0,
                    dtype=torch.float32, **split)  # fmt: skip


@pytest.mark.parametrize("split", ["tp", "ep"])
def test_expert_slices_with_biases_add_up_to_the_whole_layer(split):
    gen = torch.Generator().manual_seed(0)
    # one checkpoint: per expert gate/up [I, H], down [H, I] and their biases
    tensors = {(e, part): (torch.randn(64, 32, generator=gen) if part == "w2" else torch.randn(32, 64, generator=gen),
                           torch.randn(64 if part == "w2" else 32, generator=gen))
               for e in range(6) for part in ("w1", "w3", "w2")}  # fmt: skip
    layers = [_experts()] + [_experts(**{f"{split}_rank": r, f"{split}_size": 2}) for r in range(2)]
    for layer in layers:
        for (e, part), (weight, bias) in tensors.items():
            stacked = "w2_" if part == "w2" else "w13_"
            layer.load_weight(f"{stacked}weight", None, weight * 0.3, (e, part))
            layer.load_weight(f"{stacked}bias", None, bias, (e, part))
    x, logits = torch.randn(5, 64, generator=gen), torch.randn(5, 6, generator=gen)
    whole = layers[0](x, logits)
    torch.testing.assert_close(layers[1](x, logits) + layers[2](x, logits), whole, rtol=1e-5, atol=1e-5)
