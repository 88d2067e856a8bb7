"""Connection-level limits of `ragkv serve` (issue 8): idle and slow clients are closed, a body
that does not arrive in time is a 408, a client that drops mid-body leaves no traceback, and a
non-streaming request whose client left does not keep the server from shutting down. Uses a
server of its own with short timeouts and its log in a file."""

from __future__ import annotations

import contextlib
import signal
import socket
import time

import httpx
import pytest
from conftest import server_process

MODEL = "builtin:tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("serve") / "server.log")
    with server_process(MODEL, "--max-model-len", "2048", "--header-timeout", "1",
                        "--body-timeout", "1", log_path=log) as (base, proc):
        yield base, proc, log


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (reads EOF or a reset) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _read_response(sock: socket.socket) -> str:
    """One whole HTTP response: headers and body may arrive in separate packets."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            return data.decode()
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        part = sock.recv(65536)
        if not part:
            break
        body += part
    return (head + b"\r\n\r\n" + body).decode()


def test_idle_and_slowloris_connections_are_closed(server):
    """Regression: 200 idle and 100 slowloris connections were held open forever."""
    base, _, _ = server
    idle = [_connect(base) for _ in range(20)]
    slow = [_connect(base) for _ in range(5)]
    for sock in slow:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:  # a header line now and then, never the blank line
        for sock in slow:
            with contextlib.suppress(OSError):  # closed by the server already
                sock.sendall(b"X-Slow: 1\r\n")
        time.sleep(0.3)
    for sock in idle + slow:
        assert _closed_within(sock, 5)
        sock.close()
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200


def test_body_that_does_not_arrive_in_time_is_a_408(server):
    base, _, _ = server
    sock = _connect(base)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 100\r\n\r\n{\"model\": ")
    reply = _read_response(sock)
    sock.close()
    assert reply.startswith("HTTP/1.1 408") and "request body not received" in reply


def test_client_dropping_mid_body_leaves_no_traceback(server):
    """Regression: every client that dropped mid-body logged a ClientDisconnect traceback."""
    base, _, log = server
    for _ in range(3):
        sock = _connect(base)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 5000\r\n\r\n{\"model\": \"x\"")
        time.sleep(0.2)
        sock.close()
    time.sleep(0.5)
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    with open(log) as f:
        text = f.read()
    assert "Traceback" not in text and "ClientDisconnect" not in text


def test_shutdown_after_a_non_streaming_client_left(server):
    """Regression: a non-streaming request whose client disconnected left its handler
    suspended forever (the abort never woke it), and graceful shutdown then blocked. Runs
    last: it stops the module's server."""
    base, proc, log = server
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base}/v1/completions", timeout=1.0, json={
            "model": MODEL, "prompt": "A long story:", "max_tokens": 1500, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while True:  # the disconnect is noticed within a fraction of a second
        report = httpx.get(f"{base}/debug/integrity", timeout=10).json()
        if report["num_running"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert report["ok"] and report["num_running"] == 0
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=20)
    with open(log) as f:
        assert "Traceback" not in f.read()
