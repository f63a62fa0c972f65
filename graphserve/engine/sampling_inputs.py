"""The sampler's inputs built from the engine's sequences: knob rows and the token-set masks.

The sampler (layers/sampler.py) sees tensors only; this is where a batch of ``Sequence`` objects
becomes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from graphserve.layers.sampler import (
    FLAG_GREEDY,
    FLAG_MIN_P,
    FLAG_PENALTY,
    FLAG_TOP_P,
    INT_FLAGS,
    INT_LOGPROBS,
    INT_MIN_TOKENS,
    INT_SEED,
    INT_TOP_K,
    NUM_FLOAT_KNOBS,
    NUM_INT_KNOBS,
    SEED_MASK,
    SamplingTensors,
)

if TYPE_CHECKING:
    from graphserve.engine.request import Sequence


def tensors_from_sequences(
    seqs: list[Sequence], vocab_size: int, eos_token_ids: list[int], device: torch.device | str
) -> SamplingTensors:
    """Two host->device copies for the knobs, plus one per token-set mask a batch needs."""
    rows = [knob_row(s) for s in seqs]
    floats = np.array([r[0] for r in rows], dtype=np.float32).reshape(len(seqs), NUM_FLOAT_KNOBS)
    ints = np.array([r[1] for r in rows], dtype=np.int64).reshape(len(seqs), NUM_INT_KNOBS)
    steps = np.array([s.num_output_tokens for s in seqs], dtype=np.int64)
    return tensors_from_rows(floats, ints, steps, seqs, vocab_size, eos_token_ids, device)

def tensors_from_rows(
    floats: np.ndarray, ints: np.ndarray, steps: np.ndarray, seqs: list[Sequence], vocab_size: int,
    eos_token_ids: list[int], device: torch.device | str, upload=None,
) -> SamplingTensors:
    """The batch's tensors from its knob rows (``knob_row`` per sequence, stacked: [B, 6] float32
    and [B, 5] int64, top_k as asked) and each row's output length ``steps``.

    The flags come from whole-column numpy reductions; ``seqs`` is read only for the token-set
    masks (penalties, min_tokens) a batch needs. ``upload(*arrays) -> tensors`` sends the knob
    arrays to the device (the engine passes its pinned staging); by default a plain copy."""
    k = ints[:, INT_TOP_K]
    top_k = np.where((k > 0) & (k < vocab_size), k, vocab_size)  # off (-1, 0) or >= vocab: the vocab size
    packed = np.empty((len(steps), 3), dtype=np.int64)
    packed[:, 0] = top_k
    packed[:, 1] = ints[:, INT_SEED]
    packed[:, 2] = steps
    floats = np.ascontiguousarray(floats, dtype=np.float32)
    if upload is None:
        knobs, tokens = (torch.from_numpy(a).to(device, non_blocking=True) for a in (floats, packed))
    else:
        knobs, tokens = upload(floats, packed)
    flags = ints[:, INT_FLAGS]
    flags_any = int(np.bitwise_or.reduce(flags)) if len(flags) else 0
    flags_all = int(np.bitwise_and.reduce(flags)) if len(flags) else FLAG_GREEDY
    output_counts = prompt_mask = banned = None
    if flags_any & FLAG_PENALTY:
        output_counts = _token_rows([s.output_token_ids for s in seqs], vocab_size, device, count=True)
        prompt_mask = _token_rows(
            [s.prompt_token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs], vocab_size, device
        ).bool()
    if bool((steps < ints[:, INT_MIN_TOKENS]).any()):
        rows = [
            [*(() if s.params.ignore_eos else eos_token_ids), *s.params.stop_token_ids]
            # a constrained row's grammar decides where its output may end (it allows eos only then)
            if s.num_output_tokens < s.params.min_tokens and s.params.structured is None else []
            for s in seqs
        ]
        banned = _token_rows(rows, vocab_size, device).bool()
    return SamplingTensors(
        temperature=knobs[:, 0],
        top_p=knobs[:, 1],
        min_p=knobs[:, 2],
        presence=knobs[:, 3],
        frequency=knobs[:, 4],
        repetition=knobs[:, 5],
        top_k=tokens[:, 0],
        seeds=tokens[:, 1],
        steps=tokens[:, 2],
        output_counts=output_counts,
        prompt_mask=prompt_mask,
        banned=banned,
        max_logprobs=int(ints[:, INT_LOGPROBS].max()) if len(ints) else -1,
        all_greedy=bool(flags_all & FLAG_GREEDY),
        any_top_k=bool((top_k < vocab_size).any()),
        any_top_p=bool(flags_any & FLAG_TOP_P),
        any_min_p=bool(flags_any & FLAG_MIN_P),
    )


def knob_row(seq: Sequence) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """A sequence's sampling knobs as one float row and one int row (see the column names above).

    They never change while the sequence lives, so the engine computes them once per sequence.
    The flags are decided on the Python floats, so a batch's fast paths match the request exactly.
    """
    p = seq.params
    flags = (
        (FLAG_GREEDY if p.temperature == 0.0 else 0)
        | (FLAG_TOP_P if p.top_p < 1.0 else 0)
        | (FLAG_MIN_P if p.min_p > 0.0 else 0)
        | (FLAG_PENALTY if p.has_penalties else 0)
    )
    floats = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
    logprobs = -1 if p.logprobs is None else p.logprobs
    return floats, (p.top_k, seq.seed & SEED_MASK, p.min_tokens, logprobs, flags)


def _token_rows(rows: list[list[int]], vocab_size: int, device, count: bool = False) -> torch.Tensor:
    """[B, V] float32: per row, how often (``count``) or whether each token id occurs in ``rows[i]``.

    Rows are padded with an extra id ``vocab_size`` (a spare column dropped at the end), so the
    whole batch is one copy and one scatter; ids outside the vocabulary land in the spare column.
    """
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), vocab_size, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64).clamp_(0, vocab_size)
    ids = ids.to(device, non_blocking=True)
    out = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    if count:
        out.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    else:
        out.scatter_(1, ids, 1.0)
    return out[:, :vocab_size]
