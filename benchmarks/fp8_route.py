"""`python3 -m benchmarks.fp8_route`: FP8-weight projections by row count and their routing table. The code lives in graphserve/tuning/fp8_route.py, where `graphserve tune`
runs it too; this name is that same module, so imports of benchmarks.fp8_route (and tests that patch it) reach it."""

import sys

from graphserve.tuning import fp8_route as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
