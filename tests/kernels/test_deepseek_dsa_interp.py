"""The sparse-attention model on the Triton DSA kernels (kernels/dsa.py, run by Triton's interpreter on CPU) gives
the logits of the same model on the PyTorch references, step for step: what the Triton attention backend runs on
a GPU, here with fp32 tiny shapes and contexts longer than index_topk."""

from __future__ import annotations

import torch
from interp_setup import use_interpreter
from model_utils import PagedHarness, relative_error
from test_deepseek_dsa import _checkpoint

use_interpreter()

from graphserve.config import EngineConfig  # noqa: E402
from graphserve.layers.attention import TorchAttentionBackend  # noqa: E402
from graphserve.layers.attention_triton import TritonAttentionBackend  # noqa: E402
from graphserve.models.loader import load_model  # noqa: E402

TOL = 1e-4


def test_glm5_on_the_dsa_kernels_matches_the_references(tmp_path, monkeypatch):
    from graphserve.kernels import dsa

    calls = []
    for name in ("indexer_topk", "sparse_mla"):  # count the kernel calls, so the Triton side is known to have run
        fn = getattr(dsa, name)
        monkeypatch.setattr(dsa, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    _checkpoint(tmp_path, "glm5")
    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="float32", max_model_len=64, block_size=4),
                        torch.device("cpu"))
    harnesses = [PagedHarness(loaded.model, backend=backend) for backend in (TorchAttentionBackend(),
                                                                             TritonAttentionBackend())]
    gen = torch.Generator().manual_seed(11)
    seqs = {s: torch.randint(4, 320, (n,), generator=gen).tolist() for s, n in (("a", 6), ("b", 21))}
    steps = [[("b", seqs["b"][:13])], [("a", seqs["a"]), ("b", seqs["b"][13:])]]
    for _ in range(2):
        steps.append([(s, torch.randint(4, 320, (1,), generator=gen).tolist()) for s in seqs])
    for i, chunks in enumerate(steps):
        ref, got = (torch.cat(h.step(chunks)) for h in harnesses)
        err = relative_error(got, ref)
        assert err < TOL, f"step {i}: relative error {err:.2e}"
    # 4 steps: 2 indexer layers and 5 attention layers each
    assert calls.count("indexer_topk") == 4 * 2 and calls.count("sparse_mla") == 4 * 5
    for ref_cache, kernel_cache in zip(*(h.kv_caches for h in harnesses)):
        torch.testing.assert_close(kernel_cache, ref_cache, rtol=1e-5, atol=1e-5)
