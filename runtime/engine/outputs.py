"""What the engine hands back: a finished request (``RequestOutput``), a streamed token
(``StreamEvent``), and the failure of one step (``StepFailed``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsl.errors import RuntimeFailure
from runtime.engine.sequence import Sequence


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    arrival: float = 0.0
    token_times: list[float] = field(default_factory=list)  # perf_counter per token
    num_preemptions: int = 0
    logprobs: list = field(default_factory=list)  # TokenLogprobs per token, if asked
    # TokenLogprobs per prompt token (None for the first), if ``prompt_logprobs`` asked
    prompt_logprobs: list | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass(frozen=True)
class StreamEvent:
    request: int  # index into the prompts given
    token_id: int | None  # None: the request ended with an error (``error`` says which)
    time: float  # perf_counter
    finished: bool
    error: str | None = None


class StepFailed(RuntimeFailure):
    """A step raised on the ranks while every rank stayed in step: the step's requests
    were ended (``finish_reason`` "error: ...", blocks freed) and the engine goes on."""

    def __init__(self, message: str, sequences: list[Sequence], details: str = "") -> None:
        super().__init__(message, details)
        self.sequences = sequences
