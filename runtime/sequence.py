"""A request as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, found {self.max_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0 are required")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be 0 to {MAX_LOGPROBS}, found {self.logprobs}")


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
