"""A request checked against one engine before anything is queued: its prompt as token
ids within the vocabulary, and the sampling fields ``SamplingParams`` cannot check alone
(ids within the vocabulary). Each problem is one ``UserError`` line."""

from __future__ import annotations

import numbers
from typing import Any

from dsl.errors import UserError
from runtime.engine.sequence import SamplingParams


def encode_prompt(prompt: str | list[int], tokenizer: Any, vocab: int) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise UserError("text prompts need a tokenizer in the checkpoint; give token ids")
        return list(tokenizer.encode(prompt))
    ids = list(prompt)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise UserError(f"prompt token {i} is {str(t)[:40]!r}: token ids are integers")
        if not 0 <= t < vocab:
            raise UserError(f"prompt token {i} is {t}; the vocabulary has ids 0 to {vocab - 1}")
    return [int(t) for t in ids]


def check_params(params: SamplingParams, vocab: int) -> None:
    if params.top_k > vocab:
        raise UserError(f"top_k is {params.top_k}; the vocabulary has {vocab} tokens")
    for token, _ in params.logit_bias:
        if token >= vocab:
            raise UserError(
                f"logit_bias names token {token}; the vocabulary has ids 0 to {vocab - 1}"
            )
