"""`ragkv serve`: build the engine, wrap it in the async loop and the HTTP app, run uvicorn."""

from __future__ import annotations

import gc
import json
import logging
import os
from dataclasses import replace

from ..config import EngineConfig
from ..engine.engine import Engine
from .app import ServerConfig, body_timeout_message, build_app
from .async_engine import AsyncEngine
from .metrics import Metrics
from .protocol import ErrorResponse

logger = logging.getLogger("ragkv.server")


def serve(config: EngineConfig, server: ServerConfig, host: str = "127.0.0.1",
          port: int = 8000, log_level: str = "info", header_timeout_s: float = 10.0,
          timeout_keep_alive_s: int = 5, limit_concurrency: int | None = 1024) -> None:
    """Serve until interrupted. `server.model_name` empty means the model as given; the API
    key falls back to $RAGKV_API_KEY. A connection that has not sent a complete request head
    within `header_timeout_s` (idle, or trickling headers) is closed; a request whose body is
    not complete within `server.body_timeout_s` of its head is answered 408 and its connection
    closed (see `_timed_h11`)."""
    import uvicorn

    server = replace(server, model_name=server.model_name or config.model,
                     api_key=server.api_key or os.environ.get("RAGKV_API_KEY") or None)
    engine = Engine(config)
    metrics = Metrics(server.model_name, engine.chunk_store, server.vllm_metric_names)
    http: list = []  # the uvicorn server, once built

    def stop_serving(error: BaseException) -> None:
        # The engine cannot go on (a tensor-parallel rank died, or its state is
        # inconsistent: EngineDeadError): requests in flight and queued
        # get a 503 (and /health), the server stops taking connections, lets open ones finish
        # for up to 10 s, and the process ends with a non-zero status so a supervisor
        # restarts it.
        if http:
            http[0].should_exit = True

    async_engine = AsyncEngine(engine, on_step=metrics.on_step, on_fatal=stop_serving)
    app = build_app(async_engine, metrics, server)
    # What start-up built (the model, the tokenizer, the caches: 233,000 objects with
    # SmolLM2) lives as long as the server: out of the collector's sight, a full collection
    # on the engine thread takes under 1 ms instead of 115.
    gc.collect()
    gc.freeze()
    async_engine.start()
    logger.info("serving %s on http://%s:%d (max_model_len=%d)", server.model_name, host, port,
                engine.max_model_len)
    # uvicorn.run's own steps, keeping the Server so that stop_serving can end it.
    http.append(uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        http=_timed_h11(header_timeout_s, server.body_timeout_s),
        timeout_keep_alive=timeout_keep_alive_s, limit_concurrency=limit_concurrency,
        timeout_graceful_shutdown=10)))
    try:
        http[0].run()
    except KeyboardInterrupt:
        pass
    finally:
        async_engine.stop()
        engine.close()  # pending chunk-store writes land before the process exits
        gc.unfreeze()  # so that they are freed at exit (nanobind reports those that are not)
    if async_engine.fatal is not None:
        raise SystemExit(f"ragkv serve: stopped: the engine cannot go on "
                         f"({async_engine.fatal})")
    if not http[0].started:
        raise SystemExit(3)  # uvicorn's start-up failure (the port is taken, say)


def _timed_h11(header_timeout_s: float, body_timeout_s: float | None = None):
    """uvicorn's h11 protocol with a deadline for each request head and for each request body:
    uvicorn itself waits forever for the first request of a connection, for headers sent a
    byte at a time, and for a body that trickles or stalls.

    The body deadline runs from the end of the head to the end of the body, whatever the
    handler does with it (the app's own 408 only covers the handlers that read the body, from
    when they start). When it passes, a request not yet answered gets the app's 408 from here
    (its handler then sees a disconnected client); one already answered (a 401, 404 or 415
    sent without reading the body) just has its connection closed. So no request takes more
    than `header_timeout_s + body_timeout_s` to read."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _head_timer = None
        _body_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # waiting for the next request on this connection

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request head arrived
                self._disarm()
                self._disarm_body()
                if body_timeout_s is not None and self.conn.their_state is h11.SEND_BODY:
                    self._body_timer = self.loop.call_later(body_timeout_s, self._body_expired)
            elif self.conn.their_state is not h11.SEND_BODY:  # the body is complete
                self._disarm_body()

        def connection_lost(self, exc) -> None:
            self._disarm()
            self._disarm_body()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if self.cycle is None or self.cycle.response_complete:
                self._head_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _disarm_body(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _expire(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def _body_expired(self) -> None:
            self._body_timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if (cycle is not None and not cycle.response_started
                    and self.conn.our_state is h11.SEND_RESPONSE):
                self._send_408()
                # The handler, if still reading, now sees a client that left: it answers
                # nothing more (uvicorn drops what a disconnected cycle sends).
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

        def _send_408(self) -> None:
            body = json.dumps(ErrorResponse(408, body_timeout_message(body_timeout_s)).body())
            data = body.encode()
            headers = [*self.server_state.default_headers,
                       (b"content-type", b"application/json"),
                       (b"content-length", str(len(data)).encode()),
                       (b"connection", b"close")]
            try:
                out = self.conn.send(h11.Response(status_code=408, headers=headers,
                                                  reason=b"Request Timeout"))
                out += self.conn.send(h11.Data(data=data))
                out += self.conn.send(h11.EndOfMessage())
            except h11.LocalProtocolError:
                return
            self.transport.write(out)

    return TimedH11Protocol
