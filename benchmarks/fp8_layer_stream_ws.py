"""The batch-1 FP8 decoder's projections in one persistent launch whose weights arrive by TMA from a warp of their
own: does a stream that never waits on the data dependency beat the engine's launch per projection? An
experiment, not an engine path.

``benchmarks.fp8_layer_stream`` ran every projection of every layer in one launch of resident Triton programs
and lost to the engine's 128 launches in every form (1.34-1.68x): each program could keep only a tile or a few
pipelined tiles of weight in flight, and while it waited for the projection its input comes from, its stream
stopped. Here each program (one an SM) is two partitions (Gluon ``warp_specialize``):

- a **producer** warp walks the program's items in list order (layer, projection, row tile; program ``p`` takes
  every item whose index is ``p`` modulo the grid) and, for each, requests the tile's weight as ``[BN, BK]`` fp8
  boxes by TMA into a ring of ``NBUF`` shared-memory slots of ``SUB`` boxes, each slot completing on its own
  mbarrier. It never looks at activations, so it waits only for a free slot: while the consumers wait for a dependency, up to
  ``NBUF * SUB * BN * BK`` bytes of the weights they will need next keep arriving (with the first tile 184 KiB an
  SM, about 25 MB over the GPU: more than one o_proj).
- the **consumer** warps wait until the projection their input comes from has counted all its rows done (an
  int32 counter per layer and projection, polled, then an acquire), stage the input row in shared memory once per
  projection (the residual add and RMSNorm for qkv and gate_up, SiLU(gate) * up for down), then for each slot
  wait on its mbarrier, multiply-add its boxes against the row in fp32, and hand the slot back; at a tile's end
  they scale, store and count its rows done (one release add per row, by the thread that stored it).

Deadlock freedom as in ``fp8_layer_stream``: every item depends only on earlier items, each program takes its
items in list order, every program is resident (one an SM, the grid the SM count), and a wait past ``spin_cap``
polls counts itself in ``err`` instead of hanging (the benchmark refuses such a result).

Attention is not in the list: o_proj reads the first ``hidden`` columns of the qkv row in its place. gate_up is
one projection of 2 x intermediate rows (its output the bf16 gate and up rows, as the engine stores them) and
down applies SiLU(gate) * up as it stages its input, as the engine's ``fp8_silu_mul_gemv`` does. Numerics as
``fp8_layer_stream.reference_layer`` (per-channel FP8 weights, fp32 sums); ``check`` compares every stage of every
layer against it from the launch's own inputs before timing.

Measured on an H200 (results/fp8_layer_stream_ws_first.json, fp8_layer_stream_ws.json,
fp8_layer_stream_ws_warps.json): every tile took 1.26-1.94x the engine's four launches a layer. With the waits
skipped (``ms_no_waits``: ``spin_cap`` 0, output unchecked) the fastest tile streamed the weights in 2.023 ms
against the engine's 2.209 with its dependencies, so this form's cost is the dependency chain (0.32-1.20 ms over
the 128 projections: the last tile of each, then the wait, then the input staged before the first box of the
next), not the stream.

Run: python3 -m benchmarks.fp8_layer_stream_ws   (writes benchmarks/results/fp8_layer_stream_ws.json)
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from benchmarks.common import print_table, write_result
from benchmarks.fp8_layer_stream import SPIN_CAP, StreamBuffers, Weights, check

PRODUCER_REGS = gl.constexpr(40)
SILU_ROWS = gl.constexpr(8)  # down's input staged this many BK-wide rows at a time
TMA_BOX_MAX = 256  # elements along a TMA box's dimension
SCRATCH_BYTES = 1024  # shared memory the compiler adds to what a tile plans (reductions, at most this much)


@gluon.jit
def _wait(cnt_ptr, target, err_ptr, spin_cap):
    """Until ``*cnt_ptr`` reaches ``target`` (volatile polls, then an acquire and a barrier of the consumer warps);
    after ``spin_cap`` polls, count a timeout in ``*err_ptr`` and go on."""
    seen = gl.load(cnt_ptr, volatile=True)
    polls = 0
    while (seen < target) & (polls < spin_cap):
        seen = gl.load(cnt_ptr, volatile=True)
        polls += 1
    if seen < target:
        gl.atomic_add(err_ptr, 1, sem="relaxed", scope="gpu")
    gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def _first(pid, base, G):
    """This program's first tile of a projection whose items start at list index ``base``."""
    return (pid + G - base % G) % G


@gluon.jit
def _offsets(R: gl.constexpr, BK: gl.constexpr, L: gl.constexpr):
    """Row-major offsets of an ``[R, BK]`` block in layout ``L``."""
    r = gl.arange(0, R, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, BK, layout=gl.SliceLayout(0, L))
    return r[:, None] * BK + c[None, :]


@gluon.jit
def _stage_norm(xs, x_ptr, r_ptr, nw_ptr, sum_ptr, owner, eps, H: gl.constexpr, BK: gl.constexpr, L: gl.constexpr):
    """RMSNorm (rounded twice, bf16) of bf16(x + r) into ``xs`` rows ``[0, H / BK)``; ``owner`` also stores the
    sum (the next norm's residual)."""
    offs = _offsets(H // BK, BK, L)
    a = (gl.load(x_ptr + offs, cache_modifier=".cg").to(gl.float32)
         + gl.load(r_ptr + offs, cache_modifier=".cg").to(gl.float32)).to(gl.bfloat16)  # fmt: skip
    if owner:
        gl.store(sum_ptr + offs, a)
    af = a.to(gl.float32)
    rstd = 1.0 / gl.sqrt(gl.sum(gl.sum(af * af, axis=1), axis=0) / H + eps)
    nw = gl.load(nw_ptr + offs).to(gl.float32)
    xs.slice(0, H // BK).store(((af * rstd).to(gl.bfloat16).to(gl.float32) * nw).to(gl.bfloat16))


@gluon.jit
def _stage_copy(xs, x_ptr, H: gl.constexpr, BK: gl.constexpr, L: gl.constexpr):
    """The first ``H`` values of the row at ``x_ptr`` into ``xs``."""
    xs.slice(0, H // BK).store(gl.load(x_ptr + _offsets(H // BK, BK, L), cache_modifier=".cg"))


@gluon.jit
def _stage_silu(xs, gu_ptr, INTER: gl.constexpr, BK: gl.constexpr, RS: gl.constexpr, L: gl.constexpr):
    """bf16(silu(gate) * up) of the gate_up row into ``xs``, ``RS`` rows of ``BK`` at a time."""
    offs = _offsets(RS, BK, L)
    for i in gl.static_range(INTER // (RS * BK)):
        g = gl.load(gu_ptr + i * RS * BK + offs, cache_modifier=".cg").to(gl.float32)
        u = gl.load(gu_ptr + INTER + i * RS * BK + offs, cache_modifier=".cg").to(gl.float32)
        xs.slice(i * RS, RS).store((g / (1.0 + gl.exp(-g)) * u).to(gl.bfloat16))


@gluon.jit
def _consume(wbuf, ready, empty, xc, s_ptr, out_ptr, done_ptr, t, T, G, k,
             K: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NBUF: gl.constexpr, SUB: gl.constexpr,
             L: gl.constexpr):  # fmt: skip
    """Tiles ``t, t + G, ... < T`` of a projection whose input row is staged in ``xc`` (``[rows, 1, BK]``): each
    slot (``SUB`` boxes of ``[BN, BK]``) waited for, multiplied in and handed back; each tile scaled, stored and counted. Returns the ring position."""
    while t < T:
        acc = gl.zeros([BN, BK], gl.float32, L)
        for c in range(K // (SUB * BK)):
            slot = k % NBUF
            mbarrier.wait(ready.index(slot), (k // NBUF) & 1)
            for j in gl.static_range(SUB):
                w = wbuf.index(slot * SUB + j).load(L)
                xk = xc.index(c * SUB + j).load(L)  # [1, BK]
                acc += w.to(gl.float32) * xk.to(gl.float32)
            gl.thread_barrier()  # every consumer warp has read the slot before it is handed back
            mbarrier.arrive(empty.index(slot), count=1)
            k += 1
        rows = t * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, L))
        y = gl.sum(acc, axis=1) * gl.load(s_ptr + rows)
        gl.store(out_ptr + rows, y.to(gl.bfloat16))
        gl.atomic_add(done_ptr + rows * 0, gl.full([BN], 1, gl.int32, layout=gl.SliceLayout(1, L)), sem="release",
                      scope="gpu")  # fmt: skip
        t += G
    return k


@gluon.jit
def _consumer(wbuf, ready, empty, xs, xc, s_qkv, s_o, s_gu, s_d, n1, n2, down, rm, ra, qkv, o, gu, cnt, err, eps,
              num_layers, G, spin_cap,
              H: gl.constexpr, QKV_N: gl.constexpr, INTER: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              NBUF: gl.constexpr, SUB: gl.constexpr, T0: gl.constexpr, T1: gl.constexpr, T2: gl.constexpr,
              T3: gl.constexpr):  # fmt: skip
    """The consumer warps; ``T0``-``T3``: the tiles of qkv, o, gate_up and down."""
    TPW_C: gl.constexpr = BK // 16
    L: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_C, TPW_C], [gl.num_warps(), 1], [1, 0])
    PER_LAYER: gl.constexpr = T0 + T1 + T2 + T3
    pid = gl.program_id(0)
    k = 0
    for layer in range(num_layers):
        base = layer * PER_LAYER
        c = cnt + layer * 4
        # qkv: bf16(down[l] + rm[l]) -> ra[l]; RMSNorm; the projection
        t = _first(pid, base, G)
        if t < T0:
            if layer > 0:
                _wait(c - 1, H, err, spin_cap)
            gl.thread_barrier()
            _stage_norm(xs, down + layer * H, rm + layer * H, n1 + layer * H, ra + layer * H, t == 0, eps, H, BK, L)
            gl.thread_barrier()
            k = _consume(wbuf, ready, empty, xc, s_qkv + layer * QKV_N, qkv + layer * QKV_N, c, t, T0, G, k, H, BN,
                         BK, NBUF, SUB, L)  # fmt: skip
        # o: the first H columns of the qkv row in attention's place
        base += T0
        t = _first(pid, base, G)
        if t < T1:
            _wait(c, QKV_N, err, spin_cap)
            _stage_copy(xs, qkv + layer * QKV_N, H, BK, L)
            gl.thread_barrier()
            k = _consume(wbuf, ready, empty, xc, s_o + layer * H, o + layer * H, c + 1, t, T1, G, k, H, BN, BK, NBUF,
                         SUB, L)  # fmt: skip
        # gate_up: bf16(o[l] + ra[l]) -> rm[l + 1]; RMSNorm; gate and up rows
        base += T1
        t = _first(pid, base, G)
        if t < T2:
            _wait(c + 1, H, err, spin_cap)
            _stage_norm(xs, o + layer * H, ra + layer * H, n2 + layer * H, rm + (layer + 1) * H, t == 0, eps, H, BK,
                        L)  # fmt: skip
            gl.thread_barrier()
            k = _consume(wbuf, ready, empty, xc, s_gu + layer * 2 * INTER, gu + layer * 2 * INTER, c + 2, t, T2, G, k,
                         H, BN, BK, NBUF, SUB, L)  # fmt: skip
        # down: silu(gate) * up -> down[l + 1]
        base += T2
        t = _first(pid, base, G)
        if t < T3:
            _wait(c + 2, 2 * INTER, err, spin_cap)
            _stage_silu(xs, gu + layer * 2 * INTER, INTER, BK, SILU_ROWS, L)
            gl.thread_barrier()
            k = _consume(wbuf, ready, empty, xc, s_d + layer * H, down + (layer + 1) * H, c + 3, t, T3, G, k, INTER,
                         BN, BK, NBUF, SUB, L)  # fmt: skip


@gluon.jit
def _produce(desc, wbuf, ready, empty, row0, t, T, G, k,
             K: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NBUF: gl.constexpr, SUB: gl.constexpr):  # fmt: skip
    """Request tiles ``t, t + G, ... < T`` (rows from ``row0``) a slot of ``SUB`` boxes at a time, each into the
    next free slot."""
    while t < T:
        for c in range(K // (SUB * BK)):
            slot = k % NBUF
            mbarrier.wait(empty.index(slot), ((k // NBUF) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, SUB * BN * BK)
            for j in gl.static_range(SUB):
                tma.async_copy_global_to_shared(desc, [row0 + t * BN, (c * SUB + j) * BK], bar,
                                                wbuf.index(slot * SUB + j))  # fmt: skip
            k += 1
        t += G
    return k


@gluon.jit
def _producer(d_qkv, d_o, d_gu, d_d, wbuf, ready, empty, num_layers, G,
              H: gl.constexpr, QKV_N: gl.constexpr, INTER: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              NBUF: gl.constexpr, SUB: gl.constexpr, T0: gl.constexpr, T1: gl.constexpr, T2: gl.constexpr,
              T3: gl.constexpr):  # fmt: skip
    """The producer warp; ``T0``-``T3`` as the consumers'."""
    PER_LAYER: gl.constexpr = T0 + T1 + T2 + T3
    pid = gl.program_id(0)
    k = 0
    for layer in range(num_layers):
        base = layer * PER_LAYER
        k = _produce(d_qkv, wbuf, ready, empty, layer * QKV_N, _first(pid, base, G), T0, G, k, H, BN, BK, NBUF, SUB)
        base += T0
        k = _produce(d_o, wbuf, ready, empty, layer * H, _first(pid, base, G), T1, G, k, H, BN, BK, NBUF, SUB)
        base += T1
        k = _produce(d_gu, wbuf, ready, empty, layer * 2 * INTER, _first(pid, base, G), T2, G, k, H, BN, BK, NBUF, SUB)
        base += T2
        k = _produce(d_d, wbuf, ready, empty, layer * H, _first(pid, base, G), T3, G, k, INTER, BN, BK, NBUF, SUB)


@gluon.jit
def layer_stream_ws_kernel(
    d_qkv, d_o, d_gu, d_d, s_qkv, s_o, s_gu, s_d, n1, n2,
    down, rm, ra, qkv, o, gu, cnt, err, eps, num_layers, G, spin_cap,
    H: gl.constexpr, QKV_N: gl.constexpr, INTER: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
    NBUF: gl.constexpr,
    SUB: gl.constexpr,
):  # fmt: skip
    """Layer l reads ``down[l]``, ``rm[l]`` (slot 0: the step's input and residual) and writes ``ra[l]``,
    ``qkv[l]``, ``o[l]``, ``gu[l]``, ``rm[l + 1]``, ``down[l + 1]``; ``cnt`` [num_layers, 4] zeroed (rows done).
    Weights by descriptor (``[layers * rows, K]`` fp8, ``[BN, BK]`` boxes), scales per channel."""
    wbuf = gl.allocate_shared_memory(gl.float8e4nv, [NBUF * SUB, BN, BK], d_qkv.layout)
    XR: gl.constexpr = triton.next_power_of_2(INTER // BK)
    xs_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    xs = gl.allocate_shared_memory(gl.bfloat16, [XR, BK], xs_layout)  # the staged row, written as [rows, BK]
    xs_chunks = xs._reinterpret(gl.bfloat16, [XR, 1, BK], xs_layout)  # and read a [1, BK] chunk at a time
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    T0: gl.constexpr = QKV_N // BN  # each projection's tiles, as both partitions walk them
    T1: gl.constexpr = H // BN
    T2: gl.constexpr = 2 * INTER // BN
    T3: gl.constexpr = H // BN
    gl.warp_specialize(
        [
            (_consumer, (wbuf, ready, empty, xs, xs_chunks, s_qkv, s_o, s_gu, s_d, n1, n2, down, rm, ra, qkv, o, gu, cnt,
                         err, eps, num_layers, G, spin_cap, H, QKV_N, INTER, BN, BK, NBUF, SUB, T0, T1, T2, T3)),
            (_producer, (d_qkv, d_o, d_gu, d_d, wbuf, ready, empty, num_layers, G, H, QKV_N, INTER, BN, BK, NBUF, SUB, T0,
                         T1, T2, T3)),
        ],
        [1],
        [PRODUCER_REGS],
    )  # fmt: skip


@dataclass(frozen=True)
class WsTile:
    """Rows and columns of a TMA box, the ring's slots, the boxes a slot (one mbarrier each way), and the consumer
    warps."""

    bn: int
    bk: int
    nbuf: int
    sub: int = 1
    warps: int = 4

    def __post_init__(self) -> None:
        # a tile's shapes are Gluon tensor shapes (powers of two), the box one TMA request, the consumer layout
        # 16 columns a thread with a warp's threads along one row or more
        for field, value, low, high in (("bn", self.bn, 1, None), ("bk", self.bk, 16, TMA_BOX_MAX),
                                        ("sub", self.sub, 1, None), ("warps", self.warps, 1, None)):  # fmt: skip
            if value < low or value & (value - 1) or (high is not None and value > high):
                raise ValueError(f"WsTile {field}={value}: must be a power of two >= {low}"
                                 + (f" and <= {high}" if high else ""))  # fmt: skip
        if self.nbuf < 1:
            raise ValueError(f"WsTile nbuf={self.nbuf}: at least 1 slot")

    def label(self) -> str:
        return f"{self.bn}x{self.bk}x{self.sub}x{self.nbuf}/{self.warps}w"

    def shared_bytes(self, inter: int) -> int:
        """The ring, the staged row (bf16, ``inter`` wide in a power of two of ``bk``-wide rows) and the barriers:
        what the kernel allocates, but for the compiler's scratch."""
        return (
            self.nbuf * self.sub * self.bn * self.bk
            + triton.next_power_of_2(inter // self.bk) * self.bk * 2
            + self.nbuf * 16
        )


def box_descriptor(weight: torch.Tensor, bn: int, bk: int):
    """A TMA descriptor of ``[bn, bk]`` fp8 boxes over a row-major ``[rows, K]`` weight (no swizzle: the
    consumers read the boxes with their own layout)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    return TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [bn, bk], layout)


def descriptors(w: Weights, bn: int, bk: int) -> list:
    """The four stacked weights as ``[layers * rows, K]`` descriptors of ``[bn, bk]`` boxes."""
    return [box_descriptor(t.reshape(-1, t.shape[-1]), bn, bk) for t in (w.w_qkv, w.w_o, w.w_gu, w.w_d)]


class LayerStreamWS(StreamBuffers):
    """The one launch's buffers for ``weights`` (one bf16 row), and the launch. Its fields are those
    ``fp8_layer_stream.check`` reads (``act`` from the gate_up rows)."""

    def __init__(self, weights: Weights, tile: WsTile, programs: int, eps: float = 1e-5) -> None:
        h, q, i = weights.dims
        if q % tile.bn or h % tile.bn or (2 * i) % tile.bn:
            raise ValueError(
                f"layer_stream_ws: tile rows {tile.bn} must divide qkv {q}, o and down {h}, gate_up {2 * i}"
            )
        if h % (tile.sub * tile.bk) or i % (tile.sub * tile.bk):
            raise ValueError(f"layer_stream_ws: slot columns {tile.sub} x {tile.bk} must divide hidden {h} and "
                             f"intermediate {i}")  # fmt: skip
        rows = SILU_ROWS.value
        if i % (rows * tile.bk):
            raise ValueError(f"layer_stream_ws: intermediate {i} must be a multiple of {rows} x bk {tile.bk} "
                             f"(down's input is staged in {rows * tile.bk}-column pieces)")  # fmt: skip
        super().__init__("layer_stream_ws", weights, programs, eps)
        self.tile = tile
        self.gu = torch.zeros(weights.layers, 2 * i, device=weights.w_qkv.device, dtype=torch.bfloat16)
        self.descs = descriptors(weights, tile.bn, tile.bk)

    @property
    def act(self) -> torch.Tensor:
        i = self.weights.dims[2]
        g, u = self.gu[:, :i].float(), self.gu[:, i:].float()
        return (g / (1 + torch.exp(-g)) * u).bfloat16()

    def __call__(self, spin_cap: int = SPIN_CAP) -> None:
        w, (h, q, i) = self.weights, self.weights.dims
        self.cnt.zero_()
        self.compiled = layer_stream_ws_kernel[(self.programs,)](
            *self.descs, w.s_qkv, w.s_o, w.s_gu, w.s_d, w.n1, w.n2,
            self.down, self.rm, self.ra, self.qkv, self.o, self.gu, self.cnt, self.err, self.eps, w.layers,
            self.programs, spin_cap,
            H=h, QKV_N=q, INTER=i, BN=self.tile.bn, BK=self.tile.bk, NBUF=self.tile.nbuf, SUB=self.tile.sub, num_warps=self.tile.warps,
        )  # fmt: skip


TILES = [  # shared memory within an H200 SM's 227 KB a block with the staged row (28 KB)
    WsTile(32, 256, 23),
    WsTile(32, 256, 11, 2),
    WsTile(32, 256, 5, 4),
    WsTile(32, 256, 2, 8),
    WsTile(16, 256, 11, 4),
    WsTile(16, 256, 5, 8),
]


def main() -> None:
    from benchmarks.fp8_layer_stream import engine_baseline
    from benchmarks.kernels import graph_time_ms
    from graphserve.kernels.common import sm_count

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--calls", type=int, default=4, help="back-to-back steps per CUDA graph")
    ap.add_argument("--result-name", default="fp8_layer_stream_ws")
    ap.add_argument("--tiles", nargs="*", default=None, help="bn,bk,nbuf,sub,warps each (default: TILES)")
    args = ap.parse_args()
    tiles = [WsTile(*map(int, t.split(","))) for t in args.tiles] if args.tiles else TILES

    bw, w, x, floor_ms, engine_ms, rows = engine_baseline(args.layers, args.calls)
    dev = w.w_qkv.device
    sms = sm_count(dev)
    limit = torch.cuda.get_device_properties(dev).shared_memory_per_block_optin
    for tile in tiles:
        began = time.perf_counter()
        row = {"kernel": "one launch, TMA producer warp", "tile": tile.label()}
        planned = tile.shared_bytes(w.dims[2]) + SCRATCH_BYTES
        if planned > limit:  # recorded, not fatal: the other tiles still run
            print(f"{tile.label()}: {planned} bytes of shared memory planned, the device allows {limit} a block")
            rows.append({**row, "skipped": f"shared memory {planned} > {limit} a block"})
            continue
        stream = LayerStreamWS(w, tile, sms)
        stream.down[0].copy_(x[0])
        stream()
        torch.cuda.synchronize()
        row["shared_bytes"] = stream.compiled.metadata.shared
        row["max_error"] = check(stream)
        row["programs"] = stream.programs
        row["ms"] = graph_time_ms(stream, calls=args.calls)
        if int(stream.err.item()):
            raise AssertionError(f"{tile.label()}: waits timed out while timed")
        # the same launch with every dependency wait skipped (spin_cap 0): the stream and the arithmetic alone, what
        # the waits cost is the difference (its output is not checked: the items no longer wait for their inputs)
        row["ms_no_waits"] = graph_time_ms(functools.partial(stream, spin_cap=0), calls=args.calls)
        rows.append(row)
        print_table([row], ["kernel", "tile", "programs", "shared_bytes", "ms", "ms_no_waits", "max_error"])
        print(f"  ({time.perf_counter() - began:.1f} s)", flush=True)
    for row in rows:
        if "ms" in row:
            row["floor_ms"], row["ratio"], row["vs_engine"] = floor_ms, row["ms"] / floor_ms, row["ms"] / engine_ms
    print_table(
        rows, ["kernel", "tile", "programs", "shared_bytes", "ms", "ms_no_waits", "floor_ms", "ratio", "vs_engine"]
    )
    write_result(args.result_name, {"read": bw.summary(), "layers": w.layers, "weight_bytes": w.nbytes(), "rows": rows})


if __name__ == "__main__":
    main()
