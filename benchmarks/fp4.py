"""`python3 -m benchmarks.fp4`: the FP4 kernels and their routing rule. The code lives in graphserve/tuning/fp4.py, where `graphserve tune`
runs it too; this name is that same module, so imports of benchmarks.fp4 (and tests that patch it) reach it."""

import sys

from graphserve.tuning import fp4 as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
