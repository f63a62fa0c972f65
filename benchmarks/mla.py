"""`python3 -m benchmarks.mla`: the MLA decode kernel and its tile sweep. The code lives in graphserve/tuning/mla.py, where `graphserve tune`
runs it too; this name is that same module, so imports of benchmarks.mla (and tests that patch it) reach it."""

import sys

from graphserve.tuning import mla as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
