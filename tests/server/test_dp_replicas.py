"""`graphserve serve --dp 2`: two engine replicas behind one HTTP front-end give the tokens one engine gives, a
repeated prefix goes to the replica holding it, the metrics and the step log name the replica, a replica that dies
fails only its own requests while the other serves on; and the splits that cannot run are refused at start."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import random
import signal
from types import SimpleNamespace

import httpx
import pytest
from server_utils import MODEL, SMALL_ENGINE, ServerProcess, engine_processes, metrics, stream_until_first_event

from graphserve.config import EngineConfig
from graphserve.engine.kv_cache import CLEARED, REMOVED, STORED
from graphserve.engine.routing_policy import block_hashes
from graphserve.errors import ConfigError, ServiceUnavailableError
from graphserve.models.parallel_check import check_gpu_count
from graphserve.server.launch import ENGINE_DIED_EXIT_CODE
from graphserve.server.replicas import ReplicaSet, replica_configs, replica_of

BLOCK = 16


def _routed(base_url: str) -> dict[tuple[str, str], float]:
    """(replica, route) -> requests routed so far."""
    out = {}
    for key, value in metrics(base_url).items():
        if key.startswith("graphserve:replica_requests_total{"):
            labels = dict(kv.split("=") for kv in key[key.index("{") + 1:-1].split(","))
            out[(labels["replica"], labels["route"])] = value
    return out


def _generate(base_url: str, ids: list[int], n: int = 1) -> list[list[int]]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "n": n}}
    resp = httpx.post(base_url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    items = resp.json()
    items = items if isinstance(items, list) else [items]
    return [item["output_ids"] for item in items]


def test_dp2_serves_routes_by_prefix_labels_replicas_and_survives_one_death(tmp_path):
    rng = random.Random(56)
    prompts = [[rng.randrange(5, 1300) for _ in range(rng.randrange(20, 40))] for _ in range(4)]
    step_log = tmp_path / "steps.jsonl"
    srv = ServerProcess(tmp_path, "--dp", "2", "--step-log", str(step_log), "--engine-death-grace", "1")
    srv.start(timeout=300)
    try:
        engines = engine_processes(srv)
        assert len(engines) == 2, "--dp 2: one engine process per replica"

        # The same greedy tokens as one engine: requests one at a time, spread over both replicas by load.
        got = [_generate(srv.base_url, p)[0] for p in prompts]
        routed = _routed(srv.base_url)
        assert routed[("0", "load")] == 2 and routed[("1", "load")] == 2, routed
        from graphserve import LLM, SamplingParams

        llm = LLM(MODEL, max_model_len=512, num_kv_tokens=8192)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        want = [llm.generate(p, params, use_tqdm=False)[0].token_ids for p in prompts]
        assert got == want

        # A prompt of 4 full blocks, then three that extend it: all three go to the replica that cached it.
        shared = [rng.randrange(5, 1300) for _ in range(4 * BLOCK)]
        before = _routed(srv.base_url)
        _generate(srv.base_url, shared + [7])
        after = _routed(srv.base_url)
        holder = next(r for r in ("0", "1") if after[(r, "load")] > before[(r, "load")])
        for tail in ([11, 12], [13, 14, 15], [16]):
            _generate(srv.base_url, shared + tail)
        siblings = _generate(srv.base_url, shared + [17], n=2)  # n > 1: both sequences on the holder
        assert siblings[0] == siblings[1]
        final = _routed(srv.base_url)
        assert final[(holder, "prefix")] - after[(holder, "prefix")] == 4, final
        other = "1" if holder == "0" else "0"
        assert final[(other, "prefix")] == after[(other, "prefix")]
        # --dp records the replicas' cache events without --kv-events: /v1/cache_events serves their union
        events = httpx.get(srv.base_url + "/v1/cache_events", params={"since": -1, "timeout": 0}, timeout=30)
        assert events.status_code == 200, events.text
        assert set(block_hashes(shared + [7], BLOCK)) <= set(events.json()["snapshot"])

        # The engine metrics, the step records and the step log name the replica.
        m = metrics(srv.base_url)
        for r in ("0", "1"):
            assert m[f"graphserve:engine_alive{{replica={r}}}"] == 1.0
            assert m[f"graphserve:generation_tokens_total{{replica={r}}}"] > 0
        assert m[f"graphserve:decode_steps_total{{graph=false,replica={holder}}}"] > 0
        records = [json.loads(line) for line in step_log.read_text().splitlines()]
        assert {rec["replica"] for rec in records} == {0, 1}
        assert "DP0 Decode batch" in srv.log() and "DP1 Decode batch" in srv.log()
        tel = httpx.get(srv.base_url + "/v1/telemetry", params={"replica": 1}, timeout=30).json()
        assert tel["records"] and {rec["replica"] for rec in tel["records"]} == {1}
        assert httpx.get(srv.base_url + "/v1/telemetry", params={"replica": 2}, timeout=30).status_code == 404

        # A replica dies with a stream in flight on each: only its own fails, the other finishes, and the server
        # serves on with /health 200 until the last replica is gone.
        body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            starts = [concurrent.futures.Future(), concurrent.futures.Future()]
            streams = [pool.submit(stream_until_first_event, srv.base_url, {**body, "prompt": p}, s)
                       for p, s in zip(prompts[:2], starts)]
            for s in starts:
                s.result(timeout=120)
            engines[0].send_signal(signal.SIGKILL)
            results = [s.result(timeout=120) for s in streams]
        errors = [json.loads(ev[-2])["error"] for ev in results if "error" in ev[-2]]
        assert len(errors) == 1, results
        assert "replica" in errors[0]["message"] and "engine process died" in errors[0]["message"]
        dead = errors[0]["message"].split("replica ")[1].split(":")[0]
        finished = next(ev for ev in results if "error" not in ev[-2])
        assert finished[-1] == "[DONE]" and json.loads(finished[-2])["choices"][0]["finish_reason"] == "length"
        assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
        assert _generate(srv.base_url, prompts[2])[0] == want[2]
        m = metrics(srv.base_url)
        assert m[f"graphserve:engine_alive{{replica={dead}}}"] == 0.0
        assert f"replica {dead}: its engine process died" in srv.log()

        engines[1].send_signal(signal.SIGKILL)
        assert srv.wait(60) == ENGINE_DIED_EXIT_CODE
        assert "every replica's engine died" in srv.log()
    finally:
        srv.stop()


def test_dp_refuses_splits_that_cannot_run():
    with pytest.raises(ConfigError, match=r"--dp=0 is invalid"):
        EngineConfig(dp=0)
    cfg = EngineConfig(dp=2, tp=2, device="cuda")
    with pytest.raises(ConfigError) as err:
        check_gpu_count(cfg, visible=2)
    assert "--dp=2" in err.value.message and "--tp=2" in err.value.message
    assert "4 GPUs" in err.value.message and "2 GPU(s) are visible" in err.value.message
    check_gpu_count(cfg, visible=4)
    with pytest.raises(ConfigError, match=r"6 GPUs from cuda:1, but 6 GPU"):
        check_gpu_count(EngineConfig(dp=3, tp=2, device="cuda:1"), visible=6)


@pytest.mark.parametrize("flags, words", [
    (["--dp", "2", "--tp", "2", "--device", "cuda:7"], ["--dp=2", "--tp=2", "4 GPUs from cuda:7"]),
    (["--dp", "2", "--api-server-count", "2"], ["--api-server-count=2", "--dp=2"]),
])
def test_serve_refuses_dp_at_start(flags, words, capsys):
    """`graphserve serve` exits 2 before it binds a port or starts an engine (in-process: a refusal needs neither)."""
    from graphserve.cli import main

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        code = main(["serve", MODEL, "--port", "1", *SMALL_ENGINE, *flags])
    finally:  # serve sets up the root logger for the process it owns; this process is pytest's
        root.handlers[:] = handlers
        root.setLevel(level)
    assert code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err


def test_replica_configs_and_ids():
    gpus = replica_configs(EngineConfig(dp=2, tp=2, device="cuda:2"))
    assert [c.device for c in gpus] == ["cuda:2", "cuda:4"] and {c.dp for c in gpus} == {1}
    assert [c.device for c in replica_configs(EngineConfig(dp=3, device="cpu"))] == ["cpu"] * 3
    assert replica_of("my#rid#r1.17") == 1 and replica_of("rid#0.3") is None


def test_union_of_replica_cache_events():
    """/v1/cache_events of a --dp server: a hash is in while any replica holds it."""
    replicas = ReplicaSet(EngineConfig(dp=2, device="cpu"))
    assert replicas.config.kv_events and all(f.config.kv_events for f in replicas.replicas)  # on without the flag
    replicas._on_cache_events(0, [(STORED, 11, 0), (STORED, 12, 11)])
    replicas._on_cache_events(1, [(STORED, 11, 0), (STORED, 13, 11)])
    assert replicas.cache_events.cached == {11, 12, 13}
    assert replicas.policy.indexes[1].hashes == {11, 13}
    replicas._on_cache_events(0, [(REMOVED, 11)])
    assert replicas.cache_events.cached == {11, 12, 13}
    replicas._on_cache_events(1, [(CLEARED,)])
    assert replicas.cache_events.cached == {12}
    assert replicas.policy.indexes[0].hashes == {12} and not replicas.policy.indexes[1].hashes


def test_profile_asks_the_replicas_with_load():
    """POST /v1/profile on a --dp server: replicas with requests in flight profile at once; an idle one is not
    asked (it would only run out the timeout), and one that fails is reported beside the others' profiles."""
    calls: list[int] = []

    def fake(r: int, inflight: int, fail: bool = False) -> SimpleNamespace:
        async def profile(steps: int, timeout_s: float) -> dict:
            calls.append(r)
            if fail:
                raise ServiceUnavailableError(f"replica {r} ran no step", retry_after=1)
            return {"phases": [{"mode": "eager", "step_ms": 1.0 + r}], "steps": steps}

        return SimpleNamespace(alive=True, num_inflight=inflight, profiles=SimpleNamespace(profile=profile))

    replicas = ReplicaSet(EngineConfig(dp=2, device="cpu"))
    replicas.replicas = [fake(0, 0), fake(1, 3)]
    out = asyncio.run(replicas.profiles.profile(2, 5.0))
    assert calls == [1] and out["replica"] == 1 and list(out["replicas"]) == ["1"]
    calls.clear()
    replicas.replicas = [fake(0, 2, fail=True), fake(1, 3)]
    out = asyncio.run(replicas.profiles.profile(2, 5.0))
    assert sorted(calls) == [0, 1] and out["replica"] == 1 and out["phases"][0]["step_ms"] == 2.0
    assert "ran no step" in out["replicas"]["0"]["error"]
    replicas.replicas = [fake(0, 2, fail=True), fake(1, 0, fail=True)]
    with pytest.raises(ServiceUnavailableError, match="replica 0 ran no step"):
        asyncio.run(replicas.profiles.profile(2, 5.0))
