"""What the driver and a rank exchange for one step: each sequence's input
(``SeqInput``), what the step returns (``Sampled``), and how prefill packs prompts into
forwards of bounded size (``prefill_chunks``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.engine.sampling import TokenLogprobs
from runtime.engine.sequence import SamplingParams


@dataclass(frozen=True)
class Sampled:
    """What a step returns: a token per sequence, log-probabilities where any was asked,
    and the prompt's log-probabilities of the prefilled sequences that asked for them
    (by index in the step; position 0 has none: nothing comes before it)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: dict[int, list[TokenLogprobs | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class SeqInput:
    """What a rank needs of one sequence for one step."""

    id: int
    tokens: list[int]  # all tokens for prefill; the last one for decode
    length: int  # tokens in the sequence, the one being processed included
    block_table: list[int]
    params: SamplingParams
    prompt_logprobs: bool = False  # prefill: also score every token of ``tokens``


@dataclass(frozen=True)
class Piece:
    """Tokens start..stop-1 of sequence ``seq`` of a prefill batch."""

    seq: int
    start: int
    stop: int


def prefill_chunks(lengths: list[int], chunk: int) -> list[list[Piece]]:
    """Pack the prompts, in order, into forwards of at most ``chunk`` tokens; a prompt
    that does not fit continues in the next forward."""
    chunks: list[list[Piece]] = [[]]
    room = chunk
    for seq, length in enumerate(lengths):
        start = 0
        while start < length:
            if room == 0:
                chunks.append([])
                room = chunk
            stop = min(length, start + room)
            chunks[-1].append(Piece(seq, start, stop))
            room -= stop - start
            start = stop
    return chunks
