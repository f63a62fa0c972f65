"""The engine's scheduling must never change what greedy decoding produces.

Every configuration (batching, staggered arrival, chunked prefill, prefix-cache hits,
preemption, n > 1) is compared token for token with each prompt run alone, once with each step
run to the end before the next is scheduled and once with the overlap schedule (step N+1 prepared
before step N's tokens are read). After every test, all KV blocks are free or held only by the
prefix cache.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_utils import make_hf_checkpoint
from transformers import LlamaConfig

from graphserve import LLM, SamplingParams
from graphserve.engine.offline import OfflineDriver

NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine-llama")
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=1)
    make_hf_checkpoint(folder, config)
    return str(folder)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(4, 320, (20,), generator=gen).tolist()
    return [
        torch.randint(4, 320, (5,), generator=gen).tolist(),
        torch.randint(4, 320, (37,), generator=gen).tolist(),
        shared + torch.randint(4, 320, (9,), generator=gen).tolist(),
        shared + torch.randint(4, 320, (3,), generator=gen).tolist(),
        torch.randint(4, 320, (18,), generator=gen).tolist(),
    ]


@pytest.fixture(params=["off", "on"], ids=["sync", "overlap"])
def make_llm(model_dir, request):
    made: list[LLM] = []

    def make(**kw) -> LLM:
        kw.setdefault("block_size", 4)
        kw.setdefault("overlap_schedule", request.param)
        llm = LLM(model_dir, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:  # no leak: every block is free or only held by the prefix cache
        assert not llm.engine.has_unfinished_requests()
        llm.engine.core.block_manager.check_no_leak()


@pytest.fixture(scope="module")
def alone(model_dir, prompts):
    llm = LLM(model_dir, block_size=4, enable_prefix_caching=False, overlap_schedule="off")
    return [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_batched_prompts_of_different_lengths(make_llm, prompts, alone):
    outs = make_llm(enable_prefix_caching=False).generate(_ids(prompts), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == alone


def test_chunked_prefill_at_16(make_llm, prompts, alone):
    llm = make_llm(chunked_prefill_size=16)
    outs = llm.generate(_ids(prompts), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == alone
    kinds = {r.kind for r in llm.engine.core.telemetry.records()}
    assert "mixed" in kinds  # decodes really ran beside prefill chunks


def test_staggered_arrival_continuous_batching(make_llm, prompts, alone):
    engine: OfflineDriver = make_llm(chunked_prefill_size=16).engine
    arrivals = {0: [0, 1], 3: [2], 5: [3], 9: [4]}
    results, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, GREEDY)
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = out.token_ids
        step += 1
    assert [results[i] for i in range(len(prompts))] == alone


def test_prefix_cache_hit_gives_same_tokens(make_llm, prompts, alone):
    llm = make_llm()
    first = llm.generate(_ids(prompts), GREEDY, use_tqdm=False)
    again = llm.generate(_ids(prompts), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first] == alone == [o.token_ids for o in again]
    assert all(o.metrics.num_cached_tokens > 0 for o in again)
    assert again[1].metrics.num_cached_tokens == 36  # every full block but the one with the last token
    assert llm.engine.stats().prefix_cache_hit_rate > 0.3


def test_preemption_gives_same_tokens(make_llm, prompts, alone):
    # 96 tokens of KV: every prompt fits alone, but not all at once.
    llm = make_llm(num_kv_tokens=96, enable_prefix_caching=False)
    outs = llm.generate(_ids(prompts), GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == alone


def test_n_greedy_choices_share_the_prompt(make_llm, prompts, alone):
    llm = make_llm()
    params = SamplingParams(n=3, temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(_ids(prompts[1:3]), params, use_tqdm=False)
    for out, want in zip(outs, alone[1:3]):
        assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == want for c in out.outputs)
    assert outs[0].metrics.num_cached_tokens == 0
    assert llm.engine.core.block_manager.hit_tokens >= 2 * 36  # siblings hit every full prompt block


def test_seeded_sampling_is_reproducible_across_batches(make_llm, prompts):
    llm = make_llm()
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=NEW, ignore_eos=True)
    alone = llm.generate(_ids(prompts[:1]), seeded, use_tqdm=False)[0].token_ids
    other = SamplingParams(temperature=0.8, max_tokens=NEW, ignore_eos=True)
    mixed = llm.generate(_ids(prompts), [other, seeded, other, seeded, other], use_tqdm=False)
    # prompt 0 placed in a batch at another position, with other sampled neighbours
    again = llm.generate(_ids([prompts[2], prompts[0]]), [other, seeded], use_tqdm=False)[1].token_ids
    assert alone == again
    assert mixed[1].token_ids != mixed[3].token_ids  # different prompts, same seed: not a fixed sequence
    n2 = llm.generate(_ids(prompts[:1]), dataclasses.replace(seeded, n=2), use_tqdm=False)[0]
    assert n2.outputs[0].token_ids == alone and n2.outputs[1].token_ids != alone  # siblings differ


def test_stop_token_id_and_stop_string(make_llm, prompts, alone):
    llm = make_llm()
    stop_id = alone[1][5]
    cut = alone[1].index(stop_id)
    out = llm.generate(_ids(prompts[1:2]), SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    assert out.token_ids == alone[1][: cut + 1]

    full = llm.generate(_ids(prompts[1:2]), GREEDY, use_tqdm=False)[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    out = llm.generate(_ids(prompts[1:2]), SamplingParams(temperature=0.0, max_tokens=NEW, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == full[: full.index(stop)]
    # the engine finished it on the token that completed the stop string: none made past it, no abort needed
    tok = llm.get_tokenizer()
    ends = next(i for i in range(1, NEW + 1) if stop in tok.decode(alone[1][:i], skip_special_tokens=True))
    assert out.token_ids == alone[1][:ends]


def test_min_tokens_holds_back_stop_ids(make_llm, prompts, alone):
    llm = make_llm()
    first = alone[0][0]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=3, stop_token_ids=[first])
    out = llm.generate(_ids(prompts[:1]), params, use_tqdm=False)[0]
    assert first not in out.token_ids[:3] and len(out.token_ids) >= 3


def test_logprobs(make_llm, prompts, alone):
    llm = make_llm()
    out = llm.generate(_ids(prompts[:1]), SamplingParams(temperature=0.0, max_tokens=6, logprobs=3,
                                                          ignore_eos=True), use_tqdm=False)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 6
    for tok, lp in zip(out.token_ids, lps):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok and lp.top[0][1] == pytest.approx(lp.logprob)  # greedy: the best one
        assert lp.logprob <= 0 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_abort_frees_blocks_and_reports_abort(make_llm, prompts):
    engine = make_llm().engine
    engine.stream_outputs = True  # outputs of unfinished requests too, as a server sees them
    engine.add_request("a", {"prompt_token_ids": prompts[1]}, GREEDY)
    engine.add_request("b", {"prompt_token_ids": prompts[2]}, GREEDY)
    delivered = [o for _ in range(3) for o in engine.step() if o.request_id == "a"]
    engine.abort_request("a")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    # the abort keeps what was delivered (a token of a step still in flight is dropped)
    assert delivered and finished["a"].finish_reason == "abort"
    assert finished["a"].token_ids == delivered[-1].token_ids
    assert finished["b"].finish_reason == "length" and len(finished["b"].token_ids) == NEW


def test_step_fault_fails_its_requests_and_engine_keeps_serving(make_llm, prompts, alone, monkeypatch):
    llm = make_llm()
    runner = llm.engine.core.runner
    real = runner.launch

    def broken(out, token_mask=None):
        monkeypatch.setattr(runner, "launch", real)  # fail once
        raise RuntimeError("injected fault")

    monkeypatch.setattr(runner, "launch", broken)
    failed = llm.generate(_ids(prompts[:2]), GREEDY, use_tqdm=False)
    assert all(o.error and "injected fault" in o.error and o.finish_reason == "abort" for o in failed)
    ok = llm.generate(_ids(prompts[:1]), GREEDY, use_tqdm=False)[0]
    assert ok.error is None and ok.token_ids == alone[0]


def test_telemetry_records_each_step(make_llm, prompts):
    llm = make_llm()
    assert llm.engine.core.telemetry.last_step() == 0  # no step yet
    llm.generate(_ids(prompts[:2]), GREEDY, use_tqdm=False)
    recs = llm.engine.core.telemetry.records()
    assert recs[0].kind == "prefill" and recs[-1].kind == "decode"
    assert llm.engine.core.telemetry.last_step() == recs[-1].step == len(recs)
    assert all(r.padded_size == r.batch_size and not r.graph and r.step_ms > 0 for r in recs)
    assert sum(r.decode_tokens for r in recs) + 2 == 2 * NEW
    lens = [len(p) for p in prompts[:2]]
    assert recs[0].context_tokens == sum(lens)  # both prompts whole
    assert recs[-1].context_tokens == sum(lens) + 2 * (NEW - 1)  # the last token of each attends to all before it


def test_penalties_beside_plain_requests_match_each_request_alone(make_llm, model_dir, prompts):
    """Penalties count the output tokens on the host, so such steps wait for the step in flight; seeded
    sampling makes each request's tokens its own, so the batch (either schedule) must give what each
    request gives run alone on the synchronous engine."""
    penalized = SamplingParams(temperature=0.8, seed=5, max_tokens=NEW, ignore_eos=True,
                               repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    plain = SamplingParams(temperature=0.7, seed=9, max_tokens=NEW, ignore_eos=True)
    stops = dataclasses.replace(penalized, seed=6, stop_token_ids=list(range(40, 320)))  # stops within a few tokens
    params = [penalized, plain, stops, plain]
    reference = LLM(model_dir, block_size=4, enable_prefix_caching=False, overlap_schedule="off")
    want = [reference.generate(_ids([p]), [q], use_tqdm=False)[0].token_ids for p, q in zip(prompts[:4], params)]
    got = [o.token_ids for o in make_llm().generate(_ids(prompts[:4]), params, use_tqdm=False)]
    assert got == want
    assert len(want[2]) < NEW  # the stop request finished early, while others were in flight


def test_overlap_schedule_keeps_one_step_in_flight(make_llm, prompts):
    engine = make_llm().engine
    engine.stream_outputs = True
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, GREEDY)
    first = engine.step()
    overlap = engine.core.overlap
    assert (engine.core._inflight is not None) == overlap
    assert len(first) == (0 if overlap else 1)  # with overlap, the prefill's token arrives next call
    while engine.has_unfinished_requests():
        engine.step()
