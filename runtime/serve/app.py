"""The HTTP routes: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus
/health and /metrics (Prometheus). Every error is an OpenAI-shaped JSON body whose
message is one line; the server keeps serving after any of them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.engine.llm import LLM
from runtime.serve.admission import BadRequest, admit, chat_prompt, completion_prompt
from runtime.serve.engine_loop import EngineDead, EngineLoop, QueueFull
from runtime.serve.generation import Generation, GenerationFailed
from runtime.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    now,
    usage,
)
from runtime.serve.shapes import ChatShape, CompletionShape

Shape = CompletionShape | ChatShape

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, kind, param), status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}"
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return f"{where or 'body'}: {first['msg']}"


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Routes:
    """The endpoints of one server: one engine, one served model name."""

    def __init__(self, llm: LLM, engine: EngineLoop, model_name: str) -> None:
        self.llm, self.engine, self.model_name = llm, engine, model_name
        self.metrics = engine.metrics

    async def invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        self.metrics.rejected.labels(status="400").inc()
        return _error(400, _validation_message(exc))

    async def bad(self, request: Request, exc: BadRequest) -> JSONResponse:
        self.metrics.rejected.labels(status=str(exc.status)).inc()
        return _error(exc.status, str(exc), exc.param)

    def start(self, req: Any, prompt: list[int], logprobs: int | None) -> Generation:
        if req.model != self.model_name:
            raise BadRequest(
                f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
            )
        admitted = admit(req, prompt, self.llm, logprobs)
        try:
            handle = self.engine.submit(admitted.prompt, admitted.params)
        except QueueFull as exc:
            raise BadRequest(str(exc), status=503) from None
        except EngineDead as exc:
            raise BadRequest(f"the engine is not running: {exc}", status=503) from None
        return Generation(self.engine, handle, admitted.text)

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        gen = self.start(req, completion_prompt(req, self.llm), req.logprobs)
        shape = CompletionShape(self.llm.tokenizer, gen, self.model_name)
        return await _respond(request, gen, req.stream, req.include_usage(), shape)

    async def chat_completions(self, req: ChatCompletionRequest, request: Request) -> Response:
        top = (req.top_logprobs or 0) if req.logprobs else None
        gen = self.start(req, chat_prompt(req, self.llm), top)
        shape = ChatShape(self.llm.tokenizer, gen, self.model_name)
        return await _respond(request, gen, req.stream, req.include_usage(), shape)

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


async def _events(gen: Generation, include_usage: bool, shape: Shape) -> AsyncIterator[str]:
    try:
        async for piece in gen.pieces():
            yield _sse(shape.chunk(piece, None))
    except GenerationFailed as exc:
        yield _sse(error_body(str(exc), "server_error"))
        return
    yield _sse(shape.chunk(None, gen.finish_reason))
    if include_usage:
        counts = usage(len(gen.handle.prompt), gen.completion_tokens)
        yield _sse(shape.chunk(None, None) | {"choices": [], "usage": counts})
    yield _sse("[DONE]")


async def _respond(
    request: Request, gen: Generation, stream: bool, include_usage: bool, shape: Shape
) -> Response:
    if stream:
        events = _events(gen, include_usage, shape)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        pieces = await gen.collect(request.is_disconnected)
    except GenerationFailed as exc:
        return _error(500, str(exc))
    if pieces is None:  # the client left; nobody reads this
        return Response(status_code=499)
    counts = usage(len(gen.handle.prompt), gen.completion_tokens)
    return JSONResponse(shape.whole(pieces) | {"usage": counts})


def build_app(llm: LLM, engine: EngineLoop, model_name: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="DeInfer", lifespan=lifespan)
    routes = Routes(llm, engine, model_name)
    app.add_exception_handler(RequestValidationError, routes.invalid)
    app.add_exception_handler(BadRequest, routes.bad)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    app.get("/v1/models")(routes.models)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.prometheus)
    return app
