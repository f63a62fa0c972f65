"""What a newcomer meets first: compare pointing at the files it takes, serve --help with every default, and a
scaling fit that says when the data cannot support its ceiling."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from graphserve.analysis.grid_compare import fit_quality
from graphserve.analysis.report_text import fit_text
from graphserve.analysis.scaling import fit_step_time
from graphserve.cli import main

N = [1, 2, 4, 8, 16, 32]


def test_compare_on_a_sweep_summary_names_the_level_files(tmp_path, capsys):
    sweep = {"points": [{"concurrency": c, "result_file": f"levels/c{c}.json"} for c in (1, 4, 16, 64)],
             "fit": None}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(sweep))
    assert main(["compare", str(path), str(path)]) == 2
    err = capsys.readouterr().err
    assert "is a sweep's summary" in err and "graphserve bench --output-file" in err
    assert f"{tmp_path}/levels/c1.json, {tmp_path}/levels/c4.json, {tmp_path}/levels/c16.json and 1 more" in err


def test_serve_help_shows_every_default(capsys):
    from graphserve.server.serve_args import add_arguments

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("TCP port to listen on (default: 30000)", "(default: 5.0)", "(default: 128)", "(default: info)",
                  "(default: 127.0.0.1)"):
        assert shown in text, shown
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    formatter = parser.formatter_class("serve")
    for action in parser._actions:
        if action.option_strings and action.default not in (None, argparse.SUPPRESS) and action.dest != "help":
            assert "(default" in (formatter._get_help_string(action) or ""), action.dest


def test_a_fit_whose_slope_is_not_pinned_down_quotes_no_ceiling():
    rng = np.random.default_rng(1)
    noisy = fit_step_time(N, [10 + 1.0 * n + rng.normal(0, 6) for n in N])
    assert noisy.r2 > 0.5  # a good-looking R²: only the slope's interval gives it away
    assert noisy.ceiling_doubt is not None
    assert "ceiling not supported by the data: b's 95% CI is ±" in noisy.summary()
    assert f"{noisy.asymptote_tok_s:.1f} tok/s" not in noisy.summary()
    quality = fit_quality(noisy.to_dict(), len(N))
    assert not quality["reliable"] and any("the ceiling lies anywhere in" in r for r in quality["reasons"])
    assert "unreliable, no ceiling quoted" in fit_text(noisy.to_dict(), quality)

    clean = fit_step_time(N, [10 + 1.0 * n + 0.01 * (-1) ** i for i, n in enumerate(N)])
    assert clean.ceiling_doubt is None
    lo, hi = clean.ceiling_ci_tok_s
    assert lo < clean.asymptote_tok_s < hi and hi / lo < 1.01
    line = fit_text(clean.to_dict(), fit_quality(clean.to_dict(), len(N)))
    assert "ceiling 1000/b = 1000.3 tok/s (95% CI [" in line and "fit reliable" in line
