"""A request as the scheduler sees it."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from dsl.errors import UserError

MAX_LOGPROBS = 20  # the most alternatives a request may ask for (the OpenAI API's limit)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; n: the chosen token's and the n most likely

    def __post_init__(self) -> None:
        for name in ("max_tokens", "top_k", "seed", "logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise UserError(f"{name} must be an integer, found {value!r}")
        if self.max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1, found {self.max_tokens}")
        # NaN fails every comparison, so each range is written to hold only for good values.
        if not (0 <= self.temperature < math.inf):
            raise UserError(f"temperature must be finite and >= 0, found {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], found {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0: off), found {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise UserError(f"seed must be in [0, 2**64), found {self.seed}")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            raise UserError("stop_token_ids must be integers")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise UserError(f"logprobs must be 0 to {MAX_LOGPROBS}, found {self.logprobs}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "stop" | "error: ..."
    num_preemptions: int = 0
    logprobs: list = field(default_factory=list)  # TokenLogprobs per output token, if asked

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)
