"""DeepSeek-V4 on its Triton kernels (the path the Triton attention backend takes: kernels/v4_compress.py,
kernels/v4_attention.py, the compressed indexer scores and the radix top-k; the hyper-connections on
kernels/hyper_connection.py) against the same model on
kernels/v4_reference.py, on CPU through Triton's interpreter: tests/models/test_deepseek_v4.py's tiny fp32 checkpoint (HCA,
CSA with index_topk 3, a sliding layer, window 8, rates 4 and 16), a prefill, an extend chunk beside another
sequence's whole prompt, then decode steps, with contexts past the window, both rates and index_topk. The real
shapes, bf16 and CUDA graphs are tests/gpu/test_deepseek_v4_gpu.py's."""

from __future__ import annotations

import torch
from interp_setup import use_interpreter
from model_utils import PagedHarness, relative_error

use_interpreter()

from test_deepseek_v4 import _checkpoint, _config  # noqa: E402  # isort: skip

from graphserve.config import EngineConfig  # noqa: E402
from graphserve.layers.attention import TorchAttentionBackend  # noqa: E402
from graphserve.layers.attention_triton import TritonAttentionBackend  # noqa: E402
from graphserve.models.loader import load_model  # noqa: E402


def test_model_on_the_kernels_matches_the_reference(tmp_path, monkeypatch):
    from graphserve.kernels import dsa_indexer, hyper_connection, v4_attention, v4_compress
    from graphserve.models import deepseek_v4_attention

    calls = {"attention": 0, "compress": 0, "indexer": 0, "hc_pre": 0, "hc_merge": 0, "hc_head": 0, "rope": 0}

    def counted(key, fn):
        def run(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(v4_attention, "v4_attention", counted("attention", v4_attention.v4_attention))
    monkeypatch.setattr(v4_compress, "compress_groups", counted("compress", v4_compress.compress_groups))
    monkeypatch.setattr(dsa_indexer, "compressed_indexer_scores",
                        counted("indexer", dsa_indexer.compressed_indexer_scores))  # fmt: skip
    monkeypatch.setattr(deepseek_v4_attention, "v4_rope", counted("rope", deepseek_v4_attention.v4_rope))
    for name in ("hc_pre", "hc_merge", "hc_head"):
        monkeypatch.setattr(hyper_connection, name, counted(name, getattr(hyper_connection, name)))
    _checkpoint(tmp_path, _config())
    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="float32", max_model_len=128, block_size=4),
                        torch.device("cpu"))  # fmt: skip
    harnesses = [PagedHarness(loaded.model, block_size=4, num_blocks=40, backend=backend)
                 for backend in (TorchAttentionBackend(), TritonAttentionBackend())]  # fmt: skip
    # the latents paged through a shuffled block -> page map (the dummy block on the dummy page), as the block
    # manager leaves it, rather than by block id
    shuffled = torch.cat([torch.zeros(1), torch.randperm(39, generator=torch.Generator().manual_seed(2)) + 1]).int()
    for h in harnesses:
        h.kv_caches[loaded.info.kv.latent_map_index].copy_(shuffled)
    g = torch.Generator().manual_seed(5)
    seqs = {s: torch.randint(4, 320, (n,), generator=g).tolist() for s, n in (("a", 6), ("b", 35))}
    steps = [[("b", seqs["b"][:17])], [("a", seqs["a"]), ("b", seqs["b"][17:])]]
    steps += [[(s, torch.randint(4, 320, (1,), generator=g).tolist()) for s in seqs] for _ in range(3)]
    for i, chunks in enumerate(steps):
        ref, got = (torch.cat(h.step(chunks)) for h in harnesses)
        assert relative_error(got, ref) < 1e-5, f"step {i}"
    # 5 steps x 4 layers attend; 3 compressed layers compress (CSA twice: entry and indexer key); 2 CSA layers index;
    # every layer's two hyper-connections collapse and merge, and the head collapses once a step; every layer rotates
    # its query, its latent and its output back, and each CSA layer its indexer query
    assert calls == {"attention": 20, "compress": 25, "indexer": 10, "hc_pre": 40, "hc_merge": 40, "hc_head": 5,
                     "rope": 70}
