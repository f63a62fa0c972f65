"""DeepSeek-V4's hyper-connections in two Triton kernels around one matmul (reference:
kernels/hyper_connection_reference.py).

In plain PyTorch a hyper-connection and its merge are 144 small elementwise and reduction kernels per sublayer
in bf16 (the RMS, three mixes, a softmax and 20 Sinkhorn steps over 4 x 4 matrices, the collapse, the merge), 14
for the head: an H100 decode step of the 6-layer V4 preset replayed ~2,400 tiny kernels, 1-2.5 us each
(benchmarks/results/step_breakdown_deepseek-v4-flash-l6_bs64_ctx4096.json). Here a sublayer is the projection
(the streams' fp32 copy and one matmul) and two Triton kernels, the head the projection and one:

- the projection stays one matmul, of the streams as they are: the RMS factor is one scalar per token and is
  applied after it;
- ``_hc_collapse_kernel`` (one program per token) reads the token's streams once, for their sum of squares and
  the collapse, and computes ``pre``, ``post`` and ``comb`` (the softmax and every Sinkhorn step of an hc x hc
  matrix) in registers, in fp32; with ``HEAD`` it is HyperHead's collapse (``pre`` only);
- ``_hc_merge_kernel`` writes ``post * out + comb^T @ streams`` in one pass over the streams.

Shapes are static and nothing depends on the data, so both capture in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.pdl import pdl_args, pdl_enter

# elements of a token's [hc, D] streams a collapse program holds at once: D=4096, hc=4 in one block, 32 fp32
# registers a thread at 16 warps; wider rows are read twice (the second read from L2)
COLLAPSE_ELEMENTS = 16384
MERGE_BLOCK = 512  # D columns a merge program writes: 8 programs a token at D=4096, so batch 1 spreads over SMs


@triton.jit
def _hc_collapse_kernel(
    streams_ptr, mixes_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr,
    stride_st, stride_sh, stride_mt, stride_ot,
    hc_eps, norm_eps,
    NUM_HC: tl.constexpr, HIDDEN: tl.constexpr, ITERS: tl.constexpr, HEAD: tl.constexpr, HC: tl.constexpr,
    BLOCK_D: tl.constexpr, ONE_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HC)
    hm = h < NUM_HC
    d = tl.arange(0, BLOCK_D)
    row = streams_ptr + t * stride_st + h[:, None] * stride_sh
    if ONE_BLOCK:
        x = tl.load(row + d[None, :], mask=hm[:, None] & (d < HIDDEN)[None, :], other=0.0).to(tl.float32)
        sq = tl.sum(tl.sum(x * x, 1), 0)
    else:
        acc = tl.zeros([HC, BLOCK_D], tl.float32)
        for d0 in range(0, HIDDEN, BLOCK_D):
            m = hm[:, None] & (d0 + d < HIDDEN)[None, :]
            xc = tl.load(row + d0 + d[None, :], mask=m, other=0.0).to(tl.float32)
            acc += xc * xc
        sq = tl.sum(tl.sum(acc, 1), 0)
    rs = 1.0 / tl.sqrt(sq / (NUM_HC * HIDDEN) + norm_eps)

    mixes = mixes_ptr + t * stride_mt
    pre = tl.load(mixes + h, mask=hm, other=0.0) * rs * tl.load(scale_ptr) + tl.load(base_ptr + h, mask=hm, other=0.0)
    pre = tl.where(hm, tl.sigmoid(pre) + hc_eps, 0.0)
    if not HEAD:
        post = tl.load(mixes + NUM_HC + h, mask=hm, other=0.0) * rs * tl.load(scale_ptr + 1)
        post = 2.0 * tl.sigmoid(post + tl.load(base_ptr + NUM_HC + h, mask=hm, other=0.0))
        tl.store(post_ptr + t * NUM_HC + h, post, mask=hm)
        ij = h[:, None] * NUM_HC + h[None, :]
        m2 = hm[:, None] & hm[None, :]
        logits = tl.load(mixes + 2 * NUM_HC + ij, mask=m2, other=0.0) * rs * tl.load(scale_ptr + 2)
        # padding streams (hc not a power of two): a finite floor, so their rows stay finite and are zeroed below
        logits = tl.where(m2, logits + tl.load(base_ptr + 2 * NUM_HC + ij, mask=m2, other=0.0), -1e30)
        e = tl.exp(logits - tl.max(logits, 1)[:, None])
        comb = tl.where(m2, e / tl.sum(e, 1)[:, None] + hc_eps, 0.0)
        comb = comb / (tl.sum(comb, 0)[None, :] + hc_eps)
        for _ in range(1, ITERS):
            comb = comb / (tl.sum(comb, 1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, 0)[None, :] + hc_eps)
        tl.store(comb_ptr + t * NUM_HC * NUM_HC + ij, comb, mask=m2)

    out = out_ptr + t * stride_ot
    if ONE_BLOCK:
        tl.store(out + d, tl.sum(x * pre[:, None], 0).to(out_ptr.dtype.element_ty), mask=d < HIDDEN)
    else:
        for d0 in range(0, HIDDEN, BLOCK_D):
            m = hm[:, None] & (d0 + d < HIDDEN)[None, :]
            xc = tl.load(row + d0 + d[None, :], mask=m, other=0.0).to(tl.float32)
            tl.store(out + d0 + d, tl.sum(xc * pre[:, None], 0).to(out_ptr.dtype.element_ty), mask=d0 + d < HIDDEN)


@triton.jit
def _hc_merge_kernel(
    streams_ptr, out_ptr, post_ptr, comb_ptr, new_ptr,
    stride_st, stride_sh, stride_ot, stride_nt, stride_nh,
    NUM_HC: tl.constexpr, HIDDEN: tl.constexpr, HC: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < HIDDEN
    k = tl.arange(0, HC)
    km = k < NUM_HC
    dtype = new_ptr.dtype.element_ty
    # post and comb are rounded to the streams' dtype first, as transformers' decoder layer casts them
    post = tl.load(post_ptr + t * NUM_HC + k, mask=km, other=0.0).to(dtype).to(tl.float32)
    o = tl.load(out_ptr + t * stride_ot + d, mask=dm, other=0.0).to(tl.float32)
    acc = post[:, None] * o[None, :]
    for j in tl.static_range(NUM_HC):
        s = tl.load(streams_ptr + t * stride_st + j * stride_sh + d, mask=dm, other=0.0)
        c = tl.load(comb_ptr + (t * NUM_HC + j) * NUM_HC + k, mask=km, other=0.0)
        acc += c.to(dtype).to(tl.float32)[:, None] * s.to(tl.float32)[None, :]
    tl.store(new_ptr + t * stride_nt + k[:, None] * stride_nh + d[None, :], acc.to(dtype),
             mask=km[:, None] & dm[None, :])  # fmt: skip


def _rows(streams: torch.Tensor) -> torch.Tensor:
    if streams.dim() != 3:
        raise ValueError(f"hyper-connection streams must be [tokens, hc, hidden], got {tuple(streams.shape)}")
    return streams if streams.stride(-1) == 1 else streams.contiguous()


def _collapse(streams, mixes, base, scale, hc_eps, norm_eps, iters, head):
    streams = _rows(streams)
    t, hc, hidden = streams.shape
    width = hc if head else (2 + hc) * hc
    if mixes.shape != (t, width) or mixes.dtype != torch.float32 or mixes.stride(-1) != 1:
        raise ValueError(f"hyper-connection mixes must be fp32 [{t}, {width}] with unit stride, "
                         f"got {mixes.dtype} {tuple(mixes.shape)}")  # fmt: skip
    post = comb = mixes  # unwritten by the head
    if not head:
        post = torch.empty(t, hc, dtype=torch.float32, device=streams.device)
        comb = torch.empty(t, hc, hc, dtype=torch.float32, device=streams.device)
    out = torch.empty(t, hidden, dtype=streams.dtype, device=streams.device)
    if t:
        block_hc = triton.next_power_of_2(hc)
        block_d = min(triton.next_power_of_2(hidden), max(16, COLLAPSE_ELEMENTS // block_hc))
        _hc_collapse_kernel[(t,)](
            streams, mixes, base, scale, post, comb, out,
            streams.stride(0), streams.stride(1), mixes.stride(0), out.stride(0),
            hc_eps, norm_eps,
            NUM_HC=hc, HIDDEN=hidden, ITERS=iters, HEAD=head, HC=block_hc, BLOCK_D=block_d,
            ONE_BLOCK=block_d >= hidden,
            num_warps=min(16, max(1, block_hc * block_d // 1024)), **pdl_args(streams.device, "_hc_collapse_kernel"),
        )  # fmt: skip
    return post, comb, out


def hc_pre(streams: torch.Tensor, mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``streams [T, hc, D]`` and ``mixes = streams.flatten(1).float() @ fn^T`` ([T, (2 + hc) * hc] fp32, not
    normalised) -> (post [T, hc] fp32, comb [T, hc, hc] fp32, the collapsed input [T, D] in the streams' dtype)."""
    return _collapse(streams, mixes, base, scale, hc_eps, norm_eps, iters, head=False)


def hc_head(streams: torch.Tensor, mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:  # fmt: skip
    """HyperHead's collapse of ``streams [T, hc, D]``, ``mixes = streams.flatten(1).float() @ hc_fn^T``."""
    return _collapse(streams, mixes, base, scale, hc_eps, norm_eps, 0, head=True)[2]


def hc_merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``post * out + comb^T @ streams`` ([T, hc, D], the streams' dtype) in one pass over the streams."""
    streams = _rows(streams)
    t, hc, hidden = streams.shape
    if out.shape != (t, hidden) or post.shape != (t, hc) or comb.shape != (t, hc, hc):
        raise ValueError(f"merge of streams {tuple(streams.shape)} got out {tuple(out.shape)}, post "
                         f"{tuple(post.shape)}, comb {tuple(comb.shape)}")  # fmt: skip
    out = out if out.stride(-1) == 1 else out.contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    new = torch.empty_like(streams, memory_format=torch.contiguous_format)
    if t:
        block_d = min(MERGE_BLOCK, triton.next_power_of_2(hidden))
        _hc_merge_kernel[(t, triton.cdiv(hidden, block_d))](
            streams, out, post, comb, new,
            streams.stride(0), streams.stride(1), out.stride(0), new.stride(0), new.stride(1),
            NUM_HC=hc, HIDDEN=hidden, HC=triton.next_power_of_2(hc), BLOCK_D=block_d,
            num_warps=4, **pdl_args(streams.device, "_hc_merge_kernel"),
        )  # fmt: skip
    return new
