"""Would a persistent, dataflow-ordered launch stream a batch-1 FP8 decoder's projections closer to its floor than
the engine's launch per projection? An experiment, not an engine path.

At batch 1 llama3-8b's FP8 decode step is four weight streams a layer (qkv with the residual add and RMSNorm in
its loads, o_proj, gate_up with the second add and norm, down with SiLU·mul), 128 launches a step, each paying
its own start (first bytes) and tail (the last programs alone on the GPU). ``layer_stream_kernel`` runs every
projection of every layer in one launch of ``programs`` resident programs. The work is one ordered list (layer by
layer, the four projections in turn, each cut into row tiles); program ``p`` takes every item whose index is ``p``
modulo the grid. For each item it first asks for the item's weight tile (no kernel writes a weight), then waits
until the projection its input comes from has counted all its rows done (an int32 counter per layer and
projection, polled with volatile loads, then an acquire and a block barrier), then reads its input from L2,
computes, stores, and counts its rows done (a release add at GPU scope by each thread that stored a row: a block
barrier there would keep Triton from pipelining the loop). The residual sums the norms read are stored the same
way, each tile its rows' share of them. So while the last tiles of one projection finish, every program that is
through with it already holds its next tile's weight in flight: the stream does not drain between projections,
and the only wait left is the dependency itself. A program's other tiles of the projection run in a loop Triton
pipelines (``stages``: their weights staged through shared memory that many tiles ahead), so it keeps more than
one tile in flight without holding them in registers. (Held in registers instead, with the norm taken once a
projection and the next tile requested before the held one is computed, the tiles took 128-255 registers a
thread, one or two programs an SM, and ran 1.67-8.79x the engine's time: results/fp8_layer_stream_registers.json.)

Measured on an H200 (results/fp8_layer_stream.json): every tile of this form ran 1.68-2.59x the engine's four
launches a layer, pipelined or not. What differs from the engine is what this form adds (a release add per row
on one address, the waits, one program an SM where the staged tiles fill shared memory, 2-3 where they do not)
against what it removes (a launch's start and tail); this run does not separate their costs, only their sum.

Deadlock freedom: every item depends only on items earlier in the list and every program takes its items in list
order, so the earliest unfinished item can always run, provided every program is resident at once (the grid is
at most the SMs times the programs an SM holds, from the compiled kernel's registers and shared memory; nothing
else runs beside it). A wait that spins past ``spin_cap`` polls gives up and counts itself in ``err`` instead of
hanging; the benchmark refuses a result with any.

Attention is not in the list: o_proj reads the first ``hidden`` columns of the qkv row in its place (the same
bytes move; the question here is the projections' stream). Each layer's intermediates have their own buffers
(no item overwrites what another may still read), and the counters are zeroed before each launch.

Numerics (per-channel FP8 weights, one bf16 row): x + residual rounded to bf16, RMSNorm rounded twice (times the
weight), each projection's fp32 sum times its channel scale rounded to bf16, and silu(gate) * up rounded to bf16
in gate_up's epilogue (down reads it as its x). ``reference_layer`` is the same in PyTorch; the benchmark checks
every layer of the launch against it from that layer's own inputs, then times the launch against the engine's
four launches a layer (routing table tiles) on the same weights, both as CUDA graphs, next to the read probe.

Run: python3 -m benchmarks.fp8_layer_stream   (writes benchmarks/results/fp8_layer_stream.json)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from benchmarks.common import print_table, write_result
from graphserve.kernels.common import interpreting

HIDDEN, QKV_ROWS, INTERMEDIATE = 4096, 6144, 14336  # llama3-8b
SPIN_CAP = 1 << 24
COUNTERS_PER_LAYER = 4  # qkv, o, gate_up, down


@triton.jit
def _wait(cnt_ptr, target, err_ptr, spin_cap):
    """Until ``*cnt_ptr`` reaches ``target`` (volatile polls, then an acquire and a block barrier that order every
    thread's reads after it); after ``spin_cap`` polls, count a timeout in ``*err_ptr`` and go on."""
    seen = tl.load(cnt_ptr, volatile=True)
    polls = 0
    while (seen < target) & (polls < spin_cap):
        seen = tl.load(cnt_ptr, volatile=True)
        polls += 1
    if seen < target:
        tl.atomic_add(err_ptr, 1, sem="relaxed", scope="gpu")
    tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()  # the acquire, taken by one thread, orders every thread's reads after it


@triton.jit
def _done(cnt_ptr, rows):
    """Count the tile's ``rows`` done: one release add per row, by the thread that stored that row (the same
    layout as the stores' pointers), so no block barrier stands in the loop Triton pipelines."""
    tl.atomic_add(cnt_ptr + rows * 0, 1, sem="release", scope="gpu")


@triton.jit
def _weight(w_ptr, rows, live, K: tl.constexpr, BK: tl.constexpr):
    """A ``[rows, K]`` fp8 tile as ``[rows, BK]`` (BK the power of two at or above K; the pad masked off), none of
    it read unless ``live``."""
    offs = tl.arange(0, BK)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * K + offs[None, :]
    if K == BK:
        return tl.load(ptrs, mask=(rows >= 0)[:, None] & live, other=0.0)
    return tl.load(ptrs, mask=(offs < K)[None, :] & live, other=0.0)


@triton.jit
def _normed(x_ptr, r_ptr, nw_ptr, eps, H: tl.constexpr):
    """RMSNorm (rounded twice, bf16) of bf16(x + r)."""
    offs = tl.arange(0, H)
    a = (tl.load(x_ptr + offs, cache_modifier=".cg").to(tl.float32)
         + tl.load(r_ptr + offs, cache_modifier=".cg").to(tl.float32)).to(tl.bfloat16).to(tl.float32)  # fmt: skip
    rstd = 1.0 / tl.sqrt(tl.sum(a * a, axis=0) / H + eps)
    nw = tl.load(nw_ptr + offs).to(tl.float32)
    return ((a * rstd).to(tl.bfloat16).to(tl.float32) * nw).to(tl.bfloat16)


@triton.jit
def _store_sum(x_ptr, r_ptr, dst_ptr, rows, H: tl.constexpr):
    """bf16(x + r) at ``rows`` (those below H): each tile stores its rows' share of the sum the next norm's
    residual is, with the same threads as its output, before they count the tile."""
    live = rows < H
    a = tl.load(x_ptr + rows, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32)
    a += tl.load(r_ptr + rows, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(dst_ptr + rows, a.to(tl.bfloat16), mask=live)


@triton.jit
def _first(pid, base, G):
    """This program's first tile of a projection whose items start at list index ``base``."""
    return (pid + G - base % G) % G


@triton.jit
def _mine(first, T, G):
    """How many of a projection's ``T`` tiles a program whose first is ``first`` takes (0 past the end)."""
    return (T - first + G - 1) // G


@triton.jit
def _qkv_load(wq, sq, t, BN: tl.constexpr, H: tl.constexpr):
    rows = t * BN + tl.arange(0, BN)
    return _weight(wq, rows, True, H, H), tl.load(sq + rows)


@triton.jit
def _qkv_out(w, s, t, x_ptr, r_ptr, nw_ptr, ra_ptr, out_ptr, c, eps, BN: tl.constexpr, H: tl.constexpr):
    xn = _normed(x_ptr, r_ptr, nw_ptr, eps, H)
    y = tl.sum(w.to(tl.float32) * xn.to(tl.float32)[None, :], axis=1) * s
    rows = t * BN + tl.arange(0, BN)
    tl.store(out_ptr + rows, y.to(tl.bfloat16))
    _store_sum(x_ptr, r_ptr, ra_ptr, rows, H)
    _done(c, rows)


@triton.jit
def _plain_out(w, s, t, x_ptr, out_ptr, c, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    offs = tl.arange(0, BK)
    x = tl.load(x_ptr + offs, mask=offs < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1) * s
    rows = t * BN + tl.arange(0, BN)
    tl.store(out_ptr + rows, y.to(tl.bfloat16))
    _done(c, rows)


@triton.jit
def _gu_load(wg_ptr, sg_ptr, t, INTER: tl.constexpr, BN: tl.constexpr, H: tl.constexpr):
    rows = t * BN + tl.arange(0, BN)
    return (_weight(wg_ptr, rows, True, H, H), _weight(wg_ptr, INTER + rows, True, H, H), tl.load(sg_ptr + rows),
            tl.load(sg_ptr + INTER + rows))  # fmt: skip


@triton.jit
def _gu_out(wg, wu, sg, su, t, x_ptr, r_ptr, nw_ptr, rm_ptr, act_ptr, c, eps, BN: tl.constexpr, H: tl.constexpr):
    xn = _normed(x_ptr, r_ptr, nw_ptr, eps, H).to(tl.float32)
    g = (tl.sum(wg.to(tl.float32) * xn[None, :], axis=1) * sg).to(tl.bfloat16).to(tl.float32)
    u = (tl.sum(wu.to(tl.float32) * xn[None, :], axis=1) * su).to(tl.bfloat16).to(tl.float32)
    rows = t * BN + tl.arange(0, BN)
    tl.store(act_ptr + rows, (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16))
    _store_sum(x_ptr, r_ptr, rm_ptr, rows, H)
    _done(c, rows)


@triton.jit
def _plain_load(w_ptr, s_ptr, t, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = t * BN + tl.arange(0, BN)
    return _weight(w_ptr, rows, True, K, BK), tl.load(s_ptr + rows)


@triton.jit
def _plain_phase(w_ptr, s_ptr, x_ptr, out_ptr, wait_ptr, wait_target, done_ptr, t, mine, G, err, spin_cap,
                 K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, WHILE: tl.constexpr):
    """A projection with no prologue (o, down): the first of the program's ``mine`` tiles requested, the wait
    taken, that tile computed, the others in the loop Triton pipelines (WHILE: a plain loop, for the
    interpreter)."""
    w, s = _plain_load(w_ptr, s_ptr, t, K, BN, BK)
    _wait(wait_ptr, wait_target, err, spin_cap)
    _plain_out(w, s, t, x_ptr, out_ptr, done_ptr, K, BN, BK)
    if WHILE:
        i = 1
        while i < mine:
            w, s = _plain_load(w_ptr, s_ptr, t + i * G, K, BN, BK)
            _plain_out(w, s, t + i * G, x_ptr, out_ptr, done_ptr, K, BN, BK)
            i += 1
    else:
        for i in tl.range(1, mine, num_stages=STAGES):
            w, s = _plain_load(w_ptr, s_ptr, t + i * G, K, BN, BK)
            _plain_out(w, s, t + i * G, x_ptr, out_ptr, done_ptr, K, BN, BK)


@triton.jit
def layer_stream_kernel(
    w_qkv, s_qkv, w_o, s_o, w_gu, s_gu, w_d, s_d, n1, n2,
    down, rm, ra, qkv, o, act, cnt, err, eps, num_layers, G, spin_cap,
    H: tl.constexpr, QKV_N: tl.constexpr, INTER: tl.constexpr, BK_D: tl.constexpr,
    BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BN3: tl.constexpr, STAGES: tl.constexpr,
    WHILE: tl.constexpr,
):  # fmt: skip
    """Layer l reads ``down[l]``, ``rm[l]`` (slot 0: the step's input and residual) and writes ``ra[l]``,
    ``qkv[l]``, ``o[l]``, ``act[l]``, ``rm[l + 1]``, ``down[l + 1]``; ``cnt`` [num_layers, 4] zeroed (rows done).

    Each projection: the program's first tile is requested, the wait taken, the tile computed; its other tiles
    run in a loop Triton pipelines over ``STAGES`` (their weights staged through shared memory that many tiles
    ahead; WHILE, for the interpreter, a plain loop)."""
    pid = tl.program_id(0)
    T0: tl.constexpr = QKV_N // BN0
    T1: tl.constexpr = H // BN1
    T2: tl.constexpr = INTER // BN2
    T3: tl.constexpr = H // BN3
    PER_LAYER: tl.constexpr = T0 + T1 + T2 + T3
    layer = 0  # while loops: the interpreter's range takes no runtime bound
    while layer < num_layers:
        base = layer * PER_LAYER
        c = cnt + layer * 4
        wl = layer.to(tl.int64)  # a stack of gate_up weights passes 2^31 bytes
        # qkv: bf16(down[l] + rm[l]) -> ra[l]; RMSNorm; the projection
        wq, sq = w_qkv + wl * (QKV_N * H), s_qkv + layer * QKV_N
        xq, rq, nq, aq, oq = down + layer * H, rm + layer * H, n1 + layer * H, ra + layer * H, qkv + layer * QKV_N
        t = _first(pid, base, G)
        mine = _mine(t, T0, G)
        if mine > 0:
            w, s = _qkv_load(wq, sq, t, BN0, H)
            if layer > 0:
                _wait(c - 4 + 3, H, err, spin_cap)
            _qkv_out(w, s, t, xq, rq, nq, aq, oq, c, eps, BN0, H)
            if WHILE:
                i = 1
                while i < mine:
                    w, s = _qkv_load(wq, sq, t + i * G, BN0, H)
                    _qkv_out(w, s, t + i * G, xq, rq, nq, aq, oq, c, eps, BN0, H)
                    i += 1
            else:
                for i in tl.range(1, mine, num_stages=STAGES):
                    w, s = _qkv_load(wq, sq, t + i * G, BN0, H)
                    _qkv_out(w, s, t + i * G, xq, rq, nq, aq, oq, c, eps, BN0, H)
        # o: the first H columns of the qkv row in attention's place
        base += T0
        wo, so, xo, oo = w_o + wl * (H * H), s_o + layer * H, qkv + layer * QKV_N, o + layer * H
        t = _first(pid, base, G)
        mine = _mine(t, T1, G)
        if mine > 0:
            _plain_phase(wo, so, xo, oo, c, QKV_N, c + 1, t, mine, G, err, spin_cap, H, BN1, H, STAGES, WHILE)
        # gate_up: bf16(o[l] + ra[l]) -> rm[l + 1]; RMSNorm; gate and up rows of the tile; silu(gate) * up
        base += T1
        wg_ptr, sg_ptr = w_gu + wl * (2 * INTER * H), s_gu + layer * (2 * INTER)
        xg, rg, ng, mg, ag = o + layer * H, ra + layer * H, n2 + layer * H, rm + (layer + 1) * H, act + layer * INTER
        t = _first(pid, base, G)
        mine = _mine(t, T2, G)
        if mine > 0:
            wg, wu, sg, su = _gu_load(wg_ptr, sg_ptr, t, INTER, BN2, H)
            _wait(c + 1, H, err, spin_cap)
            _gu_out(wg, wu, sg, su, t, xg, rg, ng, mg, ag, c + 2, eps, BN2, H)
            if WHILE:
                i = 1
                while i < mine:
                    wg, wu, sg, su = _gu_load(wg_ptr, sg_ptr, t + i * G, INTER, BN2, H)
                    _gu_out(wg, wu, sg, su, t + i * G, xg, rg, ng, mg, ag, c + 2, eps, BN2, H)
                    i += 1
            else:
                for i in tl.range(1, mine, num_stages=STAGES):
                    wg, wu, sg, su = _gu_load(wg_ptr, sg_ptr, t + i * G, INTER, BN2, H)
                    _gu_out(wg, wu, sg, su, t + i * G, xg, rg, ng, mg, ag, c + 2, eps, BN2, H)
        # down: act[l] -> down[l + 1]
        base += T2
        wd, sd, xd, od = w_d + wl * (H * INTER), s_d + layer * H, act + layer * INTER, down + (layer + 1) * H
        t = _first(pid, base, G)
        mine = _mine(t, T3, G)
        if mine > 0:
            _plain_phase(wd, sd, xd, od, c + 2, INTER, c + 3, t, mine, G, err, spin_cap, INTER, BN3, BK_D, STAGES,
                         WHILE)  # fmt: skip
        layer += 1


@dataclass(frozen=True)
class StreamTile:
    """Rows a tile of each projection (qkv, o, gate and up each, down), warps, programs an SM, and the stages
    Triton pipelines a program's tiles of one projection over (1: none, one tile in flight)."""

    bn: tuple[int, int, int, int]
    warps: int
    per_sm: int
    stages: int = 1

    def label(self) -> str:
        return f"{'x'.join(map(str, self.bn))}/{self.warps}w/{self.per_sm}ps/{self.stages}st"


@dataclass
class Weights:
    """Per-channel FP8 weights of ``layers`` llama-shaped layers, stacked, and their norms."""

    w_qkv: torch.Tensor
    s_qkv: torch.Tensor
    w_o: torch.Tensor
    s_o: torch.Tensor
    w_gu: torch.Tensor
    s_gu: torch.Tensor
    w_d: torch.Tensor
    s_d: torch.Tensor
    n1: torch.Tensor
    n2: torch.Tensor

    @property
    def layers(self) -> int:
        return self.w_qkv.shape[0]

    @property
    def dims(self) -> tuple[int, int, int]:
        """(hidden, qkv rows, intermediate)."""
        return self.w_o.shape[1], self.w_qkv.shape[1], self.w_d.shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w_qkv, self.s_qkv, self.w_o, self.s_o, self.w_gu,
                                                            self.s_gu, self.w_d, self.s_d))  # fmt: skip


def random_weights(layers: int, hidden: int, qkv_rows: int, inter: int, device, seed: int = 0) -> Weights:
    from graphserve.kernels.fp8_quant import quantize_weight_channels

    gen = torch.Generator(device=device).manual_seed(seed)

    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        ws, ss = [], []
        for _ in range(layers):
            w, s = quantize_weight_channels(torch.randn(n, k, device=device, generator=gen) / k**0.5)
            ws.append(w)
            ss.append(s)
        return torch.stack(ws), torch.stack(ss)

    w_qkv, s_qkv = stack(qkv_rows, hidden)
    w_o, s_o = stack(hidden, hidden)
    w_gu, s_gu = stack(2 * inter, hidden)
    w_d, s_d = stack(hidden, inter)
    norms = [(torch.rand(layers, hidden, device=device, generator=gen) + 0.5).to(torch.bfloat16) for _ in range(2)]
    return Weights(w_qkv, s_qkv, w_o, s_o, w_gu, s_gu, w_d, s_d, *norms)


class StreamBuffers:
    """A one-launch experiment's buffers for ``weights`` (one bf16 row; each layer's intermediates their own, the
    rows-done counters, the timeout count): what ``check`` reads, but for the SiLU·mul row each form keeps its
    own way."""

    def __init__(self, name: str, weights: Weights, programs: int, eps: float) -> None:
        if programs < 1:
            raise ValueError(f"{name}: programs={programs}, at least 1")
        (h, q, _), dev, layers = weights.dims, weights.w_qkv.device, weights.layers
        self.weights, self.programs, self.eps = weights, programs, eps
        bf = torch.bfloat16
        self.down = torch.zeros(layers + 1, h, device=dev, dtype=bf)
        self.rm = torch.zeros(layers + 1, h, device=dev, dtype=bf)
        self.ra = torch.zeros(layers, h, device=dev, dtype=bf)
        self.qkv = torch.zeros(layers, q, device=dev, dtype=bf)
        self.o = torch.zeros(layers, h, device=dev, dtype=bf)
        self.cnt = torch.zeros(layers, COUNTERS_PER_LAYER, device=dev, dtype=torch.int32)
        self.err = torch.zeros(1, device=dev, dtype=torch.int32)
        self.compiled = None


class LayerStream(StreamBuffers):
    """The one launch's buffers for ``weights`` (one bf16 row), and the launch."""

    def __init__(self, weights: Weights, tile: StreamTile, programs: int, eps: float = 1e-5) -> None:
        h, q, i = weights.dims
        n0, n1, n2, n3 = tile.bn
        if q % n0 or h % n1 or i % n2 or h % n3:
            raise ValueError(f"layer_stream: tile rows {tile.bn} must divide qkv {q}, o {h}, gate/up {i}, down {h}")
        super().__init__("layer_stream", weights, programs, eps)
        self.tile = tile
        self.act = torch.zeros(weights.layers, i, device=weights.w_qkv.device, dtype=torch.bfloat16)

    def __call__(self, spin_cap: int = SPIN_CAP) -> None:
        w, (h, q, i) = self.weights, self.weights.dims
        self.cnt.zero_()
        self.compiled = layer_stream_kernel[(self.programs,)](
            w.w_qkv, w.s_qkv, w.w_o, w.s_o, w.w_gu, w.s_gu, w.w_d, w.s_d, w.n1, w.n2,
            self.down, self.rm, self.ra, self.qkv, self.o, self.act, self.cnt, self.err, self.eps, w.layers,
            self.programs, spin_cap,
            H=h, QKV_N=q, INTER=i, BK_D=triton.next_power_of_2(i),
            BN0=self.tile.bn[0], BN1=self.tile.bn[1], BN2=self.tile.bn[2], BN3=self.tile.bn[3], STAGES=self.tile.stages,
            WHILE=interpreting(), num_warps=self.tile.warps, num_stages=1,
        )  # fmt: skip


def resident_programs(compiled, warps: int, device) -> int:
    """Programs of ``compiled`` one SM holds at once: registers, shared memory, warps, the block limit."""
    props = torch.cuda.get_device_properties(device)
    regs = max(1, compiled.n_regs) * 32 * warps
    by_regs = props.regs_per_multiprocessor // regs
    shared = compiled.metadata.shared
    by_shared = props.shared_memory_per_multiprocessor // shared if shared else 32
    by_warps = props.max_threads_per_multi_processor // (32 * warps)
    return max(0, min(by_regs, by_shared, by_warps, 32))


def reference_layer(w: Weights, layer: int, x: torch.Tensor, r: torch.Tensor, eps: float,
                    given: dict | None = None) -> dict:
    """One layer of the launch's arithmetic in PyTorch (fp32 sums, the same roundings) from its inputs. ``given``:
    intermediates to use in place of the reference's own (each stage then checked from the launch's inputs to it,
    so no error carries from one stage to the next)."""
    h, _, i = w.dims
    given = given or {}

    def normed(a, nw):
        a = a.float()
        rstd = torch.rsqrt(a.pow(2).mean() + eps)
        return ((a * rstd).bfloat16().float() * nw.float()).bfloat16().float()

    def proj(wq, s, x):
        return wq.float() @ x.float() * s

    out = {"ra": (x.float() + r.float()).bfloat16()}
    ra = given.get("ra", out["ra"])
    out["qkv"] = proj(w.w_qkv[layer], w.s_qkv[layer], normed(ra, w.n1[layer])).bfloat16()
    out["o"] = proj(w.w_o[layer], w.s_o[layer], given.get("qkv", out["qkv"])[:h]).bfloat16()
    out["rm"] = (given.get("o", out["o"]).float() + ra.float()).bfloat16()
    gu = proj(w.w_gu[layer], w.s_gu[layer], normed(given.get("rm", out["rm"]), w.n2[layer])).bfloat16().float()
    g, u = gu[:i], gu[i:]
    out["act"] = (g / (1 + torch.exp(-g)) * u).bfloat16()
    out["down"] = proj(w.w_d[layer], w.s_d[layer], given.get("act", out["act"])).bfloat16()
    return out


def check(stream: LayerStream, tolerance: float = 2e-2) -> float:
    """The largest relative error of any stage of any layer against ``reference_layer`` from the launch's own
    inputs to that stage; raises past ``tolerance`` or on a timeout counted in ``err``."""
    if int(stream.err.item()):
        raise AssertionError(f"layer_stream: {int(stream.err.item())} waits timed out (programs not all resident?)")
    worst = 0.0
    for layer in range(stream.weights.layers):
        got = {"ra": stream.ra[layer], "qkv": stream.qkv[layer], "o": stream.o[layer], "rm": stream.rm[layer + 1],
               "act": stream.act[layer], "down": stream.down[layer + 1]}  # fmt: skip
        want = reference_layer(stream.weights, layer, stream.down[layer], stream.rm[layer], stream.eps, got)
        for name, ref in want.items():
            err = float((got[name].float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))
            worst = max(worst, err)
            if not err < tolerance:
                raise AssertionError(f"layer_stream: layer {layer} {name} relative error {err:.2e}")
    return worst


def engine_layers(w: Weights, x: torch.Tensor, r: torch.Tensor, eps: float, cfgs: list) -> torch.Tensor:
    """The engine's four launches a layer over the same weights and roles (o_proj on the qkv row's first columns)."""
    from graphserve.kernels.fp8_gemv import fp8_gemv, fp8_norm_gemv, fp8_silu_mul_gemv

    h, q, i = w.dims
    for layer in range(w.layers):
        qkv, ra = fp8_norm_gemv(x, w.n1[layer], eps, w.w_qkv[layer], w.s_qkv[layer].view(-1, 1), 1, h, residual=r,
                                config=cfgs[0])  # fmt: skip
        o = fp8_gemv(qkv[:, :h], w.w_o[layer], w.s_o[layer].view(-1, 1), 1, h, config=cfgs[1])
        gu, r = fp8_norm_gemv(o, w.n2[layer], eps, w.w_gu[layer], w.s_gu[layer].view(-1, 1), 1, h, residual=ra,
                              config=cfgs[2])  # fmt: skip
        x = fp8_silu_mul_gemv(gu, w.w_d[layer], w.s_d[layer].view(-1, 1), 1, i, config=cfgs[3])
    return x


def engine_baseline(layers: int, calls: int) -> tuple:
    """What the one-launch experiments (this one and benchmarks/fp8_layer_stream_ws.py) time against, measured in
    their own run: the read probe, llama3-8b-shaped random weights of ``layers`` layers, a bf16 input row, the
    weights' floor and the engine's four launches a layer over them as CUDA graphs of ``calls`` steps (routing
    table tiles). Returns (bw, weights, x, floor_ms, engine_ms, rows), the engine's row in ``rows``, printed."""
    from benchmarks.kernels import graph_time_ms
    from benchmarks.roofline import measured_read_bw
    from graphserve.kernels.fp8_config import rule_for

    bw = measured_read_bw()
    print(f"probes: {bw.describe()}")
    dev = torch.device("cuda")
    w = random_weights(layers, HIDDEN, QKV_ROWS, INTERMEDIATE, dev)
    h, q, i = w.dims
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(1, h, device=dev, generator=gen).bfloat16()
    r = torch.zeros(1, h, device=dev, dtype=torch.bfloat16)
    rule = rule_for(dev)
    cfgs = [getattr(rule.route(1, n, k, "channel"), "config", None) for n, k in ((q, h), (h, h), (2 * i, h), (h, i))]
    floor_ms = bw.floor_ms(w.nbytes())
    engine_ms = graph_time_ms(lambda: engine_layers(w, x, r, 1e-5, cfgs), calls=calls)
    rows = [{"kernel": "engine: 4 launches a layer", "tile": "routing table", "programs": None, "ms": engine_ms}]
    print_table(rows, ["kernel", "tile", "ms"])
    return bw, w, x, floor_ms, engine_ms, rows


TILES = [  # each fits the programs an SM it asks for on an H200 (benchmarks.kernel_ptxas: registers, shared memory)
    StreamTile((8, 8, 4, 2), 4, 3, 1),
    StreamTile((8, 8, 4, 2), 4, 1, 3),
    StreamTile((8, 8, 4, 2), 4, 1, 4),
    StreamTile((8, 8, 4, 2), 8, 1, 3),
    StreamTile((4, 4, 2, 1), 4, 2, 2),
    StreamTile((4, 4, 2, 1), 4, 2, 3),
    StreamTile((4, 4, 2, 1), 4, 1, 5),
    StreamTile((16, 16, 8, 4), 8, 1, 3),
]


def main() -> None:
    from benchmarks.kernels import graph_time_ms
    from graphserve.kernels.common import sm_count

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--calls", type=int, default=4, help="back-to-back steps per CUDA graph")
    ap.add_argument("--result-name", default="fp8_layer_stream")
    args = ap.parse_args()

    bw, w, x, floor_ms, engine_ms, rows = engine_baseline(args.layers, args.calls)
    dev = w.w_qkv.device
    sms = sm_count(dev)
    for tile in TILES:
        began = time.perf_counter()
        probe = LayerStream(w, tile, 1)
        probe.down[0].copy_(x[0])
        probe(spin_cap=0)  # compile; one program never waits
        resident = resident_programs(probe.compiled, tile.warps, dev)
        row = {"kernel": "one launch, dataflow", "tile": tile.label(), "regs": probe.compiled.n_regs,
               "resident_per_sm": resident}  # fmt: skip
        if tile.per_sm > resident:
            print(f"{tile.label()}: {resident} programs an SM fit, {tile.per_sm} asked: skipped")
            rows.append({**row, "skipped": f"{resident} programs an SM fit"})
            continue
        stream = LayerStream(w, tile, tile.per_sm * sms)
        stream.down[0].copy_(x[0])
        stream()
        torch.cuda.synchronize()
        row["max_error"] = check(stream)
        row["programs"] = stream.programs
        row["ms"] = graph_time_ms(stream, calls=args.calls)
        if int(stream.err.item()):
            raise AssertionError(f"{tile.label()}: waits timed out while timed")
        rows.append(row)
        print_table([row], ["kernel", "tile", "programs", "regs", "ms", "max_error"])
        print(f"  ({time.perf_counter() - began:.1f} s)", flush=True)
    for row in rows:
        if "ms" in row:
            row["floor_ms"], row["ratio"], row["vs_engine"] = floor_ms, row["ms"] / floor_ms, row["ms"] / engine_ms
    print_table(rows, ["kernel", "tile", "programs", "regs", "ms", "floor_ms", "ratio", "vs_engine"])
    write_result(args.result_name, {"read": bw.summary(), "layers": w.layers, "weight_bytes": w.nbytes(), "rows": rows})


if __name__ == "__main__":
    main()
