"""AsyncEngine: the engine loop in a thread of its own, driven from asyncio.

The engine is single-threaded by design. One background thread owns it: it takes commands
(add, abort, call) from a queue, runs `step()` while there is work, and hands each request's
outputs to that request's asyncio queue. HTTP handlers never touch the engine directly, so the
server schedules exactly as the offline API does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ..engine.engine import Engine
from ..outputs import RequestOutput
from ..sampling import SamplingParams

logger = logging.getLogger("ragkv.server")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: Callable[[Engine, list[RequestOutput]], None]
                 | None = None) -> None:
        self.engine = engine
        self._on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ragkv-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    async def submit(self, prompt: object, params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request; returns the iterator of its (cumulative) outputs.

        Raises ValueError if the engine rejects the request. If the consumer stops iterating
        early (a client disconnects), the request is aborted and its slots come back; a
        caller that never iterates must `abort` it.
        """
        loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(loop, asyncio.Queue())
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("add", request_id, prompt, params, stream, accepted))
        await asyncio.wrap_future(accepted)
        return self._outputs(request_id, stream)

    async def generate(self, prompt: object, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        async for out in await self.submit(prompt, params, request_id):
            yield out

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], object]) -> object:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, done))
        return await asyncio.wrap_future(done)

    def _put(self, command: tuple) -> None:
        if self._stopped or not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")
        self._inbox.put(command)
        self._wake.set()

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            if self._drain() and self._on_step is not None:
                self._on_step(engine, [])  # aborts change the gauges without a step
            if not engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = engine.step(include_unfinished=True)
            except Exception as e:  # a bug, not bad input: fail what is running, keep serving
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if self._on_step is not None:
                self._on_step(engine, outputs)

    def _drain(self) -> int:
        """Carry out queued commands; returns how many there were."""
        count = 0
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return count
            count += 1
            kind = command[0]
            if kind == "add":
                _, request_id, prompt, params, stream, accepted = command
                try:
                    self.engine.add_request(prompt, params, request_id=request_id)
                except Exception as e:  # noqa: BLE001 (reported to the caller)
                    accepted.set_exception(e)
                    continue
                self._streams[request_id] = stream
                accepted.set_result(None)
            elif kind == "abort":
                request_id = command[1]
                self._streams.pop(request_id, None)
                self.engine.abort_request(request_id)
            elif kind == "call":
                _, fn, done = command
                try:
                    done.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 (reported to the caller)
                    done.set_exception(e)

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait,
                                             RuntimeError(f"engine error: {error}"))
            self.engine.abort_request(request_id)
        self._streams.clear()
