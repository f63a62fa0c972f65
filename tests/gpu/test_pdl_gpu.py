"""Programmatic dependent launch (sm_90 and later): a chain of dependent kernels captured with PDL gives what it
gives without it, and a whole decode step captured both ways gives the same logits, bit for bit (the kernels
and their order are the same; only when each one may start changes). FP8 streaming matmuls likewise, launched
with PDL or left out and releasing the kernel after them."""

from __future__ import annotations

import contextlib

import pytest
import torch
from gpu_utils import capture, decode_model, graph_runner

from graphserve.kernels import fp8_gemv as fp8_gemv_module
from graphserve.kernels.fp8_gemv import fp8_gemv, fp8_norm_gemv
from graphserve.kernels.fp8_quant import quantize_weight_blocks
from graphserve.kernels.gemv import gemv, norm_gemv
from graphserve.kernels.norm import rms_norm
from graphserve.kernels.pdl import pdl, pdl_args, pdl_joins, pdl_on, pdl_release_left_out
from graphserve.layers.attention_triton import TritonAttentionBackend, decode_prologue
from graphserve.layers.forward_batch import contiguous_batch


def _needs_pdl() -> None:
    """The comparisons below would compare a capture with itself where kernels cannot launch with PDL."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    if not pdl_on(torch.device("cuda")):
        pytest.fail("an sm_90 device, yet kernels would launch without PDL (GRAPHSERVE_PDL=0, or Triton cannot)")


def test_pdl_is_on_by_default_on_hopper():
    _needs_pdl()
    device = torch.device("cuda")
    with pdl(False):
        assert not pdl_on(device)
    assert pdl_on(device)


def _chain(x: torch.Tensor, weights: list[torch.Tensor], norm_w: torch.Tensor) -> torch.Tensor:
    """Each launch reads what the one before it wrote: gemv, RMSNorm, norm+gemv, repeated."""
    h = x
    for i, w in enumerate(weights):
        h = gemv(h, w) if i % 2 == 0 else norm_gemv(rms_norm(h, norm_w, 1e-6), norm_w, 1e-6, w)[0]
    return h


@pytest.mark.parametrize("m", [1, 4, 16])
def test_dependent_chain_under_graph_replay_matches_without_pdl(m):
    _needs_pdl()
    gen = torch.Generator(device="cuda").manual_seed(m)
    k = 2048
    weights = [torch.randn(k, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5 for _ in range(24)]
    norm_w = torch.rand(k, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    with pdl(True):
        graph, out = capture(lambda: _chain(x, weights, norm_w))
    for trial in range(50):  # a race would show as a wrong result in some replay, not necessarily the first
        x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen))
        with pdl(False):
            ref = _chain(x, weights, norm_w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref), f"replay {trial}: max diff {(out.float() - ref.float()).abs().max().item()}"


def same_logits_both_ways(name: str, scope, **engine_args) -> None:
    """The dummy model ``name``'s decode step captured twice, under ``scope(False)`` and ``scope(True)``, replayed in
    turns at batches 1, 4 and 8 (contexts up to 300): the logits equal, bit for bit, five replays each."""
    ctx, sizes = 300, [1, 4, 8]
    cfg, loaded, kv_caches = decode_model(name, ctx, max(sizes), **engine_args)
    model, info = loaded.model, loaded.info
    backend = TritonAttentionBackend()
    with torch.inference_mode():
        graphs = {}
        for on in (False, True):
            with scope(on):
                graphs[on] = graph_runner(cfg, model, backend, kv_caches, sizes, ctx)
                graphs[on].capture()
        for bs in sizes:
            lens = [ctx + 1 - 7 * i for i in range(bs)]
            batch = contiguous_batch([1] * bs, lens, kv_caches, backend, vocab_size=info.vocab_size)
            for _ in range(5):
                off = graphs[False].replay(batch).clone()
                on = graphs[True].replay(batch).clone()
                assert torch.equal(off, on), f"bs={bs}: max diff {(off.float() - on.float()).abs().max().item()}"


@pytest.mark.parametrize("name", ["dummy:qwen3-0.6b", "dummy:olmoe-1b-7b", "dummy:deepseek-v2-lite"])
def test_decode_step_captured_with_pdl_gives_the_same_logits(name):
    _needs_pdl()
    same_logits_both_ways(name, pdl)


@pytest.mark.parametrize("release_left_out", [False, True])
@pytest.mark.parametrize("m", [1, 4])
def test_fp8_streaming_chain_on_pdl_matches_without(m, release_left_out):
    """FP8 streaming matmuls reading each other's output, the matmul launched with PDL or left out and releasing
    the kernel after it: every graph replay equals the chain without PDL."""
    _needs_pdl()
    gen = torch.Generator(device="cuda").manual_seed(m)
    k = 4096
    weights = [quantize_weight_blocks(torch.randn(k, k, device="cuda", generator=gen) / k**0.5, 128, 128)
               for _ in range(12)]  # fmt: skip
    norm_w = torch.rand(k, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)

    def chain() -> torch.Tensor:
        h = x
        for i, (wq, ws) in enumerate(weights):
            # a PDL kernel (the norm) right after a matmul reads what it wrote: what its release lets launch early
            h = rms_norm(fp8_gemv(h, wq, ws, 128, 128), norm_w, 1e-6) if i % 2 else \
                fp8_norm_gemv(h, norm_w, 1e-6, wq, ws, 128, 128)[0]
        return h

    skip = frozenset() if not release_left_out else frozenset({"_fp8_gemv_kernel"})
    with pdl(True, skip=skip), pdl_release_left_out(release_left_out):
        graph, out = capture(chain)
    for trial in range(30):
        x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen))
        with pdl(False):
            ref = chain()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref), f"replay {trial}: max diff {(out.float() - ref.float()).abs().max().item()}"


@pytest.mark.parametrize("name", ["dummy:qwen3-0.6b", "dummy:llama3.2-1b"])
def test_fp8_decode_step_with_a_joined_output_projection_gives_the_same_logits(name, monkeypatch):
    """The FP8 output projection launched with PDL after decode attention where attention's grid leaves room
    (kernels/pdl.pdl_joined; batches 1 and 4 here, 8 kv heads over 368-token tables; at 8 the rule keeps it
    apart), the prologue inside decode attention: the same logits, bit for bit, as the capture without it. The
    streaming matmul's launches are counted, so the comparison cannot pass with the join never taken."""
    _needs_pdl()
    launches = {False: 0, True: 0}
    joining = [False]

    def counted(device, kernel):
        args = pdl_args(device, kernel)
        launches[joining[0]] += args["launch_pdl"]
        return args

    monkeypatch.setattr(fp8_gemv_module, "pdl_args", counted)

    @contextlib.contextmanager
    def scope(on: bool):
        joining[0] = on
        with pdl(True), decode_prologue(True), pdl_joins(on):
            yield

    same_logits_both_ways(name, scope, quantization="fp8")
    assert launches[False] == 0 and launches[True] > 0, launches
