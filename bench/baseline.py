"""What the engine is compared with in ``deinfer bench``: transformers ``generate`` on the
same weights (the baseline a user would pick instead), and the physical floor of a
decode step (streaming the weights once from memory at the measured bandwidth)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


def memory_bandwidth(threads: int, megabytes: int = 512, reps: int = 5) -> float:
    """Bytes/s of reading a buffer far larger than the caches once (a sum over it), with
    ``threads`` intra-op threads; the median of ``reps``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(megabytes * (1 << 20) // 4)
        buffer.sum()  # touch every page first
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            buffer.sum()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return buffer.numel() * 4 / statistics.median(times)


class _TokenClock:
    """A ``generate`` streamer that notes when each new token is produced (the first
    ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def hf_throughput(model, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Greedy ``generate`` of ``output_len`` tokens for every prompt at once (equal
    lengths, so no padding; EOS ignored), with the figures of the engine's runs."""
    ids = torch.tensor(prompts)
    clock = _TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            streamer=clock,
            pad_token_id=0,
        )
    return throughput_figures(prompts, output_len, time.perf_counter() - start, clock.times)


def throughput_figures(
    prompts: list[list[int]], output_len: int, elapsed: float, token_times: list[float]
) -> dict[str, Any]:
    """A greedy run's figures, as the engine's runs report them: ``elapsed`` seconds for
    every prompt's ``output_len`` tokens (equal prompt lengths), ``token_times`` when each
    decode step's tokens were out (the first: the prompts')."""
    batch, out_tokens = len(prompts), len(prompts) * output_len
    decode_time = token_times[-1] - token_times[0]
    return {
        "seconds": elapsed,
        "requests_per_s": batch / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (out_tokens + batch * len(prompts[0])) / elapsed,
        "decode_tokens_per_s": batch * (output_len - 1) / decode_time if decode_time else 0.0,
    }
