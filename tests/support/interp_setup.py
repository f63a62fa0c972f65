"""Run a test module's Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET is read when a kernel is first run, by a triton imported after it is set. If something
imported triton compiled before (torch._dynamo does, through transformers) and there is no GPU to compile
for, triton and the kernel modules are dropped from the import cache and imported again under the
interpreter; modules that imported them earlier keep their own (compiled) copies. A test module calls
``use_interpreter()`` before it imports triton or a kernel:

    from interp_setup import use_interpreter

    use_interpreter("graphserve.layers.moe")

    import triton.language as tl  # noqa: E402
"""

from __future__ import annotations

import os
import sys

import torch


def use_interpreter(*also: str) -> None:
    """Choose the interpreter for the kernels the caller imports next; on a GPU machine, change nothing.

    ``also`` names modules outside graphserve.kernels to import again with the kernels (the MoE tests name
    graphserve.layers.moe, whose FusedMoE they run on the kernel path). Nothing else is dropped: a module
    imported twice defines its classes twice, and an object of one copy is no instance of the other's, so
    the modules the rest of the suite already holds (the quantization config in graphserve.layers.quant
    among them) stay as they are.
    """
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        if torch.cuda.is_available():
            return  # a whole-suite run on a GPU machine: these checks run compiled there
        # triton._C (the compiled extension and its submodules) stays: it cannot be loaded twice
        stale = [m for m in sys.modules if m.split(".")[0] == "triton" and not m.startswith("triton._C")]
        stale += [m for m in sys.modules if m.startswith("graphserve.kernels") or m in also]
        for name in stale:
            sys.modules.pop(name, None)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def kernel_device() -> torch.device:
    """Where the kernels run: the CPU under the interpreter, else the GPU. Call after ``use_interpreter``."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return torch.device("cpu") if isinstance(tl.standard.cdiv, InterpretedFunction) else torch.device("cuda")
