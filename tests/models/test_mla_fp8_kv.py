"""--kv-cache-dtype fp8_e4m3 on DeepSeek's latent cache (CPU, float32): the latent and the rope key are
stored as e4m3 (scale 1.0, a saturating cast) and read widened, through the loader, the PyTorch MLA
path, the engine with its prefix cache, and the memory plan."""

from __future__ import annotations

import pytest
import torch
from model_utils import PagedHarness, make_hf_checkpoint
from test_deepseek import VARIANTS, _checkpoint

from graphserve import LLM, SamplingParams
from graphserve.analysis.plan import build_plan, load_hf_config
from graphserve.config import EngineConfig
from graphserve.kernels.mla_prologue import write_latent_cache
from graphserve.layers.mla_reference import absorbed_decode_batched, expanded_attention, gather_context
from graphserve.models.loader import load_model

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
# e4m3 keeps 3 mantissa bits: each cached element is rounded by at most 2^-4 relative, 0.026 RMS over a
# layer's cache as measured on these models' first layer. Each of the 3 layers adds its own rounding to
# the perturbation of its input; measured, the logits move by 0.03-0.06 relative. 0.1 leaves room for
# that sum without letting a wrong read (a misplaced row, a byte read as a value) through: those move
# the logits by their own size.
LOGITS_TOL = 0.1


def _dense(name: str):
    """The variant with every layer dense: an expert choice flipped by a near-tie in the router would
    move the logits by more than the cache's rounding and say nothing about the cache."""
    config = VARIANTS[name]()
    config.first_k_dense_replace = config.num_hidden_layers
    return config


@pytest.mark.parametrize("name", ["v2-greedy-yarn", "v3-noaux"])  # no q LoRA, rotate-half; q LoRA, interleaved
def test_fp8_latent_cache_quarters_the_fp32_bytes_and_keeps_the_logits(name, tmp_path):
    make_hf_checkpoint(tmp_path, _dense(name))
    plain = load_model(EngineConfig(model=str(tmp_path), dtype="float32", max_model_len=128), CPU)
    fp8 = load_model(EngineConfig(model=str(tmp_path), dtype="float32", max_model_len=128,
                                  kv_cache_dtype="fp8_e4m3"), CPU)  # fmt: skip
    assert fp8.info.kv.kind == "latent" and fp8.info.kv.dtype == FP8 and fp8.info.dtype == torch.float32
    assert fp8.info.kv_bytes_per_token * 4 == plain.info.kv_bytes_per_token == 3 * (32 + 8) * 4
    ref, test = PagedHarness(plain.model), PagedHarness(fp8.model)
    test.kv_caches = fp8.info.kv.allocate(64, 4, CPU)  # the pool the engine would allocate from this info
    assert test.kv_caches[0].dtype == FP8
    gen = torch.Generator().manual_seed(3)
    prompts = {s: torch.randint(4, 320, (n,), generator=gen).tolist() for s, n in (("a", 19), ("b", 7))}
    for seq, tokens in prompts.items():  # a prefill attends over its own latents, read back from the cache
        a, b = ref.step([(seq, tokens)])[0], test.step([(seq, tokens)])[0]
        assert 1e-3 < float((a - b).norm() / a.norm()) < LOGITS_TOL, seq
    for step in range(5):  # decode: the absorbed batched path
        chunk = [(s, [int(torch.randint(4, 320, (1,), generator=gen))]) for s in prompts]
        a, b = torch.cat(ref.step(chunk)), torch.cat(test.step(chunk))
        assert 1e-3 < float((a - b).norm() / a.norm()) < LOGITS_TOL, step
    # the first layer's latents depend on the tokens alone: its fp8 cache holds exactly the e4m3 cast of
    # the float32 cache, slot for slot (both harnesses hand out the same blocks)
    written = test.kv_caches[0].view(torch.uint8)
    assert written.any()
    assert torch.equal(written, ref.kv_caches[0].to(FP8).view(torch.uint8))


def test_the_cache_write_saturates_and_the_reads_widen_the_same_values():
    """Out-of-range values store as +-448 (e4m3's largest finite value), never NaN; the decode and the
    expanded paths read an fp8 cache as they read its values widened to float32."""
    gen = torch.Generator().manual_seed(5)
    cache = torch.zeros(6, 4, 1, 12, dtype=FP8)
    latent = torch.randn(3, 8, generator=gen)
    latent[0, 2], latent[1, 5] = 1000.0, -500.0
    k_rope = torch.randn(3, 4, generator=gen)
    k_rope[2, 1] = 449.5
    slots = torch.tensor([5, 13, 22])
    write_latent_cache(latent, k_rope, cache, slots)
    rows = cache.view(-1, 12)[slots].float()
    want = torch.cat((latent, k_rope), dim=-1).clamp(-448, 448).to(FP8).float()
    assert not rows.isnan().any() and torch.equal(rows, want)
    assert (rows[0, 2], rows[1, 5], rows[2, 9]) == (448.0, -448.0, 448.0)
    assert int((cache.view(torch.uint8) != 0).any(-1).sum()) == 3  # no other slot touched

    cache = torch.randn(9, 4, 1, 12, generator=gen).to(FP8)
    wide = cache.float()
    tables = torch.tensor([[3, 7, 1, 0], [8, 2, 0, 0]], dtype=torch.int32)
    assert torch.equal(gather_context(cache, tables[0], 10).float(), gather_context(wide, tables[0], 10))
    q_lat, q_rope = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, 4, generator=gen)
    lens = torch.tensor([10, 6], dtype=torch.int32)
    assert torch.equal(absorbed_decode_batched(q_lat, q_rope, cache, tables, lens, 0.3),
                       absorbed_decode_batched(q_lat, q_rope, wide, tables, lens, 0.3))  # fmt: skip
    q, w_kv_b = torch.randn(5, 3, 10, generator=gen), torch.randn(3, 9, 8, generator=gen)
    assert torch.equal(expanded_attention(q, cache, w_kv_b, tables, [3, 2], [10, 6], 6, 0.3),
                       expanded_attention(q, wide, w_kv_b, tables, [3, 2], [10, 6], 6, 0.3))  # fmt: skip


def test_engine_generates_on_an_fp8_latent_cache_with_a_prefix_hit(tmp_path):
    _checkpoint(tmp_path, "v3-noaux")  # MoE layers included
    llm = LLM(str(tmp_path), kv_cache_dtype="fp8_e4m3", block_size=4, chunked_prefill_size=16)
    core = llm.engine.core
    assert core.info.kv.dtype == FP8 and all(c.dtype == FP8 for c in core.runner.kv_caches)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 320, (n,), generator=gen).tolist() for n in (3, 11, 26)]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [12, 12, 12]
    assert core.runner.kv_caches[0].view(torch.uint8).any()
    # the 26-token prompt's first 24 tokens: 6 fp8 blocks read from the prefix cache give what a fresh
    # engine computes for the same prompt without them
    shared = prompts[2][:24] + [7, 8, 9]
    manager = core.block_manager
    hits = manager.hit_tokens
    got = llm.generate([{"prompt_token_ids": shared}], params, use_tqdm=False)[0].token_ids
    assert manager.hit_tokens - hits == 24
    manager.check_no_leak()
    fresh = LLM(str(tmp_path), kv_cache_dtype="fp8_e4m3", block_size=4, chunked_prefill_size=16,
                enable_prefix_caching=False)  # fmt: skip
    assert fresh.generate([{"prompt_token_ids": shared}], params, use_tqdm=False)[0].token_ids == got


def test_loader_and_plan_count_the_same_fp8_latent_bytes(tmp_path):
    """The plan takes the cache dtype the loader applies: half of V2-Lite's bf16 latent (27 layers x 576)."""
    plain = build_plan(load_hf_config("dummy:deepseek-v2-lite"), gpu_memory_gb=141)
    fp8 = build_plan(load_hf_config("dummy:deepseek-v2-lite"), gpu_memory_gb=141, kv_cache_dtype_name="fp8_e4m3")
    assert plain["kv_bytes_per_token"] == 27 * 576 * 2 and fp8["kv_bytes_per_token"] == 27 * 576
    assert fp8["kv_cache_dtype"] == "float8_e4m3fn"
    make_hf_checkpoint(tmp_path, _dense("v2-greedy-yarn"))
    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="bfloat16", max_model_len=128,
                                     kv_cache_dtype="fp8_e4m3"), CPU)  # fmt: skip
    planned = build_plan(load_hf_config(str(tmp_path)), gpu_memory_gb=141, dtype="bf16",
                         kv_cache_dtype_name="fp8_e4m3")  # fmt: skip
    assert loaded.info.kv_bytes_per_token == planned["kv_bytes_per_token"] == 3 * (32 + 8)
