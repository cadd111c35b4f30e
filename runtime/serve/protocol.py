"""The OpenAI request bodies the server accepts, validated by pydantic (a bad field is a
400 naming it), and the response bodies it sends.

Integers are strict (``true`` and ``1.0`` are not token ids), every list and string a
client controls is bounded, and a field of the OpenAI or vLLM API that this server does
not implement is refused unless it holds its "not used" value: nothing is accepted and
silently ignored."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from runtime.engine.sequence import (
    MAX_BIASED_TOKENS,
    MAX_LOGPROBS,
    MAX_TOP_K,
    MIN_TEMPERATURE,
)

MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions request
# Stop strings are matched against every token's text on the event loop: bounded so a
# request cannot make that check slow for everyone (10,000 strings of 100 characters
# stalled other streams for 8.6 s before the bound).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024

# Fields of the OpenAI and vLLM APIs that this server does not implement, with the values
# that mean "not used"; any other value is a 400, never ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do (clients send extras);
    # NaN and infinity are refused everywhere (`temperature: NaN` must not reach sampling).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=-1, le=MAX_TOP_K)  # vLLM's; 0 and -1: off
    seed: StrictInt | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: StrictBool = False  # vLLM's extension: do not stop at the tokenizer's EOS
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_BIASED_TOKENS)
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, unused in UNSUPPORTED.items():
                if name in data and data[name] not in unused:
                    raise ValueError(
                        f"{name} is not supported by this server (found {_describe(data[name])})"
                    )
        return data

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, found {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, found {len(strings)}")
        if any(len(s) > MAX_STOP_CHARS for s in strings):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdecimal() or len(key) > 12:
                raise ValueError(f"keys are token ids, found {_describe(key)}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases are in [-100, 100], found {bias} for token {key}")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stop if s)

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items()))

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    # One prompt or a list of them: a string, a list of token ids, or a list of either.
    prompt: list[str | list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=None, ge=0)  # 0: with echo, score only
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> list[Any]:
        if isinstance(value, str) or (_is_ids(value) and value):
            return [value]
        many = isinstance(value, list) and value
        if not many or not (all(isinstance(p, str) for p in value) or all(map(_is_ids, value))):
            raise ValueError(
                "expected a string, a list of token ids, or a non-empty list of strings or "
                f"of token-id lists; found {_describe(value)}"
            )
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, found {len(value)}")
        return value

    @model_validator(mode="after")
    def _max_tokens_zero_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only meaningful with echo (the prompt scored)")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text (a list of parts: its text parts joined)."""
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None):
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


FinishReason = Literal["stop", "length", "abort"]
