"""The Triton-interpreter tests (modules that import tests/support/interp_setup.py) carry the ``slow`` marker, so
``make test-fast`` (-m "not slow") leaves them out while ``make test`` runs them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_interpreter_modules_are_slow_and_the_rest_are_not():
    # one collection (a second would import torch again): -m slow keeps the interpreter module, deselects the other
    files = ("tests/kernels/test_argmax_kernel.py", "tests/unit/test_env.py")
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "slow",
                          *files], cwd=TESTS.parent, capture_output=True, text=True, timeout=300).stdout
    kept = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    assert kept == {"tests/kernels/test_argmax_kernel.py"}, out
    deselected = re.search(r"(\d+) deselected", out)
    assert deselected and int(deselected.group(1)) >= 5, out  # test_env.py's tests, none of them slow
