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

from ..config import DEFAULT_MAX_BODY_BYTES
from ..outputs import RequestOutput
from ..prompt import split_chat_prompt
from .async_engine import AsyncEngine, EngineDeadError
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def build_app(engine: AsyncEngine, metrics: Metrics, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="ragkv", docs_url=None, redoc_url=None)
    tokenizer = engine.engine.tokenizer
    separator = engine.engine.config.chunk_separator

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(ErrorResponse(exc.status_code, str(exc.detail)))

    app.add_middleware(_Guard, config=config)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/debug/integrity")
    async def integrity() -> JSONResponse:
        """Runs every cache's integrity check between engine steps (for tests and operators)."""
        def check(eng):
            eng.check_integrity()
            stats = eng.stats()
            chunks = eng.chunk_cache_stats()
            return {"ok": True, "num_running": stats.num_running,
                    "num_waiting": stats.num_waiting,
                    "kv_capacity_tokens": stats.kv_capacity_tokens,
                    "kv_free_tokens": stats.kv_free_tokens,
                    "kv_available_tokens": stats.kv_available_tokens,
                    "chunk_cache_used_tokens": chunks.used_tokens,
                    "chunk_cache_capacity_tokens": chunks.capacity_tokens}
        try:
            return JSONResponse(await engine.call(check))
        except AssertionError as e:
            return JSONResponse({"ok": False, "error": str(e)}, status_code=500)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "ragkv", "max_model_len": engine.engine.max_model_len,
        }]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await _parse(request, CompletionRequest, config)
            params = body.sampling_params()
            if body.echo or body.suffix:
                raise ErrorResponse(400, "echo and suffix are not supported",
                                    param="echo" if body.echo else "suffix")
            prompts = _completion_prompts(body)
        except ErrorResponse as e:
            return _error(e)
        except ValueError as e:
            return _error(ErrorResponse(400, str(e)))
        return await _respond(request, body, params, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await _parse(request, ChatCompletionRequest, config)
            params = body.sampling_params()
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt, _ = split_chat_prompt(tokenizer, messages, body.documents, separator,
                                          body.cache_salt)
        except ErrorResponse as e:
            return _error(e)
        except ValueError as e:
            return _error(ErrorResponse(400, str(e)))
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
        formatter = _Formatter(request_id, config.model_name, chat, params, tokenizer)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(engine, streams, formatter, include_usage),
                                     media_type="text/event-stream")
        finals: list[RequestOutput] = []
        watcher = asyncio.create_task(_abort_on_disconnect(request, engine, streams))
        try:
            for _, outputs in streams:
                last = None
                async for last in outputs:  # noqa: B007 (only the final output is kept)
                    pass
                finals.append(last)
        except RuntimeError as e:
            for rid, _ in streams:
                engine.abort(rid)
            return _error(ErrorResponse(500, str(e), "server_error"))
        finally:
            watcher.cancel()
        if any(out is None or not out.finished for out in finals):
            return _error(ErrorResponse(499, "client disconnected", "client_closed"))
        return JSONResponse(formatter.full(finals))

    return app


class _Guard:
    """API key on /v1 and /debug, and the declared body size, checked before routing. Plain
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
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        key = self.config.api_key
        if key and (path.startswith("/v1") or path.startswith("/debug")):
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


async def _parse(request: Request, model: type[BaseModel], config: ServerConfig):
    chunks, size = [], 0
    async for chunk in request.stream():  # bounded even without a Content-Length
        size += len(chunk)
        if size > config.max_body_bytes:
            raise ErrorResponse(413, f"request body over {config.max_body_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ErrorResponse(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise ErrorResponse(400, "the request body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = str(first["loc"][0]) if first["loc"] else "body"  # not pydantic's union path
        raise ErrorResponse(400, f"invalid field {where}: {first['msg']}", param=where) from None
    if body.model != config.model_name:
        raise ErrorResponse(404, f"The model `{body.model}` does not exist.", param="model")
    return body


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
    if body.cache_salt is not None:
        prompts = [{"prompt": p, "cache_salt": body.cache_salt} if isinstance(p, str)
                   else {**p, "cache_salt": body.cache_salt} for p in prompts]
    return prompts


def _error(e: ErrorResponse) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _stream(engine: AsyncEngine, streams: list, formatter: _Formatter,
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
                err = ErrorResponse(500, str(item), "server_error")
                yield f"data: {json.dumps(err.body())}\n\n"
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


class _Formatter:
    """Builds OpenAI response bodies and streaming chunks from engine outputs."""

    def __init__(self, request_id: str, model: str, chat: bool, params, tokenizer) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.params = params
        self.tokenizer = tokenizer
        self.n = params.n
        self.created = int(time.time())
        self._sent: dict[int, tuple[int, int]] = {}  # choice index -> (chars, tokens) sent
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    def _choice_index(self, prompt_index: int, completion_index: int) -> int:
        return prompt_index * self.n + completion_index

    def full(self, outputs: list[RequestOutput]) -> dict:
        choices = []
        for p, out in enumerate(outputs):
            for c in out.outputs:
                index = self._choice_index(p, c.index)
                choice = {"index": index, "finish_reason": c.finish_reason,
                          "logprobs": self._logprobs(c.token_ids, c.logprobs)}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = c.text
                    choice["stop_reason"] = c.stop_reason
                choices.append(choice)
        return {"id": self.request_id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self._usage(outputs)}

    def delta(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        chunks = []
        for c in out.outputs:
            index = self._choice_index(prompt_index, c.index)
            first = index not in self._sent
            chars, tokens = self._sent.get(index, (0, 0))
            text = c.text
            if c.finish_reason is None:
                # Hold back an incomplete UTF-8 character and what may become a stop string.
                end = len(text) - self._hold
                while end > chars and text[end - 1] == "\ufffd":
                    end -= 1
                text = text[:max(end, chars)]
            new_text = text[chars:]
            new_ids = c.token_ids[tokens:]
            if not new_text and not first and c.finish_reason is None:
                continue
            self._sent[index] = (chars + len(new_text), len(c.token_ids))
            if self.chat:
                delta = {"content": new_text}
                if first:
                    delta["role"] = "assistant"
                choice = {"index": index, "delta": delta}
            else:
                choice = {"index": index, "text": new_text}
            choice["logprobs"] = self._logprobs(
                new_ids, c.logprobs[tokens:] if c.logprobs is not None else None)
            choice["finish_reason"] = c.finish_reason
            if not self.chat:
                choice["stop_reason"] = c.stop_reason
            chunks.append({"id": self.request_id,
                           "object": "chat.completion.chunk" if self.chat else "text_completion",
                           "created": self.created, "model": self.model, "choices": [choice]})
        return chunks

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        return {"id": self.request_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "usage": self._usage(outputs)}

    def _usage(self, outputs: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _logprobs(self, token_ids: list[int], logprobs) -> dict | None:
        if logprobs is None:
            return None
        decode = self.tokenizer.decode
        if self.chat:
            content = []
            for tid, entry in zip(token_ids, logprobs, strict=False):
                token = decode([tid])
                top = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
                content.append({
                    "token": token, "logprob": entry[tid].logprob,
                    "bytes": list(token.encode()),
                    "top_logprobs": [
                        {"token": decode([t]), "logprob": lp.logprob,
                         "bytes": list(decode([t]).encode())}
                        for t, lp in top if lp.rank and lp.rank <= self.params.logprobs
                    ],
                })
            return {"content": content}
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = 0
        for tid, entry in zip(token_ids, logprobs, strict=False):
            token = decode([tid])
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
            token_logprobs.append(entry[tid].logprob)
            tops.append({decode([t]): lp.logprob for t, lp in entry.items()})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}
