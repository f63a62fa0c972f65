"""DeepSeek-V4's hyper-connection kernels (kernels/hyper_connection.py) compiled, at the real shape (hc 4, D 4096,
20 Sinkhorn iterations), against kernels/hyper_connection_reference.py: the kernels alone on the same projection
(fp32 outputs to 1e-5), then HyperConnection, its merge and HyperHead on the kernel path captured in one CUDA graph
and replayed on fresh streams written into the captured input, against the layers' PyTorch path on those streams.
No card is named: every bound is a relative error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_utils import capture, rel_err

from graphserve.kernels import hyper_connection as hck
from graphserve.kernels import hyper_connection_reference as ref
from graphserve.layers.hyper_connection import HyperConnection, HyperHead

HC, D, ITERS, HC_EPS, NORM_EPS = 4, 4096, 20, 1e-6, 1e-6
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# the two paths project differently normalised streams (16384-term fp32 dots in two cuBLAS calls): the mixes, and
# through them post and comb, differ by more than one kernel's rounding
LAYER_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def params(width: int, gen: torch.Generator, scales: int):
    fn = torch.randn(width, HC * D, generator=gen, device="cuda") * (2.0 / (HC * D) ** 0.5)
    base = torch.randn(width, generator=gen, device="cuda") * 0.5
    return fn, base, torch.rand(scales, generator=gen, device="cuda") + 0.5


def streams_of(t: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    mags = torch.tensor([0.5, 1.0, 2.0, 3.0], device="cuda").view(1, HC, 1)
    return (torch.randn(t, HC, D, generator=gen, device="cuda") * mags).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 64, 256])
def test_kernels_match_the_reference_on_the_same_projection(t, dtype):
    gen = torch.Generator(device="cuda").manual_seed(t)
    streams = streams_of(t, dtype, gen)
    fn, base, scale = params((2 + HC) * HC, gen, 3)
    mixes = F.linear(streams.flatten(1).float(), fn)
    rs = torch.rsqrt(streams.flatten(1).float().square().mean(-1, keepdim=True) + NORM_EPS)
    pre_ref, post_ref, comb_ref = ref.hc_mixes(mixes * rs, base, scale, HC, ITERS, HC_EPS)
    assert post_ref.std() > 0.1 and comb_ref.std() > 0.05  # far from uniform mixes
    post, comb, x = hck.hc_pre(streams, mixes, base, scale, ITERS, HC_EPS, NORM_EPS)
    assert rel_err(post, post_ref) < 1e-5 and rel_err(comb, comb_ref) < 1e-5
    assert x.dtype == dtype and rel_err(x, ref.collapse(streams, pre_ref)) < TOL[dtype]

    out = torch.randn(t, D, generator=gen, device="cuda").to(dtype)
    merged = hck.hc_merge(streams, out, post_ref, comb_ref)
    assert merged.dtype == dtype and rel_err(merged, ref.merge(streams, out, post_ref, comb_ref)) < TOL[dtype]

    head_fn, head_base, head_scale = params(HC, gen, 1)
    head_mixes = F.linear(streams.flatten(1).float(), head_fn)
    head_pre = torch.sigmoid(head_mixes * rs * head_scale + head_base) + HC_EPS
    head = hck.hc_head(streams, head_mixes, head_base, head_scale, HC_EPS, NORM_EPS)
    assert head.dtype == dtype and rel_err(head, ref.collapse(streams, head_pre)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 64, 256])
def test_layers_on_the_kernels_replay_in_a_cuda_graph(t, dtype):
    gen = torch.Generator(device="cuda").manual_seed(100 + t)
    layer = HyperConnection(HC, D, ITERS, HC_EPS, NORM_EPS).cuda()
    head = HyperHead(HC, D, HC_EPS, NORM_EPS).cuda()
    with torch.no_grad():
        for module, width, scales in ((layer, (2 + HC) * HC, 3), (head, HC, 1)):
            for dst, src in zip(module.parameters(), params(width, gen, scales)):
                dst.copy_(src)
    streams, out = streams_of(t, dtype, gen), torch.randn(t, D, generator=gen, device="cuda").to(dtype)

    def step(kernels: bool):
        post, comb, x = layer(streams, kernels)
        merged = HyperConnection.merge(streams, out, post, comb, kernels)
        return post, comb, x, merged, head(merged, kernels)

    with torch.no_grad():
        graph, captured = capture(lambda: step(True))
        for _ in range(2):  # fresh inputs each replay: the graph reads its static inputs, nothing baked in
            streams.copy_(streams_of(t, dtype, gen))
            out.copy_(torch.randn(t, D, generator=gen, device="cuda").to(dtype))
            graph.replay()
            torch.cuda.synchronize()
            expected = step(False)
            for name, got, want in zip(("post", "comb", "collapsed", "merged", "head"), captured, expected):
                tol = LAYER_TOL[torch.float32] if name in ("post", "comb") else LAYER_TOL[dtype]
                assert rel_err(got, want) < tol, (name, rel_err(got, want))
