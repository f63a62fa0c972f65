"""Sampler unit tests on hand-built logits (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from graphserve.engine.request import Sequence
from graphserve.engine.sampling_inputs import tensors_from_sequences
from graphserve.layers.sampler import Sampler, apply_penalties, uniform_noise
from graphserve.sampling_params import SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]
EOS = 3


def _seq(params: SamplingParams, seed: int = 0, outputs: list[int] | None = None, prompt=(1, 2)) -> Sequence:
    s = Sequence("r", 0, list(prompt), params, seed=seed, arrival_time=0.0)
    s.output_token_ids = list(outputs or [])
    return s


def _sample(seqs, logits):
    t = tensors_from_sequences(seqs, logits.shape[-1], [EOS], "cpu")
    return Sampler()(logits, t)


def _logits(rows: int) -> torch.Tensor:
    return torch.tensor(PROBS).log().repeat(rows, 1)


def _histogram(params: SamplingParams, rows: int = 4000) -> list[float]:
    out = _sample([_seq(params, seed=i) for i in range(rows)], _logits(rows))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=len(PROBS)).float() / rows
    return counts.tolist()


def test_noise_is_uniform_and_keyed_by_seed_and_step():
    u = uniform_noise(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 1]), 5000)
    assert 0.0 < u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    again = uniform_noise(torch.tensor([1]), torch.tensor([0]), 5000)
    assert torch.equal(again[0], u[0])


def test_greedy_is_argmax_of_logits():
    logits = torch.randn(5, 50)
    out = _sample([_seq(SamplingParams(temperature=0.0)) for _ in range(5)], logits)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_temperature_one_matches_softmax():
    freqs = _histogram(SamplingParams(temperature=1.0))
    for f, p in zip(freqs, PROBS):
        assert abs(f - p) < 0.03, (freqs, PROBS)


def test_low_temperature_sharpens():
    freqs = _histogram(SamplingParams(temperature=0.25))
    sharp = torch.tensor(PROBS).log().div(0.25).softmax(-1).tolist()
    assert freqs[0] > 0.85
    for f, p in zip(freqs, sharp):
        assert abs(f - p) < 0.03


def test_seed_gives_same_token_whatever_the_batch():
    logits = torch.randn(1, 100)
    params = SamplingParams(temperature=1.0, seed=7)
    alone = _sample([_seq(params, seed=7)], logits).token_ids[0]
    others = [_seq(SamplingParams(temperature=0.8, top_k=5), seed=i) for i in range(6)]
    batch = torch.cat([torch.randn(3, 100), logits, torch.randn(3, 100)])
    mixed = _sample(others[:3] + [_seq(params, seed=7)] + others[3:], batch).token_ids[3]
    assert alone == mixed
    draws = {_sample([_seq(params, seed=s)], logits).token_ids[0] for s in range(40)}
    assert len(draws) > 1  # different seeds do differ


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=1), {0}),
        (SamplingParams(top_p=0.7), {0, 1}),
        (SamplingParams(top_p=0.5), {0}),
        (SamplingParams(top_p=0.9), {0, 1, 2}),
        (SamplingParams(min_p=0.35), {0, 1}),
        (SamplingParams(min_p=0.2), {0, 1, 2}),
    ],
)
def test_top_k_top_p_min_p_masks(params, allowed):
    freqs = _histogram(params, rows=1500)
    seen = {i for i, f in enumerate(freqs) if f > 0}
    assert seen == allowed, freqs
    if params.top_k == 2:  # renormalized over the kept tokens
        assert abs(freqs[0] - 0.5 / 0.8) < 0.04


def test_penalties_values():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seq = _seq(SamplingParams(repetition_penalty=2.0), outputs=[1], prompt=[0])
    t = tensors_from_sequences([seq], 4, [EOS], "cpu")
    out = apply_penalties(logits, t)
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # positive logits halve, negative double; unseen stay

    seq = _seq(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), outputs=[2, 2, 0])
    t = tensors_from_sequences([seq], 4, [EOS], "cpu")
    out = apply_penalties(logits, t)
    assert torch.allclose(out, torch.tensor([[2.0 - 0.5 - 0.25, -2.0, 1.0 - 1.0 - 0.25, 0.5]]))


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    plain = _sample([_seq(SamplingParams(temperature=0.0), outputs=[0, 0])], logits).token_ids
    penalized = _sample([_seq(SamplingParams(temperature=0.0, frequency_penalty=0.2), outputs=[0, 0])], logits)
    assert plain == [0] and penalized.token_ids == [1]
    # a negative presence penalty encourages repeating
    logits = torch.tensor([[2.9, 3.0, 0.0, 0.0]])
    boosted = _sample([_seq(SamplingParams(temperature=0.0, presence_penalty=-0.5), outputs=[0])], logits)
    assert boosted.token_ids == [0]


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 1.0, 5.0]])  # eos (3) is the favourite, then 2
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    early = _sample([_seq(params, outputs=[0])], logits).token_ids
    assert early[0] not in (2, EOS)
    done = _sample([_seq(params, outputs=[0, 1])], logits).token_ids
    assert done == [EOS]


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 30)
    seqs = [
        _seq(SamplingParams(temperature=0.0, logprobs=5)),
        _seq(SamplingParams(temperature=0.7, top_k=3, logprobs=2), seed=3),
        _seq(SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=0), outputs=[4]),
    ]
    out = _sample(seqs, logits)
    ref = torch.log_softmax(logits, -1)
    assert len(out.top_ids) == 3 and all(len(r) == 5 for r in out.top_ids)
    for i, tok in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[i], ref[i, tok].item(), rel_tol=1e-5, abs_tol=1e-6)
        top = ref[i].topk(5)
        assert out.top_ids[i] == top.indices.tolist()
        assert torch.allclose(torch.tensor(out.top_logprobs[i]), top.values, atol=1e-6)
