"""Programmatic dependent launch (PDL): a kernel starts while the one before it on the stream drains.

A decode step at small batch is a chain of short kernels (~340 for qwen3-30b-a3b at batch 1, most of them a
few microseconds), and between two of them the GPU idles: the next grid launches only after the previous one
has fully finished, and its programs then start from cold. Hopper lets a kernel launched with the
programmatic-serialization attribute be scheduled as soon as every program of the kernel before it has
started and signalled (``griddepcontrol.launch_dependents``); its programs then wait in
``griddepcontrol.wait`` until that kernel has completed and its memory writes are visible. The launch, the
programs' placement and their set-up overlap the previous kernel's tail. CUDA-graph capture keeps these
edges, so graph replay gets the same overlap.

The contract every kernel here keeps (``pdl_enter`` as its first statement, before any load or store):
- it waits before reading anything an earlier kernel wrote and before writing anything (an earlier kernel may
  still be reading the buffer: the caching allocator and a graph's pool reuse memory);
- every program waits, so the kernel completes only after its predecessor did: a kernel two launches later,
  waiting only on its own predecessor, still sees everything written before (completion is transitive).
A kernel of another library (cuBLAS, a PyTorch op) is launched without the attribute and serializes as
usual, on both sides.

A kernel may instead wait first (``pdl_wait``) and let the next kernel launch only after its main loop
(``pdl_release``): the FP8 streaming matmul does, so the next kernel's programs take the SMs as its own
finish streaming rather than sitting among them from its first wave on.

One kernel is left out by default: the FP8 streaming matmul (kernels/fp8_gemv.py). With it in (and releasing
at its start, as pdl_enter does), an FP8 llama3-8b batch-1 step was slower with PDL than without; with it out,
faster than without (``python3 -m benchmarks.pdl --models --fp8-models dummy:llama3-8b --bs 1 --skip
_fp8_gemv_kernel``, benchmarks/results/pdl_fp8.json). Releasing after its main loop, it gains at some batch
sizes and loses at others (ctx 2048: results/pdl_fp8_release_bs1_64.json at batch 1 and 64,
results/pdl_fp8_release.json at 4, 16 and 32, where batch 32 lost 0.35 ms), so it stays out. Left out, it
still releases after its main loop (``LATE_RELEASE``): launched without the attribute it starts after its
predecessor, but a PDL kernel after it (decode attention after the qkv projection, a norm) is placed as its
last programs finish streaming. In two calls (benchmarks.decode_prologue, results/decode_prologue*.json, the
step captured with and without the release and replayed in turns) that measured 2.742 against 2.841 ms and
2.716 against 2.718 for FP8 llama3-8b at batch 1, 4.546 against 4.582 and 4.508 against 4.548 at batch 64, and
10.967 against 11.019 and 10.662 against 10.716 for FP8 qwen3-30b-a3b at batch 64 (batch 1: 2.371 against
2.369, 2.343 against 2.371). Launched with the attribute everywhere, with each FMA program's first weight tile
asked for before its wait, it lost (results/pdl_fp8_early.json: 2.857 against 2.770 ms at batch 1).

A call site may still launch it with PDL (``pdl_joined``): the output projection right after decode attention,
where attention's grid runs in one wave with room beside it (models/llama.AFTER_DECODE_ATTENTION,
layers/attention_triton.leaves_room). Its programs are then placed while attention runs and start as it
completes: for the batch-1 attention block of llama3-8b (qkv, attention, o_proj over cold copies,
benchmarks.attention_block) 24.97 against 26.14 us and 24.53 against 25.84 in two calls; for whole FP8 steps
(benchmarks.pdl_join, results/pdl_join*.json and decode_overlap.json) within 1.2% either way, faster in 7 of
the 8 batch-1 rows timed (llama3-8b, qwen3-30b-a3b; contexts 512 and 2048), where two captures of one step
differ by up to 1.9%. At batch 64, where attention's grid fills the GPU, joining measured 2.2% slower for both
models (results/decode_overlap.json), hence the rule. Asking for the first weight tile before the wait as well
measured no better (24.53 us without it, 25.32 with it, in one call) and is not done. ``GRAPHSERVE_PDL_JOIN=0``
or the scope ``pdl_joins(False)`` turns it off.

``GRAPHSERVE_PDL_RELEASE_LEFT_OUT=0`` (or the scope ``pdl_release_left_out(False)``) keeps a left-out kernel from
releasing. ``GRAPHSERVE_PDL=0`` turns it off (read once per process: a launch on the eager path pays a lookup, not a parse;
a graph keeps the setting it was captured with);
``GRAPHSERVE_PDL_SKIP=name,name`` leaves the named kernels out instead of the default; ``pdl(False)`` and ``pdl(True, skip=...)`` do
the same in a scope (benchmarks/pdl.py captures the same model several ways). Off the GPU, under the
interpreter, before Hopper, or with a Triton that cannot launch this way, kernels launch as before.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from graphserve import env
from graphserve.kernels.common import interpreting, pushed

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: _capable() is False, the branch never compiles
    gdc_launch_dependents = gdc_wait = None

ENV = "GRAPHSERVE_PDL"
SKIP_ENV = "GRAPHSERVE_PDL_SKIP"
DEFAULT_SKIP = frozenset({"_fp8_gemv_kernel"})
# Kernels that wait first and let the next kernel launch only after their main loop (pdl_wait, pdl_release). Left
# out, such a kernel may still release (``releases_when_left_out``): launched without the attribute it starts only
# after its predecessor, but a kernel after it that is launched with PDL is placed as its last programs finish
# streaming, never among programs still to run.
LATE_RELEASE = frozenset({"_fp8_gemv_kernel"})
RELEASE_ENV = "GRAPHSERVE_PDL_RELEASE_LEFT_OUT"
# A call site may launch a left-out kernel with PDL after all (``pdl_joined``: the setting in force with those
# kernels taken off its skip list) where the kernel before it leaves room beside its programs: the output
# projection after decode attention. Whether such sites join: ``pdl_joins``'s scope, else GRAPHSERVE_PDL_JOIN (on
# unless "0").
JOIN_ENV = "GRAPHSERVE_PDL_JOIN"
_scoped: list[tuple[bool, frozenset[str]]] = []
_release_scoped: list[bool] = []
_joins_scoped: list[bool] = []


def _triton_launches_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=8)
def _capable(device: torch.device) -> bool:
    if device.type != "cuda" or interpreting() or gdc_wait is None or not _triton_launches_pdl():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=1)
def kernel_names() -> frozenset[str]:
    """The names of the Triton kernels in graphserve.kernels (``*_kernel``; helpers such as ``pdl_enter`` are
    not launched): what a list of kernels to leave out may name."""
    import importlib
    import pkgutil

    import graphserve.kernels as package

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names |= {v.__name__ for v in vars(module).values()
                  if isinstance(v, triton.runtime.jit.KernelInterface) and v.__name__.endswith("_kernel")}
    return frozenset(names)


def checked_skip(names: frozenset[str] | set[str], where: str) -> frozenset[str]:
    """``names`` as a frozenset, refused (naming ``where`` it came from) if one is not a kernel here: a typo
    would otherwise leave every kernel on PDL without a word."""
    unknown = sorted(set(names) - kernel_names())
    if unknown:
        raise ValueError(f"{where} names {', '.join(unknown)}: not a Triton kernel of graphserve.kernels "
                         f"(kernels that launch with PDL are named by their function, e.g. _fp8_gemv_kernel)")
    return frozenset(names)


@functools.lru_cache(maxsize=1)
def env_setting() -> tuple[bool, frozenset[str]]:
    """(on, kernels left out) from GRAPHSERVE_PDL and GRAPHSERVE_PDL_SKIP, read once per process."""
    skip = DEFAULT_SKIP
    if env.is_set(SKIP_ENV):
        skip = checked_skip({n.strip() for n in env.get(SKIP_ENV).split(",") if n.strip()},
                            f"{SKIP_ENV}={env.get(SKIP_ENV)!r}")
    return env.flag(ENV), skip


def _setting() -> tuple[bool, frozenset[str]]:
    """(on, kernels left out) in force: the innermost scope's, else the environment's."""
    return _scoped[-1] if _scoped else env_setting()


def pdl_on(device: torch.device, kernel: str | None = None) -> bool:
    """Whether ``kernel`` (any kernel when None), launched now on ``device``, uses programmatic dependent launch."""
    wanted, skip = _setting()
    return wanted and kernel not in skip and _capable(device)


def releases_when_left_out() -> bool:
    """Whether a LATE_RELEASE kernel left out of PDL still lets the kernel after it launch early (scope
    ``pdl_release_left_out``, else GRAPHSERVE_PDL_RELEASE_LEFT_OUT, read once; on unless it is "0")."""
    return _release_scoped[-1] if _release_scoped else _release_env()


@functools.lru_cache(maxsize=1)
def _release_env() -> bool:
    return env.flag(RELEASE_ENV)


def pdl_args(device: torch.device, kernel: str) -> dict[str, bool]:
    """The launch keywords of ``kernel``, a kernel that starts with ``pdl_enter(PDL)`` or ``pdl_wait(PDL)``. A
    LATE_RELEASE kernel left out keeps its release (``PDL``) without the launch attribute, where
    ``releases_when_left_out``: its wait is then a no-op (nothing was launched early)."""
    on = pdl_on(device, kernel)
    release = on or (kernel in LATE_RELEASE and releases_when_left_out() and pdl_on(device))
    return {"PDL": release, "launch_pdl": on}


def joins_on() -> bool:
    """Whether ``pdl_joined`` scopes take effect: ``pdl_joins``'s scope, else GRAPHSERVE_PDL_JOIN (read once)."""
    return _joins_scoped[-1] if _joins_scoped else _join_env()


@functools.lru_cache(maxsize=1)
def _join_env() -> bool:
    return env.flag(JOIN_ENV)


@contextlib.contextmanager
def pdl_joined(names: frozenset[str] | set[str]) -> Iterator[None]:
    """Launches in this scope use the setting in force with ``names`` (kernels that wait first, ``pdl_wait``) taken
    off its skip list, where joining is on (``joins_on``, asked as the scope opens): for a call site whose previous
    kernel leaves room beside its programs. Opened per layer and step, so ``names`` is checked once per set."""
    if not joins_on():
        yield
        return
    wanted, skip = _setting()
    with pushed(_scoped, (wanted, skip - _known(frozenset(names)))):
        yield


@functools.lru_cache(maxsize=16)
def _known(names: frozenset[str]) -> frozenset[str]:
    return checked_skip(names, "pdl_joined(...)")


def pdl_joins(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Whether ``pdl_joined`` scopes opened in this scope take effect (benchmarks.pdl_join times both)."""
    return pushed(_joins_scoped, enabled)


def pdl_release_left_out(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Kernels launched (or captured) in this scope: whether a LATE_RELEASE kernel left out of PDL still releases
    the kernel after it (benchmarks.decode_prologue times both)."""
    return pushed(_release_scoped, enabled)


def pdl(enabled: bool, skip: frozenset[str] | set[str] = DEFAULT_SKIP) -> contextlib.AbstractContextManager[None]:
    """Kernels launched (or captured) in this scope use PDL when ``enabled`` and the device allows it, except
    the kernels named in ``skip`` (by default, those left out by default)."""
    return pushed(_scoped, (enabled, checked_skip(skip, "pdl(skip=...)")))


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first statement: let the next kernel launch, then wait for the previous one to complete."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """A kernel's first statement where ``pdl_release`` comes later: wait for the previous kernel to complete."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel launch: placed after a kernel's main loop, its programs are then scheduled only
    as this kernel's last programs finish their streams, not among them from its first wave on."""
    if PDL:
        gdc_launch_dependents()
