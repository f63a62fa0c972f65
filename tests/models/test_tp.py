"""Tensor parallelism on CPU (gloo): sharded layers recombine to the full layer, and --tp N engines
produce the greedy tokens of --tp 1 on tiny random checkpoints (fp32)."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_hf_checkpoint
from tp_utils import generate_on_ranks, refusal
from transformers import LlamaConfig, Qwen2MoeConfig, Qwen3Config

from graphserve import LLM, SamplingParams
from graphserve.config import EngineConfig
from graphserve.errors import ConfigError
from graphserve.layers.embedding import LMHead, VocabEmbedding
from graphserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, rms_norm_eps=1e-6)
PROMPTS = ["Hello world", "The quick brown fox jumps over", "a", "tensor parallel ranks agree on every token"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


# ---- layers: the ranks' shards add up to the whole layer --------------------------------------------------

def test_column_and_row_parallel_shards_recombine():
    torch.manual_seed(0)
    w1, b1 = torch.randn(12, 8), torch.randn(12)
    w2, b2 = torch.randn(8, 12), torch.randn(8)
    x = torch.randn(3, 8)
    full = torch.nn.functional.linear(torch.nn.functional.linear(x, w1, b1), w2, b2)
    total = torch.zeros_like(full)
    for rank in range(2):
        col, row = ColumnParallelLinear(8, 12, True, rank, 2), RowParallelLinear(12, 8, True, rank, 2)
        col.load_weight("weight", col.weight, w1, None)
        col.load_weight("bias", col.bias, b1, None)
        row.load_weight("weight", row.weight, w2, None)
        row.load_weight("bias", row.bias, b2, None)
        assert col.weight.shape == (6, 8) and row.weight.shape == (8, 6)
        total += row(col(x))  # the all-reduce
    torch.testing.assert_close(total, full)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 2), (4, 2, 4), (8, 1, 4), (4, 4, 4)])
def test_qkv_parallel_gives_each_rank_its_heads_and_their_kv_head(heads, kv_heads, tp):
    d, hidden = 4, 16
    q, k, v = torch.randn(heads * d, hidden), torch.randn(kv_heads * d, hidden), torch.randn(kv_heads * d, hidden)
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, False, rank, tp)
        for shard, t in enumerate((q, k, v)):
            layer.load_weight("weight", layer.weight, t, shard)
        local_q, local_k, local_v = layer.weight.split(layer.output_sizes)
        per_rank = heads // tp
        torch.testing.assert_close(local_q, q[rank * per_rank * d:(rank + 1) * per_rank * d])
        kv_local = max(1, kv_heads // tp)
        for j in range(kv_local):
            first_q_head = rank * per_rank + j * per_rank // kv_local
            kv_head = first_q_head // (heads // kv_heads)  # the KV head that query head reads at tp 1
            torch.testing.assert_close(local_k[j * d:(j + 1) * d], k[kv_head * d:(kv_head + 1) * d])
            torch.testing.assert_close(local_v[j * d:(j + 1) * d], v[kv_head * d:(kv_head + 1) * d])


def test_vocab_parallel_embedding_and_head_cover_a_vocab_that_does_not_divide():
    torch.manual_seed(0)
    vocab, hidden = 11, 4
    table = torch.randn(vocab, hidden)
    ids = torch.arange(vocab)
    looked_up = torch.zeros(vocab, hidden)
    logits = []
    x = torch.randn(2, hidden)
    for rank in range(3):  # 4 rows per rank, the last rank's 4th row is padding
        emb, head = VocabEmbedding(vocab, hidden, rank, 3), LMHead(hidden, vocab, rank, 3)
        emb.load_weight("weight", emb.weight, table, None)
        head.load_weight("weight", head.weight, table, None)
        local = ids - emb.vocab_start
        inside = (local >= 0) & (local < emb.num_embeddings)
        looked_up[inside] += emb.weight[local[inside]]
        logits.append(torch.nn.functional.linear(x, head.weight))
    torch.testing.assert_close(looked_up, table)
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], x @ table.T)


def test_tp1_layers_are_the_plain_linear():
    """At tp 1 both split layers hold the whole checkpoint tensor and compute the plain linear of it."""
    torch.manual_seed(1)
    x = torch.randn(3, 8)
    for layer, w, b in ((ColumnParallelLinear(8, 12, True), torch.randn(12, 8), torch.randn(12)),
                        (RowParallelLinear(8, 12, True), torch.randn(12, 8), torch.randn(12))):
        assert layer.rank_slice(None) is None and layer.weight.shape == (12, 8)
        layer.load_weight("weight", layer.weight, w, None)
        layer.load_weight("bias", layer.bias, b, None)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w, b))


# ---- engines: --tp N greedy tokens == --tp 1 ------------------------------------------------------------

def _layer_counts(model) -> tuple[int, int]:  # noqa: ANN001
    moe_shape = getattr(model, "moe_shape", None)
    return len(model.model.layers), len(moe_shape.sparse_layers) if moe_shape is not None else 0


def _generate(folder, **kw) -> list[list[int]]:
    return generate_on_ranks(folder, PROMPTS, GREEDY, _layer_counts, num_kv_tokens=2048, chunked_prefill_size=64,
                             **kw)


@pytest.mark.parametrize(("name", "config", "tp"), [
    # biases everywhere (the row-parallel bias is added once) and a vocabulary that does not split evenly
    ("llama-bias", lambda: LlamaConfig(**_TINY, num_key_value_heads=2, vocab_size=321, attention_bias=True,
                                       mlp_bias=True, rope_theta=10000.0), 2),
    # q/k norm, tied head, 2 KV heads replicated over 4 ranks
    ("qwen3-tied-tp4", lambda: Qwen3Config(**_TINY, num_key_value_heads=2, vocab_size=322, head_dim=16,
                                           tie_word_embeddings=True, rope_theta=1000000.0), 4),
])
def test_tp_greedy_tokens_match_tp1(tmp_path, name, config, tp):
    make_hf_checkpoint(tmp_path, config())
    # the overlap schedule at tp 2: a step's inputs hold stand-ins for the tokens of the step in flight,
    # resolved on the driver before they are broadcast
    overlap = "on" if tp == 2 else "off"
    assert _generate(tmp_path, tp=tp, overlap_schedule=overlap) == _generate(tmp_path)


def test_tp_that_does_not_divide_heads_is_refused_naming_the_values_that_work(tmp_path):
    make_hf_checkpoint(tmp_path, LlamaConfig(**_TINY, num_key_value_heads=2, vocab_size=320))
    e = refusal(tmp_path, "--tp", "3")
    assert e.param == "tp" and "num_attention_heads=4" in e.message and "[1, 2, 4]" in e.message
    e = refusal(tmp_path, "--ep", "2")
    assert e.param == "ep" and "no experts" in e.message
    with pytest.raises(ConfigError, match="--ep 2"):
        EngineConfig(tp=2, ep=4)


def test_moe_tp_and_ep_greedy_tokens_match_tp1(tmp_path):
    # dense layers 0 and 2 (replicated at --ep 2, so they must not be summed over ranks), sparse layer 1 with a
    # shared expert (added once before the experts' all-reduce), 4 experts: 2 per rank at --ep 2
    make_hf_checkpoint(tmp_path, Qwen2MoeConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rms_norm_eps=1e-6, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=2, rope_theta=1000000.0))
    reference = _generate(tmp_path)
    assert _generate(tmp_path, tp=2) == reference
    assert _generate(tmp_path, ep=2) == reference
    assert _generate(tmp_path, tp=2, ep=2) == reference  # attention split, experts placed whole


def test_ep_that_does_not_divide_the_experts_is_refused(tmp_path):
    make_hf_checkpoint(tmp_path, Qwen2MoeConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2))
    with pytest.raises(ConfigError) as e:
        LLM(str(tmp_path), ep=3)
    assert e.value.param == "ep" and "num_experts=4" in e.value.message and "[1, 2, 4]" in e.value.message


def test_a_dead_rank_fails_the_next_step_instead_of_hanging(tmp_path):
    """In the user's own process (LLM), a rank that dies marks the engine dead: the surviving ranks are
    stopped and every later step raises RankFailure at once (the server's engine process exits instead:
    tests/server/test_tp_server.py)."""
    import signal
    import time

    from graphserve.engine.ranks import RankFailure

    make_hf_checkpoint(tmp_path, LlamaConfig(**_TINY, num_key_value_heads=2, vocab_size=320))
    llm = LLM(str(tmp_path), dtype="float32", num_kv_tokens=1024, tp=2)
    core = llm.engine.core
    try:
        assert len(llm.generate(["warm"], GREEDY, use_tqdm=False)[0].token_ids) == GREEDY.max_tokens
        core.ranks.procs[0].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while core.ranks.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert core.ranks.failure is not None and "exited with code -9" in core.ranks.failure
        started = time.monotonic()
        with pytest.raises(RankFailure, match="rank died"):
            llm.generate(["after"], GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 5
    finally:
        core.shutdown()


def test_custom_all_reduce_buffer_takes_the_model_dtype():
    from graphserve.models.parallel_check import model_dtype

    assert model_dtype(EngineConfig(model="dummy:llama3-8b")) == torch.bfloat16  # the checkpoint's
    assert model_dtype(EngineConfig(model="dummy:llama3-8b", dtype="float16")) == torch.float16
