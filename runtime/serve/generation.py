"""One request's tokens, as the HTTP layer consumes them: text deltas (stop strings
applied), log-probabilities in the two OpenAI shapes, and cancellation when the consumer
goes away (a client that disconnects frees its KV blocks at once)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from runtime.engine.sampling import TokenLogprobs
from runtime.serve.engine_loop import EngineLoop, Finished, RequestHandle
from runtime.serve.text import TextStream


class GenerationFailed(Exception):
    """The engine ended the request with an error (a failed rank, a refused request)."""


@dataclass(frozen=True)
class Piece:
    text: str
    token_id: int | None  # None: text released at the end, no new token
    logprobs: TokenLogprobs | None


class Generation:
    def __init__(self, engine: EngineLoop, handle: RequestHandle, text: TextStream) -> None:
        self.engine, self.handle, self.text = engine, handle, text
        self.finish_reason: str | None = None
        self.completion_tokens = 0

    async def pieces(self) -> AsyncIterator[Piece]:
        try:
            while self.finish_reason is None:
                event = await self.handle.events.get()
                if isinstance(event, Finished):
                    self.engine.release(self.handle)
                    if event.reason.startswith("error"):
                        self.finish_reason = "error"
                        raise GenerationFailed(event.reason.removeprefix("error: "))
                    self.finish_reason = event.reason
                    if tail := self.text.flush():
                        yield Piece(tail, None, None)
                    return
                self.completion_tokens += 1
                delta = self.text.add(event.token_id)
                if self.text.stopped:  # a stop string: the rest is not wanted
                    self.finish_reason = "stop"
                    self.engine.cancel(self.handle)
                yield Piece(delta, event.token_id, event.logprobs)
        finally:
            if self.finish_reason is None:  # the consumer left (disconnect, cancel)
                self.engine.cancel(self.handle)

    async def collect(self, disconnected) -> list[Piece] | None:
        """All pieces, or None when ``await disconnected()`` turns true first."""
        out: list[Piece] = []

        async def consume() -> None:
            async for piece in self.pieces():
                out.append(piece)

        task = asyncio.ensure_future(consume())
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
        task.result()
        return out


def token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"  # what vLLM prints for ids without a tokenizer
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer: Any, pieces: list[Piece], offset: int) -> dict | None:
    """The legacy completions shape: parallel lists per token."""
    tokens = [p for p in pieces if p.logprobs is not None and p.token_id is not None]
    if not tokens:
        return None
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    out["text_offset"] = []
    for p in tokens:
        out["tokens"].append(token_text(tokenizer, p.token_id))
        out["token_logprobs"].append(p.logprobs.logprob)
        out["top_logprobs"].append({token_text(tokenizer, t): v for t, v in p.logprobs.top})
        out["text_offset"].append(offset)
        offset += len(p.text)
    return out


def chat_logprobs(tokenizer: Any, pieces: list[Piece]) -> dict | None:
    """The chat shape: one entry per token with its alternatives."""

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        {
            **entry(p.token_id, p.logprobs.logprob),
            "top_logprobs": [entry(t, v) for t, v in p.logprobs.top],
        }
        for p in pieces
        if p.logprobs is not None and p.token_id is not None
    ]
    return {"content": content} if content else None
