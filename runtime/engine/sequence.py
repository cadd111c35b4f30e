"""A request as the scheduler sees it."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from dsl.errors import UserError

MAX_LOGPROBS = 20  # the most alternatives a request may ask for (the OpenAI API's limit)
# Below this a temperature is refused, not rounded: logits / 1e-40 overflow fp32 and the
# probabilities turn NaN (measured: 1e-40 and 1e-46 sampled non-greedy tokens). 1e-5 keeps
# a logit gap of 30 at 3e6, far inside fp32; 0 is the way to ask for greedy.
MIN_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1  # a tensor element; the engine also refuses more than its vocabulary
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty|: the OpenAI API's range
MAX_LOGIT_BIAS = 100.0  # |bias| per token: the OpenAI API's range
MAX_BIASED_TOKENS = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; n: the chosen token's and the n most likely
    # Each prompt token's log-probability given the tokens before it, and the n most
    # likely there (OpenAI's ``echo`` with ``logprobs``); None: not computed.
    prompt_logprobs: int | None = None
    # Added to the logits before sampling (greedy too): (token id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Subtracted from a token's logit: frequency × its count in the output so far, and
    # presence once it occurs there (the OpenAI API's definitions, over generated tokens).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise UserError(f"{name} must be an integer, found {value!r}")
        if self.max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1, found {self.max_tokens}")
        # NaN fails every comparison, so each range is written to hold only for good values.
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise UserError(
                f"temperature must be 0 (greedy) or finite and >= {MIN_TEMPERATURE:g}, "
                f"found {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], found {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise UserError(f"top_k must be 0 (off) to {MAX_TOP_K}, found {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise UserError(f"seed must be in [0, 2**64), found {self.seed}")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            raise UserError("stop_token_ids must be integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise UserError(f"{name} must be 0 to {MAX_LOGPROBS}, found {value}")
        self._check_logit_adjustments()

    def _check_logit_adjustments(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise UserError(f"{name} must be in [-2, 2], found {value}")
        if len(self.logit_bias) > MAX_BIASED_TOKENS:
            raise UserError(
                f"logit_bias may name at most {MAX_BIASED_TOKENS} tokens, "
                f"found {len(self.logit_bias)}"
            )
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise UserError(f"logit_bias: token ids are integers >= 0, found {token!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise UserError(f"logit_bias[{token}] must be in [-100, 100], found {bias}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling changes the logits before choosing (bias or penalties)."""
        return bool(self.logit_bias or self.frequency_penalty or self.presence_penalty)


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
    # TokenLogprobs per prompt token (None for the first), once its prefill ran, if asked
    prompt_logprobs: list | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)
