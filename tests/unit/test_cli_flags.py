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
        (["sweep", "--base-url", "http://127.0.0.1:9", "--profile", "--profile-steps", "0"], ["steps=0", "1000"]),
        (["profile", "--model", "builtin:tiny-llama", "--batch-size", "5000"], ["batch_size='5000'", "1024"]),
        (["profile", "--model", "builtin:tiny-llama", "--timeout", "0"], ["timeout=0", "> 0"]),
    ],
)
def test_bad_flag_is_refused_naming_it(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize(
    "argv, named",
    [
        (["bench", "--base-url", "http://127.0.0.1:9", "--max-running-requests", "8"], ["--max-running-requests"]),
        (["sweep", "--base-url", "http://127.0.0.1:9", "--cuda-graph-max-bs=64", "--mem-fraction", "0.8"],
         ["--cuda-graph-max-bs", "--mem-fraction"]),  # an abbreviation argparse accepts is caught too
        (["sweep", "--server-cmd", "srv --port {port}", "--disable-cuda-graph"], ["--disable-cuda-graph"]),
    ],
)
def test_engine_flags_without_model_are_refused_by_name(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert all(flag in err for flag in named) and "--model" in err, err


def test_seed_alone_is_a_client_flag_and_engine_flags_pass_with_model():
    import argparse

    from graphserve.bench import client
    from graphserve.cli import check_flags

    parser = argparse.ArgumentParser()
    client.add_arguments(parser)
    argv = ["--base-url", "http://127.0.0.1:9", "--seed", "3"]
    check_flags("bench", parser, parser.parse_args(argv), argv)  # no error: --seed seeds the prompts
    argv = ["--model", "builtin:tiny-llama", "--max-running-requests", "8"]
    check_flags("bench", parser, parser.parse_args(argv), argv)


@pytest.mark.parametrize("command", [["serve", "builtin:tiny-llama"], ["bench", "--model", "builtin:tiny-llama"]])
def test_tp_that_does_not_split_the_model_is_refused_before_a_port_is_bound(command, capsys):
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    assert main([*command, "--tp", "3", "--port" if command[0] == "serve" else "--num-prompts",
                 str(port) if command[0] == "serve" else "1"]) == 2
    assert time.monotonic() - t0 < 30.0  # refused from config.json alone: no model loaded, no server started
    err = capsys.readouterr().err
    assert "--tp=3" in err and "num_attention_heads=8" in err and "[1, 2, 4, 8]" in err, err
    with socket.socket() as s:  # the port was never taken
        s.bind(("127.0.0.1", port))
