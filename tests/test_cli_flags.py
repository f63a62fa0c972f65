"""Load-shape and planning flags that would silently mean something else are refused by name."""

from __future__ import annotations

import pytest

from graphserve.cli import main


@pytest.mark.parametrize(
    "argv, words",
    [
        (["plan", "dummy:llama3-8b", "--tp", "0"], ["--tp=0"]),
        (["plan", "dummy:llama3-8b", "--mem-fraction-static", "1.5"], ["--mem-fraction-static=1.5", "(0, 1)"]),
        (["plan", "dummy:llama3-8b", "--concurrency", "0,8"], ["concurrency", ">= 1"]),
        (["plan", "dummy:llama3-8b", "--input-len", "0"], ["input_len=0"]),
        (["bench", "--base-url", "http://127.0.0.1:9", "--max-concurrency", "0"], ["max_concurrency=0", ">= 1"]),
        (["bench", "--base-url", "http://127.0.0.1:9", "--warmup-requests", "-1"], ["warmup_requests=-1", ">= 0"]),
        (["bench", "--base-url", "http://127.0.0.1:9", "--request-rate", "-2"], ["request_rate=-2", "> 0"]),
        (["sweep", "--base-url", "http://127.0.0.1:9", "--concurrency", "1,0"], ["concurrency"]),
    ],
)
def test_bad_flag_is_refused_naming_it(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err
