"""DeepSeek-V4 under --tp / --ep on CPU (gloo, float32): output groups and their heads split over ranks over a
replicated latent, compressor and indexer; routed experts split or placed whole, hash-routed layers included. Engines
at --tp 2 and --ep 2, through the real rank processes, give the greedy tokens and log-probabilities of --tp 1."""

from __future__ import annotations

import pytest
import torch
from model_utils import random_prompts
from test_deepseek_v4 import _checkpoint, _config
from tp_utils import check_collectives, refusal

from graphserve import LLM, SamplingParams
from graphserve.distributed import state
from graphserve.models.deepseek_v4 import DeepseekV4ForCausalLM

# past the window (8), several CSA groups (4) and an HCA group (16); CSA layers see more entries than index_topk (3)
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts((9, 23, 37))]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)


def _run(folder, **kw) -> list:  # noqa: ANN001
    """(tokens, top log-probabilities per step) of each prompt from a float32 engine, its collectives checked."""
    llm = LLM(str(folder), dtype="float32", block_size=4, chunked_prefill_size=16, max_model_len=128,
              num_kv_tokens=1024, **kw)  # fmt: skip
    core = llm.engine.core
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        layers = core.runner.model.shape.num_layers
        check_collectives(core, kw.get("tp", 1), kw.get("ep", 1), layers, layers)
    finally:
        core.shutdown()
    assert core.ranks is None or all(p.poll() is not None for p in core.ranks.procs), "ranks outlived shutdown"
    return [(o.token_ids, [[lp for _, lp in t.top] for t in o.logprobs]) for o in (r.outputs[0] for r in outs)]


def _same(got: list, want: list) -> None:
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        assert torch.allclose(torch.tensor(lps), torch.tensor(want_lps), rtol=1e-4, atol=1e-4)


def test_v4_tp2_and_ep2_match_tp1(tmp_path):
    _checkpoint(tmp_path, _config())
    reference = _run(tmp_path)
    _same(_run(tmp_path, tp=2), reference)  # 1 of the 2 output groups (2 of 4 heads) a rank
    _same(_run(tmp_path, ep=2), reference)  # attention replicated, 4 of the 8 experts a rank, hash layers too


def test_v4_nvfp4_tp2_matches_tp1(tmp_path):
    """The story serves V4 in NVFP4 at --tp 4: each rank's FP4 projections and experts are cut with their scales
    (o_b_proj and the shared expert's down projection in whole groups of 16 columns, the experts' 32 rows of
    intermediate size in two halves)."""
    _checkpoint(tmp_path, _config())
    _same(_run(tmp_path, tp=2, quantization="nvfp4"), _run(tmp_path, quantization="nvfp4"))


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (1, 2), (2, 2)])
def test_each_rank_holds_what_its_description_counts(monkeypatch, tp, ep):
    """A rank's modules (the MTP layer's apart) hold exactly the parameters its description counts: its output
    groups' heads, sinks and projections, its slice of the shared expert and vocabulary, every compressor and
    indexer whole, and the tp-1 cache layout."""
    config = _config()
    whole = DeepseekV4ForCausalLM.describe(config, torch.float32)
    for rank in range(max(tp, ep)):
        monkeypatch.setattr(state, "_STATE", state.ParallelState(rank=rank, world_size=max(tp, ep), tp_size=tp,
                                                                 ep_size=ep))  # fmt: skip
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(config, max_positions=64)
        d = DeepseekV4ForCausalLM.describe(config, torch.float32, tp=tp, ep=ep)
        params = dict(model.named_parameters())
        assert d.num_params == sum(p.numel() for n, p in params.items() if not n.startswith("mtp."))
        assert d.kept_unused.num_params == sum(p.numel() for n, p in params.items() if n.startswith("mtp."))
        assert d.kv == whole.kv
        attn = model.model.layers[1].self_attn  # a CSA layer
        assert attn.heads == config.num_attention_heads // tp and attn.sinks.shape == (attn.heads,)
        assert attn.o_a_proj.weight.shape == (config.o_groups // tp * config.o_lora_rank,
                                              config.num_attention_heads * config.head_dim // config.o_groups)
        assert attn.compressor.indexer.q_b_proj.weight.shape == (config.index_n_heads * config.index_head_dim,
                                                                 config.q_lora_rank)  # fmt: skip
        assert d.local_experts == config.n_routed_experts // ep
        assert d.expert_params * (tp if ep == 1 else 1) == whole.expert_params


def test_a_split_that_does_not_divide_is_refused_naming_the_field(tmp_path):
    config = _config()
    config.save_pretrained(tmp_path)  # config.json is all the check reads
    e = refusal(tmp_path, "--tp", "4")
    assert e.param == "tp" and "o_groups=2" in e.message and "[1, 2]" in e.message
    e = refusal(tmp_path, "--ep", "3")
    assert e.param == "ep" and "n_routed_experts=8" in e.message
