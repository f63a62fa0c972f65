"""DeepSeek-V4's hyper-connection kernels (kernels/hyper_connection.py) against their PyTorch reference
(kernels/hyper_connection_reference.py), on CPU through Triton's interpreter: fresh random streams, a projection,
biases and scales large enough that the mixes are far from uniform, hc 4 and 20 Sinkhorn iterations as V4 ships,
tokens 1 and 5, D a power of two, D not one (40), and D past one block in both kernels (the collapse's two-pass
loop, the merge's last partial block). fp32 streams are held to 1e-5, bf16 ones to 1e-2 (the outputs' rounding);
``post`` and ``comb`` are fp32 either way. The real shape inside a CUDA graph is tests/gpu/test_hyper_connection_gpu.py's;
the model on these kernels, tests/kernels/test_deepseek_v4_interp.py's."""

from __future__ import annotations

import torch
from interp_setup import kernel_device, use_interpreter
from model_utils import relative_error

use_interpreter()

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from graphserve.kernels import hyper_connection as hck  # noqa: E402
from graphserve.kernels import hyper_connection_reference as ref  # noqa: E402
from graphserve.layers.hyper_connection import HyperConnection, HyperHead  # noqa: E402

DEVICE = kernel_device()
HC, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def params(hidden: int, width: int, gen: torch.Generator, scales: int = 3):
    """(fn, base, scale) whose mixes are O(1) logits on unit-RMS streams, so sigmoid and softmax are not flat."""
    fn = torch.randn(width, HC * hidden, generator=gen) * (2.0 / (HC * hidden) ** 0.5)
    base = torch.randn(width, generator=gen) * 0.5
    scale = torch.rand(scales, generator=gen) + 0.5
    return fn.to(DEVICE), base.to(DEVICE), scale.to(DEVICE)


def streams_of(t: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    # per-stream magnitudes differ, so the collapse and the merge weigh them visibly
    x = torch.randn(t, HC, hidden, generator=gen) * torch.tensor([0.5, 1.0, 2.0, 3.0]).view(1, HC, 1)
    return x.to(DEVICE, dtype)


@pytest.fixture(params=["one-block", "blocks"])
def blocks(request, monkeypatch):
    if request.param == "blocks":  # 16-wide blocks: D=40 ends in a partial one, D=32 in two whole ones
        monkeypatch.setattr(hck, "COLLAPSE_ELEMENTS", 16 * HC)
        monkeypatch.setattr(hck, "MERGE_BLOCK", 16)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hidden", [(1, 32), (5, 40)])
def test_pre_merge_and_head_match_the_reference(t, hidden, dtype, blocks):
    gen = torch.Generator().manual_seed(hidden * 10 + t)
    streams = streams_of(t, hidden, dtype, gen)
    fn, base, scale = params(hidden, (2 + HC) * HC, gen)
    post_ref, comb_ref, x_ref = ref.hyper_connection(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    # the mixes are far from uniform, so a kernel that got the scale, base or softmax axis wrong would show
    assert post_ref.std() > 0.1 and comb_ref.std() > 0.05
    mixes = F.linear(streams.flatten(1).float(), fn)
    post, comb, x = hck.hc_pre(streams, mixes, base, scale, ITERS, HC_EPS, NORM_EPS)
    assert relative_error(post, post_ref) < 1e-5
    assert relative_error(comb, comb_ref) < 1e-5
    assert x.dtype == dtype and relative_error(x, x_ref) < TOL[dtype]

    out = torch.randn(t, hidden, generator=gen).to(DEVICE, dtype)
    merged = hck.hc_merge(streams, out, post_ref, comb_ref)
    assert merged.dtype == dtype and relative_error(merged, ref.merge(streams, out, post_ref, comb_ref)) < TOL[dtype]

    head_fn, head_base, head_scale = params(hidden, HC, gen, scales=1)
    head = hck.hc_head(streams, F.linear(streams.flatten(1).float(), head_fn), head_base, head_scale, HC_EPS,
                       NORM_EPS)  # fmt: skip
    head_ref = ref.hyper_head(streams, head_fn, head_base, head_scale, HC_EPS, NORM_EPS)
    assert head.dtype == dtype and relative_error(head, head_ref) < TOL[dtype]


class OpCount(TorchDispatchMode):
    """PyTorch ops that launch work on a GPU: views and allocations launch nothing."""

    FREE = ("view", "_unsafe_view", "t", "transpose", "split", "split_with_sizes", "unsqueeze", "expand", "empty",
            "empty_like", "select", "unbind", "slice", "detach", "alias")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_layers_on_the_kernels_match_their_reference_path_in_a_few_launches(monkeypatch):
    """HyperConnection and HyperHead with ``kernels=True`` against ``kernels=False``, and what each path launches:
    the reference 140 PyTorch ops a sublayer at 20 Sinkhorn iterations (fp32 streams: no copy), the kernel path
    one matmul and two Triton kernels."""
    gen = torch.Generator().manual_seed(3)
    t, hidden = 3, 24
    layer = HyperConnection(HC, hidden, ITERS, HC_EPS, NORM_EPS).to(DEVICE)
    head = HyperHead(HC, hidden, HC_EPS, NORM_EPS).to(DEVICE)
    with torch.no_grad():
        for p, (fn, base, scale) in ((layer, params(hidden, (2 + HC) * HC, gen)), (head, params(hidden, HC, gen, 1))):
            for dst, src in zip(p.parameters(), (fn, base, scale)):
                dst.copy_(src)
    streams, out = streams_of(t, hidden, torch.float32, gen), torch.randn(t, hidden, generator=gen).to(DEVICE)
    launches = []
    for name in ("_hc_collapse_kernel", "_hc_merge_kernel"):
        kernel = getattr(hck, name)
        monkeypatch.setattr(hck, name, _Counted(kernel, launches))
    counts = {}
    with torch.no_grad():
        for kernels in (False, True):
            with OpCount() as ops:
                post, comb, x = layer(streams, kernels)
                merged = HyperConnection.merge(streams, out, post, comb, kernels)
            with OpCount() as head_ops:
                final = head(merged, kernels)
            counts[kernels] = (len(ops.ops), len(head_ops.ops))
            if not kernels:
                expected = (post, comb, x, merged, final)
    for got, want in zip((post, comb, x, merged, final), expected):
        assert relative_error(got, want) < 1e-5
    assert launches == ["_hc_collapse_kernel", "_hc_merge_kernel", "_hc_collapse_kernel"]
    # the kernel path's PyTorch ops: the projection (mm) and nothing else
    assert counts[True] == (1, 1), counts
    assert counts[False] == (140, 12), counts
    print(f"hyper-connection ops a sublayer: {counts[False][0]} PyTorch (reference) -> {counts[True][0]} PyTorch + 2 "
          f"Triton; head: {counts[False][1]} -> {counts[True][1]} + 1")


class _Counted:
    def __init__(self, kernel, launches: list[str]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches.append(self.kernel.__name__)
            with _disable_current_modes():  # the interpreter's own tensor work is no launch of the model's
                return launch(*args, **kwargs)

        return run


def test_a_stream_count_that_is_no_power_of_two_is_masked():
    """hc 3 runs in 4-wide registers: the padding stream must weigh nothing in the softmax, the Sinkhorn sums,
    the collapse and the merge."""
    gen = torch.Generator().manual_seed(7)
    hc, t, hidden = 3, 2, 24
    streams = (torch.randn(t, hc, hidden, generator=gen) * torch.tensor([0.5, 1.0, 2.0]).view(1, hc, 1)).to(DEVICE)
    fn = (torch.randn((2 + hc) * hc, hc * hidden, generator=gen) * (2.0 / (hc * hidden) ** 0.5)).to(DEVICE)
    base, scale = (torch.randn((2 + hc) * hc, generator=gen) * 0.5).to(DEVICE), torch.tensor([0.7, 1.3, 2.0]).to(DEVICE)
    post_ref, comb_ref, x_ref = ref.hyper_connection(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    post, comb, x = hck.hc_pre(streams, F.linear(streams.flatten(1), fn), base, scale, ITERS, HC_EPS, NORM_EPS)
    for got, want in ((post, post_ref), (comb, comb_ref), (x, x_ref)):
        assert relative_error(got, want) < 1e-5
    out = torch.randn(t, hidden, generator=gen).to(DEVICE)
    assert relative_error(hck.hc_merge(streams, out, post, comb), ref.merge(streams, out, post, comb)) < 1e-5
