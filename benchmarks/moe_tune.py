"""`python3 -m benchmarks.moe_tune`: the MoE expert kernels' tile tuner. The code lives in graphserve/tuning/moe_tune.py, where `graphserve tune`
runs it too; this name is that same module, so imports of benchmarks.moe_tune (and tests that patch it) reach it."""

import sys

from graphserve.tuning import moe_tune as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
