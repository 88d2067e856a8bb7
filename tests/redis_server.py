"""A private `redis-server` for benchmarks and tests of the chunk store's Redis tier: a free
loopback port, no persistence (entries are recomputable; snapshots would only add disk writes
to the timings)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time


class RedisServer:
    """`start()` runs redis-server on this handle's port and waits until it answers; `stop()`
    kills it; a later `start()` brings it back on the same port, empty."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def find() -> str | None:
        """The redis-server binary, if it and the redis client package are installed."""
        try:
            import redis  # noqa: F401 (the tier needs the client too)
        except ImportError:
            return None
        return shutil.which("redis-server")

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 20
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.RedisError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError("redis-server did not come up") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
