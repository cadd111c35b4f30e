"""One choice's tokens, as the HTTP layer consumes them: the prompt first when echoed,
text deltas (stop strings applied), log-probabilities in the two OpenAI shapes, and
cancellation when the consumer goes away (a client that disconnects frees its KV blocks
at once)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from runtime.engine.sampling import TokenLogprobs
from runtime.serve.admission import Choice
from runtime.serve.engine_loop import EngineLoop, Finished, RequestHandle, TokenEvent


class GenerationFailed(Exception):
    """The engine ended the request with an error (a failed rank, a refused request)."""


@dataclass(frozen=True)
class Echo:
    """The prompt sent back (``echo``): each token's text and, if asked, log-probability
    given the tokens before it with the most likely alternatives by text (None for the
    first token: nothing comes before it)."""

    token_texts: list[str]
    logprobs: list[float | None] | None = None
    top: list[dict[str, float] | None] | None = None


@dataclass(frozen=True)
class Piece:
    text: str
    token_id: int | None  # None: text released at the end or the echoed prompt
    logprobs: TokenLogprobs | None
    echo: Echo | None = None


class Generation:
    """One choice of a request; ``executor`` decodes the echoed prompt off the loop."""

    def __init__(
        self,
        engine: EngineLoop,
        handle: RequestHandle,
        choice: Choice,
        executor: Executor | None = None,
    ) -> None:
        self.engine, self.handle, self.choice = engine, handle, choice
        self.text, self.executor = choice.text, executor
        self.finish_reason: str | None = None
        self.completion_tokens = 0

    async def pieces(self) -> AsyncIterator[Piece]:
        echo = self.choice.echo
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
                if echo:
                    echo = False
                    yield await self._echo(event)
                if self.choice.drop_output:  # max_tokens 0: the engine's one token
                    continue
                self.completion_tokens += 1
                delta = self.text.add(event.token_id)
                if self.text.stopped:  # a stop string: the rest is not wanted
                    self.finish_reason = "stop"
                    self.engine.cancel(self.handle, "stop")
                yield Piece(delta, event.token_id, event.logprobs)
        finally:
            if self.finish_reason is None:  # the consumer left (disconnect, cancel)
                self.engine.cancel(self.handle)

    async def _echo(self, first: TokenEvent) -> Piece:
        """The prompt's piece, its tokens decoded in the executor (a long prompt's
        thousands of decodes would hold up every stream on the loop)."""
        loop = asyncio.get_running_loop()
        args = (self.text.tokenizer, self.choice.prompt.ids, first.prompt_logprobs)
        echo = await loop.run_in_executor(self.executor, echo_of, *args)
        return Piece(self.choice.prompt.text, None, None, echo)


def token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"  # what vLLM prints for ids without a tokenizer
    return tokenizer.decode([token_id])


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each id's own text, in one call."""
    if tokenizer is None:
        return [f"token_id:{t}" for t in ids]
    return tokenizer.batch_decode([[t] for t in ids])


def echo_of(tokenizer: Any, ids: list[int], logprobs: list[TokenLogprobs | None] | None) -> Echo:
    texts = token_texts(tokenizer, ids)
    if logprobs is None:
        return Echo(texts)
    alternatives = sorted({t for lp in logprobs if lp is not None for t, _ in lp.top})
    named = dict(zip(alternatives, token_texts(tokenizer, alternatives), strict=True))
    top = [None if lp is None else {named[t]: v for t, v in lp.top} for lp in logprobs]
    return Echo(texts, [None if lp is None else lp.logprob for lp in logprobs], top)


def _top(tokenizer: Any, lp: TokenLogprobs) -> dict[str, float]:
    return {token_text(tokenizer, t): v for t, v in lp.top}


def completion_logprobs(tokenizer: Any, pieces: list[Piece], offset: int) -> dict | None:
    """The legacy completions shape: parallel lists per token, the echoed prompt's
    tokens first (the first of them has no log-probability: null, as OpenAI sends)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    out["text_offset"] = []
    for p in pieces:
        if p.echo is not None and p.echo.logprobs is not None:
            out["tokens"] += p.echo.token_texts
            out["token_logprobs"] += p.echo.logprobs
            out["top_logprobs"] += p.echo.top
            start = offset
            for text in p.echo.token_texts:
                out["text_offset"].append(offset)
                offset += len(text)
            offset = start + len(p.text)
            continue
        if p.logprobs is not None and p.token_id is not None:
            out["tokens"].append(token_text(tokenizer, p.token_id))
            out["token_logprobs"].append(p.logprobs.logprob)
            out["top_logprobs"].append(_top(tokenizer, p.logprobs))
            out["text_offset"].append(offset)
        offset += len(p.text)
    return out if out["tokens"] else None


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
