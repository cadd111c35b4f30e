"""The OpenAI response shapes of one request: the streamed chunks and the whole
response of /v1/completions and of /v1/chat/completions, each choice under its
``index`` (prompt index × n + sample index)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.serve.generation import Piece, chat_logprobs, completion_logprobs
from runtime.serve.protocol import new_id, now


@dataclass(frozen=True)
class Outcome:
    """One choice, finished."""

    index: int
    pieces: list[Piece]
    finish_reason: str | None


class CompletionShape:
    """``text_completion`` chunks and response; every chunk carries the token id
    (vLLM's extension: ids with or without a tokenizer)."""

    def __init__(self, tokenizer: Any, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.head = {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": model_name,
        }
        self.sent: dict[int, int] = {}  # characters sent per choice: the next text offset

    def chunk(self, index: int, piece: Piece | None, finish: str | None) -> dict:
        text = piece.text if piece else ""
        offset = self.sent.get(index, 0)
        choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": finish}
        choice["logprobs"] = completion_logprobs(self.tokenizer, [piece], offset) if piece else None
        if piece and piece.token_id is not None:
            choice["token_ids"] = [piece.token_id]
        self.sent[index] = offset + len(text)
        return self.head | {"choices": [choice]}

    def whole(self, outcomes: list[Outcome]) -> dict:
        choices = [
            {
                "index": o.index,
                "text": "".join(p.text for p in o.pieces),
                "logprobs": completion_logprobs(self.tokenizer, o.pieces, 0),
                "finish_reason": o.finish_reason,
                "token_ids": [p.token_id for p in o.pieces if p.token_id is not None],
            }
            for o in outcomes
        ]
        return self.head | {"choices": choices}


class ChatShape:
    """``chat.completion.chunk`` deltas (each choice's first names the role) and the
    ``chat.completion`` response."""

    def __init__(self, tokenizer: Any, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.head = {"id": new_id("chatcmpl"), "created": now(), "model": model_name}
        self.started: set[int] = set()

    def chunk(self, index: int, piece: Piece | None, finish: str | None) -> dict:
        delta: dict[str, str] = {} if index in self.started else {"role": "assistant"}
        self.started.add(index)
        if piece:
            delta["content"] = piece.text
        logprobs = chat_logprobs(self.tokenizer, [piece]) if piece else None
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self.head | {"object": "chat.completion.chunk", "choices": [choice]}

    def whole(self, outcomes: list[Outcome]) -> dict:
        choices = [
            {
                "index": o.index,
                "message": {"role": "assistant", "content": "".join(p.text for p in o.pieces)},
                "logprobs": chat_logprobs(self.tokenizer, o.pieces),
                "finish_reason": o.finish_reason,
            }
            for o in outcomes
        ]
        return self.head | {"object": "chat.completion", "choices": choices}
