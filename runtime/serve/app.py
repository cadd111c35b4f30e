"""The HTTP routes: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus
/health and /metrics (Prometheus). Every error is an OpenAI-shaped JSON body whose
message is one line; the server keeps serving after any of them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.engine import LLM
from runtime.serve.admission import Admitted, BadRequest, admit, chat_prompt, completion_prompt
from runtime.serve.engine_loop import EngineDead, EngineLoop, QueueFull
from runtime.serve.generation import (
    Generation,
    GenerationFailed,
    Piece,
    chat_logprobs,
    completion_logprobs,
)
from runtime.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    now,
    usage,
)

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


def build_app(llm: LLM, engine: EngineLoop, model_name: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="DeInfer", lifespan=lifespan)
    metrics = engine.metrics

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels(status="400").inc()
        return _error(400, _validation_message(exc))

    @app.exception_handler(BadRequest)
    async def bad(request: Request, exc: BadRequest) -> JSONResponse:
        metrics.rejected.labels(status=str(exc.status)).inc()
        return _error(exc.status, str(exc), exc.param)

    def start(req: Any, prompt: list[int], logprobs: int | None) -> tuple[Generation, Admitted]:
        if req.model != model_name:
            raise BadRequest(
                f"model {req.model!r} does not exist; this server serves {model_name!r}",
                status=404,
                param="model",
            )
        admitted = admit(req, prompt, llm, logprobs)
        try:
            handle = engine.submit(admitted.prompt, admitted.params)
        except QueueFull as exc:
            raise BadRequest(str(exc), status=503) from None
        except EngineDead as exc:
            raise BadRequest(f"the engine is not running: {exc}", status=503) from None
        return Generation(engine, handle, admitted.text), admitted

    async def respond(
        request: Request,
        gen: Generation,
        stream: bool,
        include_usage: bool,
        chunk: Callable[[Piece | None, str | None], dict],
        whole: Callable[[list[Piece]], dict],
    ) -> Response:
        prompt_tokens = len(gen.handle.prompt)
        if stream:

            async def events() -> AsyncIterator[str]:
                try:
                    async for piece in gen.pieces():
                        yield _sse(chunk(piece, None))
                except GenerationFailed as exc:
                    yield _sse(error_body(str(exc), "server_error"))
                    return
                yield _sse(chunk(None, gen.finish_reason))
                if include_usage:
                    yield _sse(
                        chunk(None, None)
                        | {"choices": [], "usage": usage(prompt_tokens, gen.completion_tokens)}
                    )
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            pieces = await gen.collect(request.is_disconnected)
        except GenerationFailed as exc:
            return _error(500, str(exc))
        if pieces is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(whole(pieces) | {"usage": usage(prompt_tokens, gen.completion_tokens)})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        gen, _ = start(req, completion_prompt(req, llm), req.logprobs)
        rid, created = new_id("cmpl"), now()
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        sent = 0

        def chunk(piece: Piece | None, finish: str | None) -> dict:
            nonlocal sent
            text = piece.text if piece else ""
            choice = {"index": 0, "text": text, "finish_reason": finish}
            choice["logprobs"] = None
            if piece:
                choice["logprobs"] = completion_logprobs(llm.tokenizer, [piece], sent)
            if piece and piece.token_id is not None:  # vLLM's extension: ids, tokenizer or not
                choice["token_ids"] = [piece.token_id]
            sent += len(text)
            return head | {"choices": [choice]}

        def whole(pieces: list[Piece]) -> dict:
            choice = {
                "index": 0,
                "text": "".join(p.text for p in pieces),
                "logprobs": completion_logprobs(llm.tokenizer, pieces, 0),
                "finish_reason": gen.finish_reason,
                "token_ids": [p.token_id for p in pieces if p.token_id is not None],
            }
            return head | {"choices": [choice]}

        return await respond(request, gen, req.stream, req.include_usage(), chunk, whole)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        top = (req.top_logprobs or 0) if req.logprobs else None
        gen, _ = start(req, chat_prompt(req, llm), top)
        rid, created = new_id("chatcmpl"), now()
        head = {"id": rid, "created": created, "model": model_name}
        first = True

        def chunk(piece: Piece | None, finish: str | None) -> dict:
            nonlocal first
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            first = False
            if piece:
                delta["content"] = piece.text
            logprobs = chat_logprobs(llm.tokenizer, [piece]) if piece else None
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return head | {"object": "chat.completion.chunk", "choices": [choice]}

        def whole(pieces: list[Piece]) -> dict:
            message = {"role": "assistant", "content": "".join(p.text for p in pieces)}
            choice = {
                "index": 0,
                "message": message,
                "logprobs": chat_logprobs(llm.tokenizer, pieces),
                "finish_reason": gen.finish_reason,
            }
            return head | {"object": "chat.completion", "choices": [choice]}

        return await respond(request, gen, req.stream, req.include_usage(), chunk, whole)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": now(),
            "owned_by": "deinfer",
            "max_model_len": llm.spec.runtime.max_seq_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        load = engine.load
        if not load.alive:
            return _error(503, f"the engine is not running: {load.error}")
        return JSONResponse({"status": "ok", "running": load.running, "waiting": load.waiting})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
