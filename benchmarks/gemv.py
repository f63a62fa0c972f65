"""`python3 -m benchmarks.gemv`: the gemv kernels against cuBLAS and the routing rule. The code lives in graphserve/tuning/gemv.py, where `graphserve tune`
runs it too; this name is that same module, so imports of benchmarks.gemv (and tests that patch it) reach it."""

import sys

from graphserve.tuning import gemv as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
