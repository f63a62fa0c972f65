"""The decode host path: per-sequence rows, the packed decode batch and gathered sampling knobs
give exactly what the general per-token path and ``tensors_from_sequences`` give."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from model_utils import apply_sampled

from graphserve.config import EngineConfig
from graphserve.engine.kv_cache import BlockManager
from graphserve.engine.request import Sequence
from graphserve.engine.runner import ModelRunner
from graphserve.engine.sampling_inputs import tensors_from_sequences
from graphserve.engine.scheduler import Scheduler
from graphserve.engine.seq_rows import SequenceRows
from graphserve.kernels.paged_kv import DUMMY_BLOCK
from graphserve.layers.kv_layout import KVLayout
from graphserve.sampling_params import SamplingParams

BS = 4
VOCAB = 50
EOS = 2
BATCH_FIELDS = ["input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                "logits_indices"]
KNOB_FIELDS = ["temperature", "top_k", "top_p", "min_p", "seeds", "steps", "presence", "frequency", "repetition",
               "output_counts", "prompt_mask", "banned"]
FLAG_FIELDS = ["max_logprobs", "all_greedy", "any_top_k", "any_top_p", "any_min_p"]


def _runner(num_blocks: int) -> ModelRunner:
    info = SimpleNamespace(kv=KVLayout("kv", 1, 1, 2, torch.float32), dtype=torch.float32, vocab_size=VOCAB,
                           eos_token_ids=[EOS])
    loaded = SimpleNamespace(model=None, info=info)
    return ModelRunner(EngineConfig(block_size=BS, chunked_prefill_size=16), loaded, num_blocks, torch.device("cpu"))


def _seq(i: int, prompt_len: int, params: SamplingParams) -> Sequence:
    prompt = [(7 * i + j) % (VOCAB - 3) + 3 for j in range(prompt_len)]
    return Sequence(f"r{i}", 0, prompt, params, seed=100 + i, arrival_time=float(i))


PARAMS = [
    SamplingParams(max_tokens=30, temperature=0.0),
    SamplingParams(max_tokens=30, temperature=0.7, top_k=5, top_p=0.9, seed=1),
    SamplingParams(max_tokens=30, temperature=1.0, top_k=VOCAB + 10, min_p=0.1, logprobs=3),
    SamplingParams(max_tokens=30, temperature=0.5, top_k=0, presence_penalty=0.5, repetition_penalty=1.2),
    SamplingParams(max_tokens=30, temperature=0.0, min_tokens=4, stop_token_ids=[9], logprobs=0),
    SamplingParams(max_tokens=30, temperature=0.9, frequency_penalty=0.3, min_tokens=2, ignore_eos=True),
]


def _assert_same(a, b, fields) -> None:
    for f in fields:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f
        else:
            assert x == y, f


@pytest.mark.parametrize("num_blocks", [200, 14])  # 14: the pool runs short and sequences get preempted
def test_decode_fast_path_and_knob_rows_match_the_general_path(num_blocks):
    runner = _runner(num_blocks)
    sched = Scheduler(EngineConfig(block_size=BS, chunked_prefill_size=16), BlockManager(num_blocks, BS))
    for i in range(10):
        sched.add(_seq(i, 3 + 2 * i % 9, PARAMS[i % len(PARAMS)]))
    decode_steps = preempted = 0
    for step in range(80):
        out = sched.schedule()
        if out.is_empty:
            break
        preempted += len(out.preempted)
        seqs = [s.seq for s in out.scheduled]
        rows = runner.seq_rows.gather(seqs)
        batch = runner.prepare_inputs(out, rows)
        if batch.mode == "decode":
            decode_steps += 1
            general = runner._general_batch(out)
            _assert_same(batch, general, [*BATCH_FIELDS, "max_query_len", "max_seq_len", "query_lens_cpu",
                                          "seq_lens_cpu"])
        knobs = runner.sampling_tensors(seqs, rows, VOCAB)
        _assert_same(knobs, tensors_from_sequences(seqs, VOCAB, [EOS], "cpu"), KNOB_FIELDS + FLAG_FIELDS)
        tokens = [(step * 5 + i) % VOCAB for i in range(len(seqs))]
        for seq, _ in apply_sampled(sched, out, tokens):
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
    assert decode_steps > 10
    assert (preempted > 0) == (num_blocks == 14)


def test_sequence_rows_follow_block_tables_and_make_room():
    rows = SequenceRows(capacity=2, width=2)
    a, b, c = (_seq(i, 5, PARAMS[i]) for i in range(3))
    a.block_table, b.block_table = [4, 5], [6]
    a.num_computed_tokens = b.num_computed_tokens = 4
    r = rows.gather([a, b])
    assert r.width == 2 and r.positions.tolist() == [4, 4] and r.num_outputs.tolist() == [0, 0]
    assert r.tokens.tolist() == [a.prompt_token_ids[4], b.prompt_token_ids[4]]
    assert rows.block_tables[r.rows].tolist() == [[4, 5], [6, DUMMY_BLOCK]]
    # grown past the table's width at the end; then replaced by a shorter list (freed, allocated again)
    a.block_table += [7, 8, 9]
    b.block_table = [3]
    a.output_token_ids = [11]
    r = rows.gather([a, b])
    assert r.width == 5 and r.num_outputs.tolist() == [1, 0]
    assert rows.block_tables[r.rows, :5].tolist() == [[4, 5, 7, 8, 9], [3, 0, 0, 0, 0]]
    assert rows.ints[r.rows[1]].tolist()[1] == b.seed
    # a newcomer while full: the row of a sequence outside the batch (b) is reused
    c.block_table = [10]
    r = rows.gather([a, c])
    assert rows.capacity == 2 and len(rows) == 2
    assert rows.block_tables[r.rows[1]].tolist()[:2] == [10, DUMMY_BLOCK]
    assert rows.floats[r.rows[1]].tolist() == pytest.approx([c.params.temperature, c.params.top_p, c.params.min_p,
                                                             0.0, 0.0, 1.0])
    # more sequences in one batch than rows: the tables grow and keep what they held
    b.block_table = [12, 13]
    r = rows.gather([a, b, c])
    assert rows.capacity >= 3 and len(set(r.rows.tolist())) == 3
    assert rows.block_tables[r.rows, :2].tolist() == [[4, 5], [12, 13], [10, DUMMY_BLOCK]]


def test_decode_batch_is_one_buffer_of_the_right_dtypes():
    runner = _runner(40)
    sched = Scheduler(EngineConfig(block_size=BS, chunked_prefill_size=64), BlockManager(40, BS))
    for i in range(3):
        sched.add(_seq(i, 6, PARAMS[0]))
    apply_sampled(sched, sched.schedule(), [5, 6, 7])  # the prompts, whole
    batch = runner.prepare_inputs(sched.schedule())
    assert batch.mode == "decode"
    dtypes = {f: getattr(batch, f).dtype for f in BATCH_FIELDS}
    assert dtypes == {"input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
                      "query_start_loc": torch.int32, "seq_lens": torch.int32, "block_tables": torch.int32,
                      "logits_indices": torch.int64}
    storages = {getattr(batch, f).untyped_storage().data_ptr() for f in BATCH_FIELDS}
    assert len(storages) == 1  # every field is a view of the one copied buffer
    assert batch.input_ids.tolist() == [5, 6, 7] and batch.positions.tolist() == [6, 6, 6]
    assert np.array_equal(batch.seq_lens.numpy(), [7, 7, 7]) and batch.query_start_loc.tolist() == [0, 1, 2, 3]


def test_host_path_benchmark_times_every_piece_of_a_real_step():
    """benchmarks/host_path wraps the engine's own methods by name: it must keep finding them."""
    from benchmarks.host_path import PIECES, measure

    result = measure("builtin:tiny-llama", batch=4, steps=5, prompt_len=8, sampling="mixed", stop_strings="half")
    # every wrapper fired: a method the step no longer calls would leave its piece at 0 (or, for
    # sampling_tensors, the launch remainder, negative) and its time in "other"
    named = [k for k in PIECES if k != "other"]
    assert all(result[k] > 0 for k in named), {k: result[k] for k in named}
    assert result["sampler"] > 0
    # the named pieces account for the step: what no wrapper saw ("other", the step's wall time minus
    # the pieces) stays a small part of the host total
    assert result["other"] < 0.5 * result["host_total"], result
