"""The Redis tier of the chunk store (tier.py states the rules every tier keeps)."""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse

from .format import ChunkMeta, ChunkRecord, decode, encode
from .tier import ChunkStore

logger = logging.getLogger("ragkv")


class RedisChunkStore(ChunkStore):
    """Entries as Redis values under `ragkv:chunk:<key>`, written with SET NX (write-once).

    Every call has a timeout (`socket_timeout`, default 1 s; the URL's query may set it). A
    failure marks the tier down for `retry_seconds`, doubling with each failed retry up to
    MAX_RETRY_SECONDS: meanwhile it answers as a miss without trying (and skips writes), so a
    dead or hung Redis costs the engine one timeout per retry, not one per chunk; a success
    logs the reconnection. A command Redis refuses (out of memory under
    `noeviction`, a value over its size limit) is a failed call, not an outage: counted, logged
    once per kind of refusal, and the tier stays up for reads."""

    name = "redis"
    prefix = "ragkv:chunk:"
    max_value_bytes = 512 * 1024 * 1024  # Redis' default proto-max-bulk-len
    MAX_RETRY_SECONDS = 60.0

    def __init__(self, url: str, timeout_seconds: float = 1.0,
                 retry_seconds: float = 2.0) -> None:
        super().__init__()
        try:
            import redis
        except ImportError as e:
            raise ValueError("chunk_store: a redis:// tier needs the redis package "
                             "(pip install 'ragkv[redis]')") from e
        self.url = url
        self.retry_seconds = retry_seconds
        self._error_types = (redis.RedisError, OSError)
        self._refusal_type = redis.ResponseError
        self._refusals_logged: set[str] = set()
        db = urllib.parse.urlsplit(url).path.strip("/")
        if url.startswith(("redis://", "rediss://")) and db and not db.isdigit():
            raise ValueError(f"chunk_store: Redis URL {url!r}: the database must be a number "
                             "(redis://HOST:PORT/DB)")
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout_seconds,
                                               socket_connect_timeout=timeout_seconds)
        except (ValueError, redis.RedisError) as e:
            raise ValueError(f"chunk_store: bad Redis URL {url!r}: {e}") from e
        if self.client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError(f"chunk_store: Redis URL {url!r}: decode_responses must be off "
                             "(entries are bytes)")
        self.available = True
        self._down_until = 0.0
        self._failures = 0  # consecutive failed calls: the retry interval doubles with each
        # Calls come from the engine, the writer and the loader threads: the outage state
        # changes under a lock (the network call itself runs outside it).
        self._state = threading.Lock()

    def _call(self, method: str, *args, **kwargs):
        """The client's answer, or None while the tier is down (errors counted, logged once
        per outage)."""
        if self._resting():
            return None
        try:
            result = getattr(self.client, method)(*args, **kwargs)
        except self._refusal_type as e:
            self._count(errors=1)
            kind = str(e).split(" ", 1)[0]
            with self._state:
                first = kind not in self._refusals_logged
                self._refusals_logged.add(kind)
            if first:
                logger.warning("chunk store: Redis at %s refused %s (%s); the chunk stays "
                               "local", self.url, method.upper(), e)
            return None
        except self._error_types as e:
            self._count(errors=1)
            with self._state:
                was_up, self.available = self.available, False
                self._failures += 1
                pause = min(self.retry_seconds * 2 ** (self._failures - 1),
                            self.MAX_RETRY_SECONDS)
                self._down_until = time.monotonic() + pause
            if was_up:
                logger.warning("chunk store: Redis at %s unavailable (%s); computing chunks "
                               "locally, retrying every %.0f s", self.url, e,
                               self.retry_seconds)
            return None
        with self._state:
            was_down, self.available = not self.available, True
            self._failures = 0
        if was_down:
            logger.warning("chunk store: Redis at %s is back", self.url)
        return result

    def _resting(self) -> bool:
        """Down, and not yet time to try again."""
        return not self.available and time.monotonic() < self._down_until

    def get(self, key: str, expect: ChunkMeta) -> ChunkRecord | None:
        start = time.perf_counter()
        data = self._call("get", self.prefix + key)
        if data is None:
            self._count(misses=1)
            return None
        record = decode(data, expect)
        self._count_load(time.perf_counter() - start, len(data))
        return record

    def put(self, record: ChunkRecord) -> bool:
        if self._resting():
            return False  # no encoding for a Redis that is down
        data = encode(record)
        if len(data) > self.max_value_bytes:
            # Redis drops the connection on a value over proto-max-bulk-len (512 MiB by
            # default): refuse it here instead of taking the tier down.
            self._count(errors=1)
            if "too-large" not in self._refusals_logged:
                self._refusals_logged.add("too-large")
                logger.warning("chunk store: a %d-byte entry exceeds Redis' value limit of %d "
                               "bytes; such chunks stay local (smaller max_chunk_tokens, or "
                               "raise proto-max-bulk-len and max_value_bytes)", len(data),
                               self.max_value_bytes)
            return False
        if not self._call("set", self.prefix + record.meta.key, data, nx=True):
            return False
        self._count(writes=1, bytes_written=len(data))
        return True

    def contains(self, key: str) -> bool:
        return bool(self._call("exists", self.prefix + key))

    def delete(self, key: str) -> None:
        self._call("delete", self.prefix + key)

    def close(self) -> None:
        self.client.close()

    def _usage(self) -> tuple[int, int, int, bool]:
        return -1, self.bytes_written, 0, self.available
