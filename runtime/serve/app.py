"""The HTTP routes: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus
/health and /metrics (Prometheus). Every error is an OpenAI-shaped JSON body whose
message is one line; the server keeps serving after any of them.

The event loop only moves bytes: a body is size-checked as it is read; parsing it,
tokenizing and the echoed prompt's decoding run in one worker thread, and the engine
runs in its own (``EngineLoop``)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from runtime.engine.llm import LLM
from runtime.serve.admission import Prompt, admit, chat_prompt, encode_prompts
from runtime.serve.body import DEFAULT_MAX_BODY_BYTES, BadRequest, parse, read_body
from runtime.serve.engine_loop import EngineDead, EngineLoop, QueueFull
from runtime.serve.generation import Generation, GenerationFailed, Piece
from runtime.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _Request,
    error_body,
    now,
    usage,
)
from runtime.serve.shapes import ChatShape, CompletionShape, Outcome

Shape = CompletionShape | ChatShape
T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
log = logging.getLogger("deinfer.serve")


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, kind, param), status_code=status)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Routes:
    """The endpoints of one server: one engine, one served model name."""

    def __init__(self, llm: LLM, engine: EngineLoop, model_name: str, max_body_bytes: int) -> None:
        self.llm, self.engine, self.model_name = llm, engine, model_name
        self.max_body_bytes = max_body_bytes
        self.metrics = engine.metrics
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="deinfer-tokenizer")

    async def bad(self, request: Request, exc: BadRequest) -> JSONResponse:
        self.metrics.rejected.labels(status=str(exc.status)).inc()
        return _error(exc.status, str(exc), exc.param)

    async def http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        self.metrics.rejected.labels(status=str(exc.status_code)).inc()
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    async def internal(self, request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}".splitlines()[0])

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

    async def _parse(self, request: Request, model: type[T]) -> T:
        body = await read_body(request, self.max_body_bytes)
        req = await self._off_loop(parse, model, body)  # megabytes of JSON: not on the loop
        if req.model != self.model_name:
            raise BadRequest(
                f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
            )
        return req

    def _start(
        self, req: _Request, prompts: list[Prompt], logprobs: int | None
    ) -> list[Generation]:
        choices = admit(req, prompts, self.llm, logprobs)
        try:
            handles = self.engine.submit_all([(c.prompt.ids, c.params) for c in choices])
        except QueueFull as exc:
            raise BadRequest(str(exc), status=503) from None
        except EngineDead as exc:
            raise BadRequest(f"the engine is not running: {exc}", status=503) from None
        return [
            Generation(self.engine, h, c, self.tokenizer_thread)
            for h, c in zip(handles, choices, strict=True)
        ]

    async def completions(self, request: Request) -> Response:
        req = await self._parse(request, CompletionRequest)
        prompts = await self._off_loop(encode_prompts, req, self.llm)
        gens = self._start(req, prompts, req.logprobs)
        shape = CompletionShape(self.llm.tokenizer, self.model_name)
        prompt_tokens = sum(len(p.ids) for p in prompts)
        return await _respond(request, gens, req, shape, prompt_tokens)

    async def chat_completions(self, request: Request) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        top = (req.top_logprobs or 0) if req.logprobs else None
        ids = await self._off_loop(chat_prompt, req, self.llm)
        gens = self._start(req, [Prompt(ids, "")], top)
        shape = ChatShape(self.llm.tokenizer, self.model_name)
        return await _respond(request, gens, req, shape, len(ids))

    async def models(self) -> dict:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": now(),
            "owned_by": "deinfer",
            "max_model_len": self.llm.spec.runtime.max_seq_len,
        }
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        load = self.engine.load
        if not load.alive:
            return _error(503, f"the engine is not running: {load.error}")
        return JSONResponse({"status": "ok", "running": load.running, "waiting": load.waiting})

    async def prometheus(self) -> Response:
        text = self.metrics.render()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Piece | None]]:
    """(index into ``gens``, piece) as they come, and (index, None) once that one has
    finished; a ``GenerationFailed`` of any ends it. Leaving early cancels them all."""
    if len(gens) == 1:  # the common case, without tasks
        async for piece in gens[0].pieces():
            yield 0, piece
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for piece in gen.pieces():
                queue.put_nowait((i, piece, None))
            queue.put_nowait((i, None, None))
        except GenerationFailed as exc:
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, piece, exc = await queue.get()
            if exc is not None:
                raise exc
            remaining -= piece is None
            yield i, piece
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _events(
    gens: list[Generation], shape: Shape, include_usage: bool, prompt_tokens: int
) -> AsyncIterator[str]:
    index = [g.choice.index for g in gens]
    try:
        async for i, piece in merged(gens):
            finish = gens[i].finish_reason if piece is None else None
            yield _sse(shape.chunk(index[i], piece, finish))
    except GenerationFailed as exc:
        yield _sse(error_body(str(exc), "server_error"))
        return
    if include_usage:
        counts = usage(prompt_tokens, sum(g.completion_tokens for g in gens))
        yield _sse(shape.head | {"choices": [], "usage": counts})
    yield _sse("[DONE]")


async def _collect(gens: list[Generation], disconnected) -> list[Outcome] | None:
    """Every choice whole, or None when ``await disconnected()`` turns true first."""
    pieces: list[list[Piece]] = [[] for _ in gens]

    async def consume() -> None:
        async for i, piece in merged(gens):
            if piece is not None:
                pieces[i].append(piece)

    task = asyncio.ensure_future(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
    task.result()
    return [Outcome(g.choice.index, p, g.finish_reason) for g, p in zip(gens, pieces, strict=True)]


async def _respond(
    request: Request, gens: list[Generation], req: _Request, shape: Shape, prompt_tokens: int
) -> Response:
    if req.stream:
        events = _events(gens, shape, req.include_usage(), prompt_tokens)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        outcomes = await _collect(gens, request.is_disconnected)
    except GenerationFailed as exc:
        return _error(500, str(exc))
    if outcomes is None:  # the client left; nobody reads this
        return Response(status_code=499)
    counts = usage(prompt_tokens, sum(g.completion_tokens for g in gens))
    return JSONResponse(shape.whole(outcomes) | {"usage": counts})


def build_app(
    llm: LLM, engine: EngineLoop, model_name: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    routes = Routes(llm, engine, model_name, max_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()
        routes.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="DeInfer", lifespan=lifespan)
    app.add_exception_handler(BadRequest, routes.bad)
    app.add_exception_handler(HTTPException, routes.http_error)
    app.add_exception_handler(Exception, routes.internal)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    app.get("/v1/models")(routes.models)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.prometheus)
    return app
