"""Token sampling: greedy, or temperature with top-k / top-p from a per-request seeded
generator, so that seeded sampling is deterministic (and identical on every rank)."""

from __future__ import annotations

import torch

from runtime.sequence import SamplingParams


def make_generator(params: SamplingParams, request_id: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else 1_000_003 * (request_id + 1))
    return g


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    logits = logits.float().cpu()
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))
