"""No request stalls the others at the HTTP layer (issue 31):

- a request's CPU work (JSON decoding, validation, sampling parameters, the compilation of a
  structured-output schema) runs on worker threads: while one request's schema compiles,
  /health and other clients' requests, structured ones included, are answered;
- a request body must be complete within `--body-timeout` of its head, whatever the handler
  does with it: a body that trickles or stalls gets the 408 and its connection is closed, and
  a body still trickling after an early answer (401, 404) no longer holds the connection;
- a request with two Authorization headers is refused (400), whichever comes first.

The first test serves an in-process app with uvicorn in a thread (so that it can hold the
schema compilation on an Event); the others use a real `ragkv serve` process."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
from conftest import server_process

MODEL = "builtin:tiny"
KEY = "sk-robust-key"
BODY_TIMEOUT = 1.0
# Long enough that only the body deadline can explain a connection closed within seconds.
HEADER_TIMEOUT = 30.0

SLOW_SCHEMA = {"type": "object", "properties": {"slow_marker": {"type": "integer"}},
               "required": ["slow_marker"]}
OTHER_SCHEMA = {"type": "object", "properties": {"other": {"type": "boolean"}},
                "required": ["other"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _in_process_server(engines: list | None = None):
    """build_app over a real engine, served by uvicorn with serve.py's protocol in a thread;
    the AsyncEngine is appended to `engines` if given."""
    import uvicorn

    from ragkv.config import EngineConfig
    from ragkv.engine.engine import Engine
    from ragkv.server.app import ServerConfig, build_app
    from ragkv.server.async_engine import AsyncEngine
    from ragkv.server.metrics import Metrics
    from ragkv.server.serve import _timed_h11

    engine = Engine(EngineConfig(model=MODEL, max_model_len=2048))
    async_engine = AsyncEngine(engine)
    if engines is not None:
        engines.append(async_engine)
    app = build_app(async_engine, Metrics(MODEL, engine.chunk_store),
                    ServerConfig(model_name=MODEL))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", http=_timed_h11(10.0, 30.0)))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    async_engine.start()
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        async_engine.stop()
        engine.close()


def test_a_slow_schema_compilation_stalls_nobody(monkeypatch):
    """Regression: sampling parameters were built on the event loop, so compiling one large
    schema (8.9 s) held /health (4.6 s) and every other client. Here the compilation of one
    request's schema blocks on an Event: /health, a plain completion, a chat completion and a
    completion with another schema must all be answered while it is still blocked; it is
    released only afterwards, and its request then completes too."""
    from ragkv.structured import params as params_module

    original = params_module.byte_grammar
    entered, release = threading.Event(), threading.Event()
    seen: dict[str, object] = {"blocked": False}

    def byte_grammar(key: str):
        if "slow_marker" in key and not entered.is_set():
            seen["thread"] = threading.current_thread().name
            seen["blocked"] = True
            entered.set()
            # Bounded, so that a server compiling on its event loop fails the test below
            # instead of hanging it.
            seen["released"] = release.wait(timeout=20)
            seen["blocked"] = False
        return original(key)

    monkeypatch.setattr(params_module, "byte_grammar", byte_grammar)
    with _in_process_server() as base:
        slow: dict[str, httpx.Response] = {}

        def send_slow() -> None:
            slow["response"] = httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "A number:", "max_tokens": 8, "temperature": 0,
                "guided_json": SLOW_SCHEMA})

        sender = threading.Thread(target=send_slow)
        sender.start()
        try:
            assert entered.wait(timeout=60), "the slow schema was never compiled"
            answered = []
            assert httpx.get(f"{base}/health", timeout=60).status_code == 200
            answered.append(("health", seen["blocked"]))
            r = httpx.post(f"{base}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] > 0
            answered.append(("completion", seen["blocked"]))
            r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200, r.text
            answered.append(("chat", seen["blocked"]))
            r = httpx.post(f"{base}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "A flag:", "max_tokens": 8, "temperature": 0,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "o", "schema": OTHER_SCHEMA}}})
            assert r.status_code == 200, r.text
            answered.append(("other schema", seen["blocked"]))
            # A bad schema still gets its 400 while the slow one compiles.
            r = httpx.post(f"{base}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "x", "guided_json": {"type": "no-such-type"}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"
            answered.append(("bad schema", seen["blocked"]))
            assert sender.is_alive()  # the slow request is still waiting for its grammar
        finally:
            release.set()
            sender.join(timeout=120)
        assert answered == [(what, True) for what, _ in answered], answered
        assert seen["released"], "the compilation was never released: it blocked the server"
        assert str(seen["thread"]).startswith("ragkv-structured"), seen["thread"]
        assert slow["response"].status_code == 200, slow["response"].text
        assert slow["response"].json()["choices"][0]["text"].lstrip().startswith("{")


# --- the real server: body deadline and Authorization headers --------------------------------

def test_a_stopped_engine_is_answered_503_and_health_says_so():
    """Once the engine loop has stopped (it does so on an inconsistent state), /health turns
    503 so that a load balancer takes the replica out, and requests get a 503 naming why."""
    engines: list = []
    with _in_process_server(engines) as base:
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        engines[0].stop()
        assert httpx.get(f"{base}/health", timeout=30).status_code == 503
        r = httpx.post(f"{base}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("serve") / "server.log")
    with server_process(MODEL, "--max-model-len", "2048", "--header-timeout",
                        str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                        env={"RAGKV_API_KEY": KEY}, log_path=log) as (base, proc):
        yield base, log


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _head(path: str, *lines: str, length: int | None = 1000, key: str | None = KEY) -> bytes:
    headers = ["Host: x", "Content-Type: application/json", *lines]
    if key is not None:
        headers.append(f"Authorization: Bearer {key}")
    headers.append(f"Content-Length: {length}" if length is not None
                   else "Transfer-Encoding: chunked")
    return (f"POST {path} HTTP/1.1\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


def _trickle(sock: socket.socket, piece: bytes, seconds: float) -> tuple[bytes, bool]:
    """Send `piece` every 0.1 s for up to `seconds` while reading: (what came back, whether
    the server closed the connection in that time)."""
    sock.setblocking(False)
    got = b""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            # Read before sending: a reply that came with the close is taken before the next
            # send meets the closed connection (under load the two can land in one interval).
            try:
                data = sock.recv(65536)
                if not data:
                    return got, True
                got += data
            except BlockingIOError:
                pass
            except OSError:
                return got, True
            try:
                sock.sendall(piece)
            except OSError:  # closed by the server (a reset, a broken pipe)
                with contextlib.suppress(OSError):
                    got += sock.recv(65536)  # what it sent before closing, if still here
                return got, True
            time.sleep(0.1)
        return got, False
    finally:
        sock.close()


def _is_408(reply: bytes) -> bool:
    head, _, body = reply.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 408"):
        return False
    error = json.loads(body)["error"]
    return error["code"] == 408 and "request body not received within 1 s" in error["message"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_trickling_body_gets_408_and_is_closed(server, chunked):
    """Regression: partial bodies kept their connection open 12 s+. A body that never
    completes (a byte every 0.1 s) is answered 408 and its connection closed by the body
    deadline (1 s here; the header deadline is 30 s)."""
    base, _ = server
    sock = _connect(base)
    start = time.monotonic()
    sock.sendall(_head("/v1/completions", length=None if chunked else 100_000)
                 + (b"4000\r\n{" if chunked else b"{"))
    reply, closed = _trickle(sock, b" ", 15)
    assert closed and _is_408(reply), reply[:300]
    assert time.monotonic() - start < 10  # the body deadline, not the 30 s header deadline


def test_a_stalled_body_gets_408_and_is_closed(server):
    base, _ = server
    socks = [_connect(base) for _ in range(20)]
    for sock in socks:
        sock.sendall(_head("/v1/chat/completions") + b'{"model": ')
    for sock in socks:
        sock.settimeout(10)
        reply = b""
        with contextlib.suppress(ConnectionResetError):
            while part := sock.recv(65536):
                reply += part
        sock.close()  # recv returned b"": closed by the server
        assert _is_408(reply), reply[:300]
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200


@pytest.mark.parametrize("path,key,status", [("/v1/completions", None, 401),
                                             ("/v1/no-such-path", KEY, 404)])
def test_a_body_trickling_after_an_early_answer_does_not_hold_the_connection(
        server, path, key, status):
    """A request answered without reading its body (a 401 before routing, a 404) used to keep
    its connection while the body trickled; the body deadline closes it."""
    base, _ = server
    sock = _connect(base)
    sock.sendall(_head(path, key=key, length=100_000) + b"{")
    reply, closed = _trickle(sock, b" ", 15)
    assert reply.startswith(f"HTTP/1.1 {status}".encode()), reply[:300]
    assert closed


def test_complete_bodies_are_not_cut_by_the_body_deadline(server):
    """The deadline covers the body only: a keep-alive connection idle for longer than it
    between two requests, and a response streamed for longer than it, are untouched."""
    base, _ = server
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        time.sleep(BODY_TIMEOUT * 2)  # under --timeout-keep-alive (5 s): the same connection
        assert client.post("/v1/completions", json=body).status_code == 200
        # A stream that runs past the deadline: 2,000 tokens (the server's --max-model-len is
        # 2048), about 1.5 s on 2 cores with nothing else running (1,000 took 0.8 s).
        stream = {**body, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        start = time.monotonic()
        with client.stream("POST", "/v1/completions", json=stream) as response:
            assert response.status_code == 200
            text = "".join(response.iter_text())
        assert time.monotonic() - start > BODY_TIMEOUT, "the stream ended before the deadline"
        assert '"finish_reason": "length"' in text and text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("first,second", [("wrong", KEY), (KEY, "wrong"), (KEY, KEY)])
def test_two_authorization_headers_are_refused(server, first, second):
    """Regression: `Authorization: wrong` then `Authorization: right` was accepted (the last
    won), where a proxy checking the first would disagree. Any two are refused."""
    base, _ = server
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    sock = _connect(base)
    sock.sendall(_head("/v1/completions", f"Authorization: Bearer {first}", key=second,
                       length=len(body)) + body)
    sock.settimeout(10)
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        part = sock.recv(65536)
        if not part:
            break
        reply += part
    sock.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply[:300]
    error = json.loads(payload)["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert "2 Authorization headers" in error["message"]
    # One header is fine.
    r = httpx.post(f"{base}/v1/completions", content=body, timeout=60, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_no_tracebacks_in_the_server_log(server):
    base, log = server
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    with open(log) as f:
        text = f.read()
    assert "Traceback" not in text and "Exception" not in text, text[-3000:]
