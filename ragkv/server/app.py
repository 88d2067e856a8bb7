"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics and /debug/integrity."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from ..config import DEFAULT_MAX_BODY_BYTES
from ..inputs.prompt import RAGPrompt, parse_prompt
from ..outputs import RequestOutput
from ..sampling.params import SamplingParams
from .async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from .metrics import Metrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from .responses import ResponseFormatter

# Deeper JSON than this is refused: no valid request nests more than a few levels.
MAX_JSON_DEPTH = 32


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_name: str  # the name responses and metrics carry
    aliases: tuple[str, ...] = ()  # further names a request may give (--served-model-name)
    vllm_metric_names: bool = False  # /metrics: vLLM's series under `vllm:` too
    trust_request_chat_template: bool = False  # a request's `chat_template` is rendered
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = 30.0  # a request body must arrive within this (else 408)
    # Least time between two runs of /debug/integrity's full walk; concurrent callers share one.
    integrity_interval_s: float = 0.1


def build_app(engine: AsyncEngine, metrics: Metrics, config: ServerConfig) -> FastAPI:
    # No slash redirects: they would answer with a Location built from the client's Host header.
    app = FastAPI(title="ragkv", docs_url=None, redoc_url=None, redirect_slashes=False)
    tokenizer = engine.engine.tokenizer

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(ErrorResponse(exc.status_code, str(exc.detail)))

    app.add_middleware(_Guard, config=config)

    @app.get("/health")
    async def health() -> Response:
        # 503 once the engine loop has stopped (its state was found inconsistent): load
        # balancers take the replica out while it shuts down.
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    gate = _IntegrityGate(engine, config.integrity_interval_s)

    @app.get("/debug/integrity")
    async def integrity() -> JSONResponse:
        """Runs every cache's integrity check between engine steps (for tests and operators).
        Callers that arrive while a check waits to run share it, and checks are spaced by
        `integrity_interval_s`, so polling cannot stall the engine."""
        try:
            return JSONResponse(await gate.check())
        except AssertionError as e:
            return JSONResponse({"ok": False, "error": str(e)}, status_code=500)
        except EngineDeadError as e:
            return _error(ErrorResponse(503, str(e), "server_error"))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": created,
            "owned_by": "ragkv", "max_model_len": engine.engine.max_model_len,
            "recompute": engine.engine.recompute_settings()}
            for name in (config.model_name, *config.aliases)]})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        try:
            body = await _parse(request, TokenizeRequest, config, engine)
            _check_template(config, body.chat_template)
            ids = await engine.offload(_tokenize, engine, body)
        except ErrorResponse as e:
            return _error(e)
        except ValueError as e:
            return _error(ErrorResponse(400, str(e)))
        strs = ([tokenizer.convert_ids_to_tokens(t) for t in ids] if body.return_token_strs
                else None)
        return JSONResponse({"count": len(ids), "max_model_len": engine.engine.max_model_len,
                             "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        try:
            body = await _parse(request, DetokenizeRequest, config, engine)
            vocab = engine.engine.model_config.vocab_size
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise ErrorResponse(400, f"token id {bad} is outside the vocabulary "
                                         f"(0 .. {vocab - 1})", param="tokens")
            text = await engine.offload(tokenizer.decode, body.tokens)
        except ErrorResponse as e:
            return _error(e)
        return JSONResponse({"prompt": text})

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await _parse(request, CompletionRequest, config, engine)
            params, prompts = await engine.offload(_completion_request, engine, body,
                                                   structured=_constrained(body))
            prepared = [await engine.prepare(p, params) for p in prompts]
            _check_lengths(engine, prepared, params, body.max_tokens is not None)
        except ErrorResponse as e:
            return _error(e)
        except ValueError as e:
            return _error(ErrorResponse(400, str(e)))
        except EngineDeadError as e:
            return _error(_failure(e))
        return await _respond(request, body, params, prepared, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await _parse(request, ChatCompletionRequest, config, engine)
            _check_template(config, body.chat_template)
            params, messages = await engine.offload(_chat_request, engine, body,
                                                    structured=_constrained(body))
            prompt = await engine.prepare_chat(messages, body.documents, body.cache_salt,
                                               params, chunk_separator=body.chunk_separator,
                                               add_generation_prompt=body.add_generation_prompt,
                                               chat_template=body.chat_template,
                                               tools=body.tool_list(), **body.layout())
            explicit = body.max_tokens is not None or body.max_completion_tokens is not None
            _check_lengths(engine, [prompt], params, explicit)
        except ErrorResponse as e:
            return _error(e)
        except ValueError as e:
            return _error(ErrorResponse(400, str(e)))
        except EngineDeadError as e:
            return _error(_failure(e))
        return await _respond(request, body, params, [prompt], chat=True)

    async def _respond(request: Request, body, params, prompts: list, chat: bool):
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        streams: list[tuple[str, AsyncIterator[RequestOutput]]] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = f"{request_id}-{i}"
                streams.append((rid, await engine.submit(prompt, params, rid)))
        except (ValueError, EngineDeadError) as e:
            for rid, _ in streams:
                engine.abort(rid)
            if isinstance(e, EngineDeadError):
                return _error(ErrorResponse(503, str(e), "server_error"))
            return _error(ErrorResponse(400, str(e)))
        formatter = ResponseFormatter(request_id, config.model_name, chat, params, tokenizer,
                                      echo=not chat and bool(body.echo),
                                      prompt_logprobs=body.prompt_logprobs is not None,
                                      tools=body.tool_choice_of() if chat else None)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(engine, streams, formatter, include_usage),
                                     media_type="text/event-stream")
        finals: list[RequestOutput | None] = []
        watcher = asyncio.create_task(_abort_on_disconnect(request, engine, streams))
        try:
            for _, outputs in streams:
                last = None
                async for last in outputs:  # noqa: B007 (only the final output is kept)
                    pass
                finals.append(last)
        except (RequestFailedError, EngineDeadError) as e:
            for rid, _ in streams:
                engine.abort(rid)
            return _error(_failure(e))
        finally:
            watcher.cancel()
        if any(out is None or not out.finished for out in finals):
            return _error(ErrorResponse(499, "client disconnected", "client_closed"))
        return JSONResponse(formatter.full(finals))

    return app


class _Guard:
    """One Authorization header at most, the API key on /v1 and /debug, and the declared body
    size, checked before routing. Plain
    ASGI rather than FastAPI's http middleware, which hides client disconnects from the
    handlers behind it."""

    def __init__(self, app, config: ServerConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self._check(scope)
            if error is not None:
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope) -> ErrorResponse | None:
        raw_headers = scope.get("headers") or []
        headers = dict(raw_headers)
        # Two credentials are ambiguous: a proxy in front that checks the first would
        # disagree with a server that used the last. Refused on every path.
        count = sum(1 for name, _ in raw_headers if name.lower() == b"authorization")
        if count > 1:
            return ErrorResponse(400, f"the request has {count} Authorization headers: send "
                                      "exactly one")
        path = scope.get("path", "")
        key = self.config.api_key
        if key and path.startswith(("/v1", "/debug", "/tokenize", "/detokenize")):
            auth = headers.get(b"authorization", b"")
            if not hmac.compare_digest(auth, f"Bearer {key}".encode()):
                return ErrorResponse(401, "invalid or missing API key", "authentication_error")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.config.max_body_bytes:
            return ErrorResponse(413, f"request body over {self.config.max_body_bytes} bytes")
        return None


async def _abort_on_disconnect(request: Request, engine: AsyncEngine, streams: list) -> None:
    """A non-streaming response has nobody to notice a client leaving: poll for it."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    for rid, _ in streams:
        engine.abort(rid)


async def _parse(request: Request, model: type[BaseModel], config: ServerConfig,
                 engine: AsyncEngine):
    """The request body, read on the event loop (I/O only), then decoded and validated as
    `model` on a request worker thread (CPU work: up to max_body_bytes of JSON)."""
    # Only JSON: a browser page cannot send application/json to another origin without a
    # CORS preflight, which this server never grants, so no web page can drive it.
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise ErrorResponse(415, f"Content-Type must be application/json, got {ctype!r}")
    try:
        raw = await asyncio.wait_for(_read_body(request, config.max_body_bytes),
                                     config.body_timeout_s)
    except asyncio.TimeoutError:
        raise ErrorResponse(408, body_timeout_message(config.body_timeout_s)) from None
    except ClientDisconnect:
        raise ErrorResponse(499, "client disconnected", "client_closed") from None
    return await engine.offload(_decode, raw, model, config)


def body_timeout_message(timeout_s: float) -> str:
    """The message of the 408 for a body that did not arrive in time (here and in serve.py's
    connection-level deadline)."""
    return f"request body not received within {timeout_s:g} s"


def _decode(raw: bytes, model: type[BaseModel], config: ServerConfig):
    """JSON text -> the validated request (on a worker thread: see `_parse`)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, huge ints
        if isinstance(e, RecursionError):
            e = f"nested deeper than {MAX_JSON_DEPTH} levels"
        raise ErrorResponse(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise ErrorResponse(400, "the request body must be a JSON object")
    _check_json(data)
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = str(first["loc"][0]) if first["loc"] else "body"  # not pydantic's union path
        raise ErrorResponse(400, f"invalid field {where}: {first['msg']}", param=where) from None
    # `model` is optional on /tokenize and /detokenize.
    if body.model is not None and body.model not in (config.model_name, *config.aliases):
        raise ErrorResponse(404, f"The model `{body.model}` does not exist.", param="model")
    return body


def _constrained(body) -> bool:
    """Whether the request asks for a structured output: building its sampling parameters
    compiles a grammar, which goes to the structured-output workers."""
    return any(getattr(body, name) is not None for name in (
        "response_format", "guided_json", "guided_choice", "structured_outputs")) or (
        getattr(body, "tool_choice", None) not in (None, "none", "auto"))


def _completion_request(engine: AsyncEngine, body: CompletionRequest
                        ) -> tuple[SamplingParams, list]:
    """A completion request's sampling parameters (a schema compiled) and prompts, checked
    (on a worker thread: see `AsyncEngine.offload`)."""
    params = body.sampling_params()
    if body.suffix:
        raise ErrorResponse(400, "suffix is not supported", param="suffix")
    _check_not_streamed(body, params)
    prompts = _completion_prompts(body)
    _check_request_size(engine, len(prompts), params)
    return params, prompts


def _check_not_streamed(body, params: SamplingParams) -> None:
    """Echo and prompt logprobs come whole in a response body, not in stream chunks."""
    echo = bool(getattr(body, "echo", False))
    if body.stream and (echo or params.prompt_logprobs is not None):
        raise ErrorResponse(400, "echo and prompt_logprobs are not supported with stream",
                            param="echo" if echo else "prompt_logprobs")


def _check_template(config: ServerConfig, template: str | None) -> None:
    """A request's own chat template runs Jinja on the server (loops of any length): only
    where the operator trusts clients with it (vLLM's --trust-request-chat-template)."""
    if template is not None and not config.trust_request_chat_template:
        raise ErrorResponse(400, "chat_template in a request needs a server started with "
                                 "--trust-request-chat-template", param="chat_template")


def _tokenize(engine: AsyncEngine, body: TokenizeRequest) -> list[int]:
    """The token ids the engine would run for the request's prompt or chat (on a worker
    thread); `add_special_tokens` false: the prompt's text alone, unsplit, without them. The
    tokenizer cache is left alone: it serves requests that run (and counts them)."""
    if (body.prompt is None) == (body.messages is None):
        raise ErrorResponse(400, "give exactly one of prompt and messages",
                            param="messages" if body.messages is not None else "prompt")
    core = engine.engine
    inputs = core.inputs
    if body.messages is not None:
        return inputs.split_chat(_chat_messages(body.messages), body.documents, None,
                                 body.chunk_separator, body.add_generation_prompt,
                                 body.chat_template, use_token_cache=False,
                                 tools=body.tool_list()).token_ids
    if not body.add_special_tokens:
        if body.documents is not None or body.chunk_separator is not None:
            raise ErrorResponse(400, "add_special_tokens=false tokenizes the text alone: "
                                     "without documents or chunk_separator",
                                param="add_special_tokens")
        return core.tokenizer.encode(body.prompt, add_special_tokens=False)
    prompt = _text_prompts([body.prompt], body.documents, body.chunk_separator, {})[0]
    return parse_prompt(prompt, core.tokenizer, inputs.rules).token_ids


def _chat_request(engine: AsyncEngine, body: ChatCompletionRequest
                  ) -> tuple[SamplingParams, list[dict]]:
    """A chat request's sampling parameters and messages, checked (on a worker thread)."""
    params = body.sampling_params()
    _check_not_streamed(body, params)
    _check_request_size(engine, 1, params)
    return params, _chat_messages(body.messages)


def _chat_messages(messages: list) -> list[dict]:
    """Request messages as the chat template takes them (content text, tool calls)."""
    return [m.template_message(i) for i, m in enumerate(messages)]


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():  # bounded even without a Content-Length
        size += len(chunk)
        if size > limit:
            raise ErrorResponse(413, f"request body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_json(data: object) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings that are not valid Unicode (a
    lone surrogate, written as a \\ud800 escape): nothing downstream can take them."""
    stack: list[tuple[object, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ErrorResponse(400, f"malformed JSON body: nested deeper than "
                                     f"{MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                _check_unicode(key, where)
                stack.append((item, where, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_unicode(value, path)


def _check_unicode(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        field = where.split(".")[0].split("[")[0]
        raise ErrorResponse(400, f"{where or 'a key'} is not valid Unicode: it holds a lone "
                                 f"surrogate (U+{ord(text[e.start]):04X})",
                            param=field or None) from None


def _check_request_size(engine: AsyncEngine, num_prompts: int, params: SamplingParams) -> None:
    """Bounds a request's fan-out before anything is tokenized or queued."""
    eng = engine.engine
    if params.n > eng.config.max_n:
        raise ErrorResponse(400, f"n={params.n} exceeds max_n={eng.config.max_n}", param="n")
    seqs = num_prompts * params.n
    if seqs > eng.config.max_num_seqs:
        raise ErrorResponse(400, f"the request asks for {seqs} sequences ({num_prompts} "
                                 f"prompts x n={params.n}), more than max_num_seqs="
                                 f"{eng.config.max_num_seqs}", param="n")


def _check_lengths(engine: AsyncEngine, prompts: list, params: SamplingParams,
                   explicit_max_tokens: bool) -> None:
    """vLLM's rule: prompt plus max_tokens must fit max_model_len; and all the tokens a
    request may generate must fit the general KV region at once."""
    eng = engine.engine
    limit = eng.max_model_len
    total = 0
    for prompt in prompts:
        n = len(prompt.token_ids)
        if explicit_max_tokens and n + params.max_tokens > limit:
            raise ErrorResponse(
                400, f"This model's maximum context length is {limit} tokens. However, you "
                     f"requested {n + params.max_tokens} tokens ({n} in the prompt, "
                     f"{params.max_tokens} in the completion). Please reduce the length of "
                     "the prompt or the completion.", param="max_tokens")
        left = limit - n
        total += params.n * (min(params.max_tokens, left) if params.max_tokens is not None
                             else left)
    capacity = eng.kv.capacity
    if total > capacity:
        raise ErrorResponse(400, f"the request may generate {total} tokens in all (n x "
                                 f"max_tokens over its prompts), more than the KV cache holds "
                                 f"({capacity}); lower n or max_tokens", param="max_tokens")


def _completion_prompts(body: CompletionRequest) -> list:
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [{"prompt_token_ids": prompt}]
    else:
        prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]
    if not prompts:
        raise ErrorResponse(400, "prompt is empty", param="prompt")
    extra = body.layout()
    if body.cache_salt is not None:
        extra["cache_salt"] = body.cache_salt
    return _text_prompts(prompts, body.documents, body.chunk_separator, extra)


def _text_prompts(prompts: list, documents: list[str] | None, separator: str | None,
                  extra: dict) -> list:
    """Prompts (text, or token-id dicts) as the engine takes them: after `documents`, each
    text the question; else split at the request's `separator`; `extra` (RAG options, salt)
    carried by each."""
    if documents is not None:
        if separator is not None:
            raise ErrorResponse(400, "give documents or chunk_separator, not both",
                                param="chunk_separator")
        if not all(isinstance(p, str) for p in prompts):
            raise ErrorResponse(400, "documents need a text prompt (the question), not token "
                                     "ids", param="documents")
        # The documents are the chunks (trimmed, like separated ones); the prompt, after
        # them, the question.
        if any(not p.strip() for p in prompts):
            raise ErrorResponse(400, "the question (the prompt after the documents) is empty",
                                param="prompt")
        docs = [d.strip() for d in documents]
        return [RAGPrompt("", docs, p, **extra) for p in prompts]
    if separator is not None:
        extra = {**extra, "chunk_separator": separator}
    if extra:
        prompts = [{"prompt": p, **extra} if isinstance(p, str) else {**p, **extra}
                   for p in prompts]
    return prompts


def _failure(e: Exception) -> ErrorResponse:
    """What a request that failed in the engine tells its client: 400 when its own input
    caused it (a structured-output schema over the grammar's budget), 503 when the engine is
    gone, else 500."""
    if isinstance(e, RequestFailedError) and e.bad_request:
        return ErrorResponse(400, str(e))
    return ErrorResponse(503 if isinstance(e, EngineDeadError) else 500, str(e), "server_error")


def _error(e: ErrorResponse) -> JSONResponse:
    # After a 408 the rest of the body may still be on its way: end the connection rather
    # than read it.
    headers = {"Connection": "close"} if e.status == 408 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _stream(engine: AsyncEngine, streams: list, formatter: ResponseFormatter,
                  include_usage: bool) -> AsyncIterator[str]:
    """Merge the prompts' output streams into SSE chunks. If the client goes away the
    response is cancelled here, and every request still running is aborted."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, outputs) -> None:
        try:
            async for out in outputs:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 (forwarded to the client as an error event)
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, outputs)) for i, (_, outputs) in enumerate(streams)]
    finals: dict[int, RequestOutput] = {}
    open_streams = len(tasks)
    try:
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, Exception):
                yield f"data: {json.dumps(_failure(item).body())}\n\n"
                continue
            for chunk in formatter.delta(i, item):
                yield f"data: {json.dumps(chunk)}\n\n"
            if item.finished:
                finals[i] = item
        if include_usage:
            yield f"data: {json.dumps(formatter.usage_chunk(list(finals.values())))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        for i, (rid, _) in enumerate(streams):
            if i not in finals:
                engine.abort(rid)


class _IntegrityGate:
    """Runs the engine's integrity walk for /debug/integrity without letting callers stall the
    engine: a caller joins the next check that has not started yet (so its answer is never
    older than the call), one check runs at a time, and checks start at least `interval`
    seconds apart."""

    def __init__(self, engine: AsyncEngine, interval: float) -> None:
        self.engine = engine
        self.interval = interval
        self._lock = asyncio.Lock()
        self._next: asyncio.Future | None = None
        self._last_end = 0.0

    async def check(self) -> dict:
        if self._next is None:
            self._next = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._next)

    async def _run(self) -> dict:
        async with self._lock:
            self._next = None  # from now on callers wait for the check after this one
            wait = self._last_end + self.interval - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                return await self.engine.call(_integrity_report)
            finally:
                self._last_end = time.monotonic()


def _integrity_report(eng) -> dict:
    eng.check_integrity()
    stats = eng.stats()
    chunks = eng.chunk_cache_stats()
    return {"ok": True, "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "kv_capacity_tokens": stats.kv_capacity_tokens,
            "kv_free_tokens": stats.kv_free_tokens,
            "kv_available_tokens": stats.kv_available_tokens,
            "chunk_cache_used_tokens": chunks.used_tokens,
            "chunk_cache_capacity_tokens": chunks.capacity_tokens}
