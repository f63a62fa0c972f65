"""The server's edge, through real clients and raw sockets: API key, HF-folder served name, body and head
bounds, read timeouts and the connection bound; every refusal counted in request_errors_total."""

from __future__ import annotations

import argparse
import json
import socket
import time

import httpx
import openai
import pytest
from server_utils import ServerProcess, metrics

from graphserve.models.builtin import ensure_builtin
from graphserve.server.guards import MAX_HEAD_BYTES
from graphserve.server.serve_args import guard_options

KEY = "sk-test-0123456789"
READ_TIMEOUT_S = 1.5
MAX_CONNECTIONS = 6


@pytest.fixture(scope="module")
def folder():
    return str(ensure_builtin("tiny-llama"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, folder):
    # An HF folder with no --served-model-name, and the key from vLLM's environment variable.
    srv = ServerProcess(tmp_path_factory.mktemp("guards"), "--max-request-body-mb", "1",
                        "--request-read-timeout", str(READ_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
                        env={"VLLM_API_KEY": KEY}, model=folder).start()
    yield srv
    srv.stop()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def raw_exchange(server, data: bytes, wait_s: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_key_required_except_for_health_and_metrics(server, folder):
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.completions.create(model=folder, prompt="x", max_tokens=1)
    assert exc.value.status_code == 401 and exc.value.body["type"] == "authentication_error"
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    assert httpx.post(server.base_url + "/generate", json={"text": "x"}).status_code == 401
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200
    good = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=folder, prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_api_key_flag_wins_over_the_environment(monkeypatch):
    ns = argparse.Namespace(api_key=None, max_request_body_mb=32.0, request_read_timeout=30.0, max_connections=10)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("GRAPHSERVE_API_KEY", "from-env")
    assert guard_options(ns).api_key == "from-env"
    ns.api_key = "from-flag"
    assert guard_options(ns).api_key == "from-flag"


def test_hf_folder_is_the_default_served_name_and_tokenizer_path(server, folder):
    from transformers import AutoTokenizer

    cards = httpx.get(server.base_url + "/v1/models", headers=auth()).json()["data"]
    assert cards[0]["id"] == folder
    # guidellm loads the tokenizer from the served name; SGLang's bench from tokenizer_path
    assert AutoTokenizer.from_pretrained(cards[0]["id"]).vocab_size > 0
    info = httpx.get(server.base_url + "/get_model_info", headers=auth()).json()
    assert info["tokenizer_path"] == folder


def test_body_above_the_bound_is_413(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\n")
    status, err = status_and_error(raw_exchange(server, head + b"Content-Length: 2097152\r\n\r\n"))
    assert status == 413 and "--max-request-body-mb" in err["message"]
    # chunked: no Content-Length to check up front, refused once the bytes read pass the bound
    chunk = b"%x\r\n%s\r\n" % (256 * 1024, b" " * 256 * 1024)
    status, err = status_and_error(raw_exchange(server, head + b"Transfer-Encoding: chunked\r\n\r\n" + chunk * 5))
    assert status == 413, err


def test_stalled_body_and_head_are_closed_with_408(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    t0 = time.monotonic()
    status, err = status_and_error(raw_exchange(server, head))
    assert status == 408 and "body" in err["message"] and time.monotonic() - t0 < READ_TIMEOUT_S + 3
    t0 = time.monotonic()
    status, err = status_and_error(raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"))
    assert status == 408 and "head" in err["message"] and time.monotonic() - t0 < READ_TIMEOUT_S + 3
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # sends nothing at all
        assert sock.recv(65536).startswith(b"HTTP/1.1 408")


def test_head_over_100kb_is_431(server):
    big = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\n\r\n"
    status, _ = status_and_error(raw_exchange(server, big))
    assert status == 431
    # large but under the bound, sent in pieces so the parser holds it incomplete for a while
    head = (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nX-Filler: " + b"a" * 60_000 + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        for i in range(0, len(head), 4096):
            sock.sendall(head[i:i + 4096])
            time.sleep(0.005)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_connections_past_the_bound_get_503(server):
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        status, err = status_and_error(raw_exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 503 and f"--max-connections={MAX_CONNECTIONS}" in err["message"]
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_refusals_are_counted(server):
    m = metrics(server.base_url)
    for code, reason in ((401, "authentication_error"), (413, "request_too_large"), (408, "request_timeout"),
                         (431, "request_header_fields_too_large"), (503, "service_unavailable")):
        assert m.get(f"graphserve:request_errors_total{{code={code},reason={reason}}}", 0) >= 1, (code, m)
    assert "request error: status=401 reason=authentication_error" in server.log()


def test_dummy_source_tokenizer_is_saved_where_clients_can_load_it():
    # A dummy: preset's tokenizer is synthetic; /get_model_info points clients at a saved copy. (Serving a
    # dummy preset on CPU would take minutes, so this checks the path helper with the tokenizer it serves.)
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from graphserve.models.loader import load_tokenizer
    from graphserve.server.model_info import tokenizer_path

    tok = load_tokenizer("dummy:qwen2.5-0.5b")
    state = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(model="dummy:qwen2.5-0.5b"), tokenizer=tok))
    path = tokenizer_path(state)
    assert tokenizer_path(state) == path  # saved once, then reused
    loaded = AutoTokenizer.from_pretrained(path)
    text = "Hello, world: ünïcode and numbers 12345"
    assert loaded(text).input_ids == tok(text).input_ids
    # graphserve bench --tokenizer takes the same folder (it holds no config.json)
    assert load_tokenizer(path)(text).input_ids == tok(text).input_ids
