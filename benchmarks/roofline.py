"""`python3 -m benchmarks.roofline`: this GPU's measured read bandwidth and matmul peak. The code lives in graphserve/tuning/roofline.py, where `graphserve tune`
runs it too; this name is that same module, so imports of benchmarks.roofline (and tests that patch it) reach it."""

import sys

from graphserve.tuning import roofline as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
