"""DeepSeek-V4's latent pages, seen from outside a real server on loopback: /metrics gauges the pages running
windows hold, those idle with cached prefixes and the usable ones, and they move as a request runs and ends; the
JSONL step records and the step log lines carry the same counts. A model without latent pages exports none of it
(tests/server/test_server_api.py's server: the metric names are absent there)."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from server_utils import ServerProcess, metrics, stream_until_first_event, wait_for
from test_deepseek_v4 import _checkpoint, _config

USABLE_PAGES = 2 * (4 * 4 + 4)  # --max-running-requests 4 windows of 8 at blocks of 4, a 16-token chunk, twice


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4pages")
    _checkpoint(folder, _config())
    logs = tmp_path_factory.mktemp("v4pages_logs")
    srv = ServerProcess(logs, "--dtype", "float32", "--block-size", "4", "--chunked-prefill-size", "16",
                        "--max-running-requests", "4", "--step-log", str(logs / "steps.jsonl"), model=str(folder))
    srv.steps = logs / "steps.jsonl"
    yield srv.start(timeout=180)
    srv.stop()


def _pages(url: str) -> tuple[float, float, float]:
    m = metrics(url)
    return m["graphserve:latent_pages_used"], m["graphserve:latent_pages_idle"], m["graphserve:latent_pages_total"]


def test_page_gauges_move_with_a_running_request_and_step_records_carry_them(server):
    url = server.base_url
    used, _, total = _pages(url)
    assert (used, total) == (0, USABLE_PAGES)
    assert metrics(url)["graphserve:num_preemptions_latent_pages_total"] == 0
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": list(range(10, 50)), "max_tokens": 120, "ignore_eos": True,
            "temperature": 0.0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started: concurrent.futures.Future = concurrent.futures.Future()
        done = pool.submit(stream_until_first_event, url, body, started)
        started.result(timeout=60)
        # running: its window holds 2 or 3 pages decoding (8 positions across blocks of 4), up to 7 prefilling a
        # chunk of 16 behind it
        held = wait_for(lambda: _pages(url)[0] > 0 and _pages(url))
        assert held and 2 <= held[0] <= 7 and held[2] == USABLE_PAGES
        events = done.result(timeout=120)
    assert events[-1] == "[DONE]"
    # ended: no window holds a page; its cached blocks' pages idle for a prefix hit
    after = wait_for(lambda: _pages(url)[0] == 0 and _pages(url)[1] > 0 and _pages(url))
    assert after and after[1] <= USABLE_PAGES
    records = wait_for(lambda: [r for r in map(json.loads, server.steps.read_text().splitlines())
                                if r["latent_pages_used"] > 0])  # fmt: skip
    assert records and all(r["latent_pages_total"] == USABLE_PAGES and r["preempted_for_pages"] == 0
                           for r in records)  # fmt: skip
    decodes = [r["latent_pages_used"] for r in records if r["decode_tokens"]]
    assert len(decodes) >= 30 and set(decodes) <= {2, 3}
    lines = wait_for(lambda: [ln for ln in server.log().splitlines() if "Decode batch" in ln])
    assert lines and all("latent page usage: " in ln and "#latent-page: " in ln for ln in lines)
