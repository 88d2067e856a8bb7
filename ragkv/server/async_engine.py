"""AsyncEngine: the engine loop in a thread of its own, driven from asyncio.

The engine is single-threaded by design. One background thread owns it: it takes commands
(add, abort, call) from a queue, runs `step()` while there is work, and hands each request's
outputs to that request's asyncio queue. HTTP handlers never touch the engine directly, so the
server schedules exactly as the offline API does. Prompts are tokenized and validated before
they reach that thread (`prepare`, on a tokenizer thread), so a large prompt never stalls the
steps of the requests already running. The rest of a request's CPU work (decoding its JSON,
validating it, building its sampling parameters and compiling its structured-output schema)
runs on worker threads too (`offload`), never on the event loop: /health and other clients'
streams do not wait for one request's parsing.

Rules that keep one request's trouble its own:
- every command runs under its own try: a failing or cancelled command (a caller that gave
  up waiting) never stops the loop;
- every stream ends: with its last output, with `RequestFailedError` when the engine failed
  the request, or with an end marker when it was aborted; when the loop stops, every open
  stream gets `EngineDeadError`, so no handler waits forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from ..engine.engine import Engine
from ..engine.scheduler import InvariantViolation
from ..inputs.prompt import ChunkedPrompt
from ..model.executor import EngineDeadError
from ..outputs import RequestOutput
from ..sampling.params import SamplingParams

logger = logging.getLogger("ragkv.server")

T = TypeVar("T")

# Worker threads for request parsing (`AsyncEngine.offload`): the general pool, and the pool
# that compiles structured-output schemas.
REQUEST_WORKERS = 4
STRUCTURED_WORKERS = 2

# Put into a stream's queue when its request was aborted: the iterator ends without a
# finished output.
_ABORTED = object()


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: object) -> None:
        """Thread-safe; a stream whose event loop is gone is simply dropped."""
        with contextlib.suppress(RuntimeError):  # the loop was closed
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class RequestFailedError(RuntimeError):
    """The engine failed this request (and only it); the message says why. `bad_request`:
    the request's own input caused it (a client error, 400)."""

    def __init__(self, message: str, bad_request: bool = False) -> None:
        super().__init__(message)
        self.bad_request = bad_request


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: Callable[[Engine, list[RequestOutput]], None]
                 | None = None, on_fatal: Callable[[BaseException], None] | None = None
                 ) -> None:
        """`on_fatal(error)` is called (on the engine thread) when the engine stops for good:
        a rank died or its bookkeeping was found inconsistent (EngineDeadError)."""
        self.engine = engine
        self._on_step = on_step
        self._on_fatal = on_fatal
        self.fatal: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        # Held while a command is queued and while the stopping loop empties the queue: no
        # command can slip in after the last drain and wait forever.
        self._inbox_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ragkv-engine", daemon=True)
        # One thread: tokenizers are not meant to be driven from many threads at once, and
        # one is enough to keep tokenization off both the event loop and the engine thread.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ragkv-tokenizer")
        # Request parsing (`offload`): several threads, so that one large body does not queue
        # the others behind it; and the compilation of structured-output schemas apart, so that
        # slow schemas only ever wait for each other, never a plain request.
        self._request_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=REQUEST_WORKERS, thread_name_prefix="ragkv-request")
        self._structured_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=STRUCTURED_WORKERS, thread_name_prefix="ragkv-structured")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)  # the loop ends every open stream on its way out
        for pool in (self._tokenizer_pool, self._request_pool, self._structured_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return not self._stopped and self._thread.is_alive()

    async def offload(self, fn: Callable[..., T], *args: object, structured: bool = False) -> T:
        """`fn(*args)` on a request worker thread, off the event loop and the engine thread:
        for the CPU work of parsing a request. `structured`: the work may compile a
        structured-output schema (unbounded by the body size), so it runs in a pool of its
        own. Exceptions reach the caller unchanged."""
        pool = self._structured_pool if structured else self._request_pool
        return await self._in(pool, functools.partial(fn, *args))

    async def _in(self, pool: concurrent.futures.Executor, call: Callable[[], T]) -> T:
        """`call()` on `pool`; EngineDeadError once the engine has stopped (and its pools
        with it) rather than the pool's own complaint."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        try:
            future = asyncio.get_running_loop().run_in_executor(pool, call)
        except RuntimeError as e:  # shut down between the check and the submission
            raise EngineDeadError("the engine loop is not running") from e
        return await future

    async def prepare(self, prompt: object, params: SamplingParams) -> ChunkedPrompt:
        """Tokenize and validate `prompt` off the event loop and off the engine thread;
        raises ValueError for bad input."""
        return await self._in(self._tokenizer_pool, functools.partial(
            self.engine.process_prompt, prompt, params))

    async def prepare_chat(self, messages: list[dict], documents: list[str] | None,
                           cache_salt: str | None, params: SamplingParams,
                           **rag_options: object) -> ChunkedPrompt:
        """Render, split, tokenize and validate a chat request like `prepare`; `rag_options`
        as in `Engine.process_chat`."""
        return await self._in(self._tokenizer_pool, functools.partial(
            self.engine.process_chat, messages, documents, cache_salt, params, **rag_options))

    async def submit(self, prompt: object, params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request; returns the iterator of its (cumulative) outputs.

        Raises ValueError if the engine rejects the request. If the consumer stops iterating
        early (a client disconnects), the request is aborted and its slots come back; a
        caller that never iterates must `abort` it. Cancelling this call aborts the request
        (whether or not the engine had taken it yet).
        """
        loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(loop, asyncio.Queue())
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("add", request_id, prompt, params, stream, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)  # commands run in order: after the add, if it happened
            raise
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
                if item is _ABORTED:
                    return
                if isinstance(item, BaseException):
                    finished = True  # the engine already let go of it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self.alive:
            self._put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], object]) -> object:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, done))
        return await asyncio.wrap_future(done)

    def _put(self, command: tuple) -> None:
        with self._inbox_lock:
            if not self.alive:
                raise EngineDeadError("the engine loop is not running")
            self._inbox.put(command)
        self._wake.set()

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            try:
                if self._drain() and self._on_step is not None:
                    self._on_step(engine, [])  # aborts change the gauges without a step
                if not engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = engine.step(include_unfinished=True)
                for out in outputs:
                    self._deliver(out)
                if self._on_step is not None:
                    self._on_step(engine, outputs)
            except EngineDeadError as e:
                # Not one request's fault and not a passing error: a rank is gone, or serving
                # on from this state could hand one request another's KV. Stop, loudly.
                logger.critical("the engine cannot go on, stopping: %s", e)
                self.fatal = e
                self._stopped = True
                if self._on_fatal is not None:
                    self._on_fatal(e)
            except Exception:  # a bug outside any one request: reset, keep serving
                logger.exception("engine loop error: failing the requests in flight")
                self._reset()
        reason = "the engine loop stopped"
        if isinstance(self.fatal, InvariantViolation):
            reason = f"the engine stopped: its state is inconsistent ({self.fatal})"
        elif self.fatal is not None:
            reason = f"the engine stopped: {self.fatal}"
        self._close_streams(EngineDeadError(reason))
        self._refuse_queued(EngineDeadError(reason))

    def _refuse_queued(self, error: EngineDeadError) -> None:
        """Answer the commands still queued when the loop stops: their callers get `error`
        instead of waiting on a loop that will never run them."""
        with self._inbox_lock:
            self._stopped = True  # `_put` refuses from here on
            while True:
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    return
                future = command[-1] if command[0] in ("add", "call") else None
                if future is not None and future.set_running_or_notify_cancel():
                    future.set_exception(error)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if out.finished:
            self._streams.pop(out.request_id, None)
        if stream is None:
            return
        if out.error is not None:
            stream.put(RequestFailedError(out.error, out.bad_request))
        else:
            stream.put(out)

    def _drain(self) -> int:
        """Carry out queued commands; returns how many there were."""
        count = 0
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return count
            count += 1
            try:
                self._execute(command)
            except Exception:  # noqa: BLE001 (one command's failure stays its own)
                logger.exception("engine command %r failed", command[0])

    def _execute(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, stream, accepted = command
            if not accepted.set_running_or_notify_cancel():
                return  # the caller gave up before the request was queued
            try:
                self.engine.add_request(prompt, params, request_id=request_id)
            except Exception as e:  # noqa: BLE001 (reported to the caller)
                accepted.set_exception(e)
                return
            self._streams[request_id] = stream
            accepted.set_result(None)
        elif kind == "abort":
            request_id = command[1]
            stream = self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)
            if stream is not None:
                stream.put(_ABORTED)  # wake whoever still waits on it
        elif kind == "call":
            _, fn, done = command
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 (reported to the caller)
                done.set_exception(e)

    def _reset(self) -> None:
        """Abort every request and end every stream: the caches return to a consistent
        state, with nothing running."""
        error = RequestFailedError("the engine hit an internal error and reset")
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
        self.engine.abort_all()
        self._close_streams(error)

    def _close_streams(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)
