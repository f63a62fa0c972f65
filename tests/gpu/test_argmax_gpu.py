"""The greedy argmax kernels on the GPU at decode shapes (Llama-3 and Qwen vocabularies, batch 1 to 256).

Fresh random logits with the row's maximum planted at several indices (across chunk boundaries too),
rows of -inf with one finite entry, and NaNs; the ids must equal torch.argmax's exactly. A CUDA-graph
replay on new logits in the captured buffer must give the same ids as an eager call.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import capture

from graphserve.kernels.argmax import PROGRAMS_PER_SM, argmax_triton, chunking, greedy_argmax
from graphserve.kernels.common import sm_count

SHAPES = [(1, 128256), (64, 128256), (256, 128256), (64, 151936)]


def random_logits(batch: int, vocab: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random logits with each row's maximum repeated at indices either side of a chunk boundary of the
    launch, plus special rows: all -inf but one entry, a NaN, all -inf, and two NaNs in different chunks."""
    x = (torch.randn(batch, vocab, device="cuda", generator=gen) * 4).to(dtype)
    _, chunk = chunking(batch, vocab, PROGRAMS_PER_SM * sm_count(x.device))
    top = x.float().max().item() + 1.0
    for r in range(batch):
        # later chunks first: a kernel that let a later chunk win ties would show it
        cols = torch.randint(0, vocab, (3,), device="cuda", generator=gen).tolist()
        if chunk < vocab:
            cols += [chunk, chunk - 1]
        x[r, cols] = top
    if batch > 1:
        x[1] = float("-inf")
        x[1, vocab - 1] = 0.0
        x[-1, vocab // 3] = float("nan")
    if batch > 3:
        x[2] = float("-inf")
        x[3, vocab - 2] = float("nan")
        x[3, 5] = float("nan")
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("batch,vocab", SHAPES)
def test_matches_torch_argmax(batch, vocab, dtype, gen):
    x = random_logits(batch, vocab, dtype, gen)
    out = greedy_argmax(x)
    assert out.dtype == torch.int64 and out.shape == (batch,)
    torch.testing.assert_close(out, torch.argmax(x, dim=-1), rtol=0, atol=0)


def test_strided_rows_match(gen):
    """Rows of a wider buffer (the logits of a padded batch) and a transposed layout."""
    wide = random_logits(64, 128256 + 64, torch.bfloat16, gen)
    view = wide[:, 32 : 32 + 128256]
    torch.testing.assert_close(greedy_argmax(view), torch.argmax(view, dim=-1), rtol=0, atol=0)
    cols = wide[:, :4096].t()
    torch.testing.assert_close(greedy_argmax(cols), torch.argmax(cols, dim=-1), rtol=0, atol=0)


@pytest.mark.parametrize("batch,vocab", [(1, 128256), (64, 151936)])
def test_cuda_graph_replay_matches_eager(batch, vocab, gen):
    logits = random_logits(batch, vocab, torch.bfloat16, gen)
    graph, ids = capture(lambda: argmax_triton(logits))
    for _ in range(3):
        logits.copy_(random_logits(batch, vocab, torch.bfloat16, gen))
        graph.replay()
        torch.testing.assert_close(ids, torch.argmax(logits, dim=-1), rtol=0, atol=0)
        torch.testing.assert_close(ids, argmax_triton(logits), rtol=0, atol=0)


def test_every_batch_size_runs_one_compile_of_each_kernel(gen):
    """The split follows the batch (11 chunkings of a 128256 vocab between 1 and 512 rows), yet a batch the
    warm-up did not sample must compile nothing: the split is a runtime value, not a specialization."""
    import triton

    compiled = []
    previous = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *, fn, **kwargs: compiled.append(fn.name)
    try:
        for batch in (1, 40, 100, 300, 500):
            x = torch.randn(batch, 128256, device="cuda", generator=gen, dtype=torch.bfloat16)
            assert torch.equal(greedy_argmax(x), torch.argmax(x, dim=-1)), batch
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    assert len({chunking(b, 128256, PROGRAMS_PER_SM * sm_count(torch.device("cuda"))) for b in (1, 40, 100, 300, 500)}) == 5
    assert compiled.count("_argmax_partial_kernel") <= 1 and compiled.count("_argmax_combine_kernel") <= 1, compiled
