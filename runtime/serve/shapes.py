"""The OpenAI response shapes of one request: the streamed chunks and the whole
response of /v1/completions and of /v1/chat/completions."""

from __future__ import annotations

from typing import Any

from runtime.serve.generation import Generation, Piece, chat_logprobs, completion_logprobs
from runtime.serve.protocol import new_id, now


class CompletionShape:
    """``text_completion`` chunks and response; every chunk carries the token id
    (vLLM's extension: ids with or without a tokenizer)."""

    def __init__(self, tokenizer: Any, gen: Generation, model_name: str) -> None:
        self.tokenizer, self.gen = tokenizer, gen
        self.head = {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": model_name,
        }
        self.sent = 0  # characters sent: the text offset of the next chunk's logprobs

    def chunk(self, piece: Piece | None, finish: str | None) -> dict:
        text = piece.text if piece else ""
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish}
        choice["logprobs"] = (
            completion_logprobs(self.tokenizer, [piece], self.sent) if piece else None
        )
        if piece and piece.token_id is not None:
            choice["token_ids"] = [piece.token_id]
        self.sent += len(text)
        return self.head | {"choices": [choice]}

    def whole(self, pieces: list[Piece]) -> dict:
        choice = {
            "index": 0,
            "text": "".join(p.text for p in pieces),
            "logprobs": completion_logprobs(self.tokenizer, pieces, 0),
            "finish_reason": self.gen.finish_reason,
            "token_ids": [p.token_id for p in pieces if p.token_id is not None],
        }
        return self.head | {"choices": [choice]}


class ChatShape:
    """``chat.completion.chunk`` deltas (the first one names the role) and the
    ``chat.completion`` response."""

    def __init__(self, tokenizer: Any, gen: Generation, model_name: str) -> None:
        self.tokenizer, self.gen = tokenizer, gen
        self.head = {"id": new_id("chatcmpl"), "created": now(), "model": model_name}
        self.first = True

    def chunk(self, piece: Piece | None, finish: str | None) -> dict:
        delta: dict[str, str] = {"role": "assistant"} if self.first else {}
        self.first = False
        if piece:
            delta["content"] = piece.text
        logprobs = chat_logprobs(self.tokenizer, [piece]) if piece else None
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self.head | {"object": "chat.completion.chunk", "choices": [choice]}

    def whole(self, pieces: list[Piece]) -> dict:
        message = {"role": "assistant", "content": "".join(p.text for p in pieces)}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(self.tokenizer, pieces),
            "finish_reason": self.gen.finish_reason,
        }
        return self.head | {"object": "chat.completion", "choices": [choice]}
